"""The pooled MoE GEMMs. One program per (M-block, N-block); each M-block's B operand comes from a pool row
or, for a host code, from the layer's pinned host view, through an int64 row offset; same code path for both.

  gemm1: `act[slot, :I] = silu(x[tok] @ gate.T) * (x[tok] @ up.T)` over the aligned slots (w13 rows [2I, H]:
         gate rows first). Gate/up outputs and the activation are rounded to the compute dtype, as the torch
         path (`pooled_runner.moe.expert_mlp`) does.
  gemm2: `y[pair, :H] = act[slot] @ w2.T` (w2 rows [H, I]), written per routed pair; `combine` sums over k.

Blocks past `num_post_padded`, blocks with code -1 and padding slots are skipped (nothing read or written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .align import AlignOutput
from .decode_align import INLINE_MAX_PAIRS as INLINE_MAX_PAIRS  # re-exported
from .decode_align import (
    DecodeRouting,
    _aligned_block_by_id,
    _arrive_and_combine,
    _inline_args,
    _inline_block,
    _inline_block_by_id,
    _zero_unrouted_tokens,
    overlap_mode,
)
from .dequant import FMT_INT4, load_b_tile, load_w_tile
from .gemm_args import (
    _TL_DTYPES,
    _check_act_inputs,
    _check_dense_dtype,
    _check_proj_shape,
    _launch_args,
    launch_fitting,
)
from .gemm_args import interpreting as interpreting  # re-exported
from .gemm_parts import GemmConfig as GemmConfig  # re-exported: the tile config's users import it from here
from .gemm_parts import _block_of, _mma, _row_bases
from .operands import KernelFormat, Projection
from .workspace import MAX_SYNC_PAIRS, SYNC_WORDS, _counters


@triton.jit
def _gemm1_kernel(
    x_ptr, act_ptr, sorted_ptr, codes_ptr, order_ptr, num_post_ptr, ids_ptr, l2p_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_rows, max_blocks, I, H, stride_x, stride_act, num_experts,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
    INLINE_ALIGN: tl.constexpr = False, P_POW2: tl.constexpr = 16, HALF_INT4: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False, PDL: tl.constexpr = False, OVERLAP: tl.constexpr = False,
):  # fmt: skip
    if not OVERLAP:
        # the kernel before it; then gemm2 (reads l2p before its wait) may launch: kernels/pdl.py
        pdl.wait(PDL)
    pdl.trigger(PDL)  # OVERLAP: gemm2 settles host codes after its wait, as this kernel does before its loads
    pid_m, pid_n = _block_of(tl.program_id(0), tl.cdiv(I, BLOCK_N), max_blocks, GROUP_M)
    if OVERLAP:  # beside the plan + copy (plan_copy.py): wait for it only on a host code, and before the end
        if INLINE_ALIGN:
            blk, code, pair = _inline_block_by_id(
                pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows, BLOCK_M, P_POW2, PDL
            )
        else:  # aligned before the plan: codes_ptr holds the block experts
            blk, code, pair = _aligned_block_by_id(
                pid_m, sorted_ptr, codes_ptr, num_post_ptr, l2p_ptr, num_rows, BLOCK_M, PDL
            )
        if code < 0:
            pdl.wait(PDL)
            return
    elif INLINE_ALIGN:
        blk, code, pair = _inline_block(
            pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows, BLOCK_M, P_POW2
        )
        if code < 0:
            return
    else:
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
        blk = tl.load(order_ptr + pid_m)
        code = tl.load(codes_ptr + blk)
        if code < 0:
            return
        pair = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    w_base, s_base, z_base, g_base = _row_bases(
        code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
    )
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    if SWAP_AB:  # acc^T [BLOCK_N, BLOCK_M] = W_tile @ x^T (see GemmConfig.swap_ab)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        if SWAP_AB:
            xt = tl.load(
                x_ptr + token[None, :] * stride_x + offs_k[:, None],
                mask=row_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            wg = load_w_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                             z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            wu = load_w_tile(w_base, s_base, z_base, g_base, offs_n + I, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                             z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            acc_g = _mma(wg, xt, acc_g, DOT_F32)
            acc_u = _mma(wu, xt, acc_u, DOT_F32)
        else:
            a = tl.load(
                x_ptr + token[:, None] * stride_x + offs_k[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            bg = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                             z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            bu = load_b_tile(w_base, s_base, z_base, g_base, offs_n + I, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                             z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            acc_g = _mma(a, bg, acc_g, DOT_F32)
            acc_u = _mma(a, bu, acc_u, DOT_F32)
    gate = acc_g.to(COMPUTE).to(tl.float32)
    up = acc_u.to(COMPUTE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
    if SWAP_AB:
        ptrs = act_ptr + offs_m.to(tl.int64)[None, :] * stride_act + offs_n[:, None]
        tl.store(ptrs, act, mask=row_ok[None, :] & n_ok[:, None])
    else:
        ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_act + offs_n[None, :]
        tl.store(ptrs, act, mask=row_ok[:, None] & n_ok[None, :])
    if OVERLAP:
        # so that this kernel's completion implies the plan's (gemm2 and the next layer rely on it)
        pdl.wait(PDL)


@triton.jit
def _gemm2_kernel(
    act_ptr, y_ptr, sorted_ptr, codes_ptr, order_ptr, num_post_ptr, ids_ptr, l2p_ptr, tw_ptr, out_ptr, cnt_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_rows, max_blocks, H, I, stride_act, stride_y, num_experts, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
    INLINE_ALIGN: tl.constexpr = False, FUSE_COMBINE: tl.constexpr = False, P_POW2: tl.constexpr = 16,
    TOP_K: tl.constexpr = 1, K_POW2: tl.constexpr = 1, HALF_INT4: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False, PDL: tl.constexpr = False, OVERLAP: tl.constexpr = False,
):  # fmt: skip
    num_nb = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _block_of(tl.program_id(0), num_nb, max_blocks, GROUP_M)
    if FUSE_COMBINE:  # noqa: SIM102 (constexpr branch)
        if pid_m == 0:
            _zero_unrouted_tokens(out_ptr, ids_ptr, l2p_ptr, num_pairs // TOP_K, pid_n, H, stride_out,
                                  num_experts, TOP_K, K_POW2, P_POW2, BLOCK_N, COMPUTE)  # fmt: skip
    # nothing before pdl.wait reads what gemm1 writes (act); every program waits, early exits included
    if OVERLAP:  # gemm1 ran beside the plan + copy (see gemm1): the same rule for codes
        if INLINE_ALIGN:
            blk, code, pair = _inline_block_by_id(
                pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows, BLOCK_M, P_POW2, PDL
            )
        else:
            blk, code, pair = _aligned_block_by_id(
                pid_m, sorted_ptr, codes_ptr, num_post_ptr, l2p_ptr, num_rows, BLOCK_M, PDL
            )
        if code < 0:
            pdl.wait(PDL)
            return
    elif INLINE_ALIGN:
        blk, code, pair = _inline_block(
            pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows, BLOCK_M, P_POW2
        )
        if code < 0:
            pdl.wait(PDL)
            return
    else:
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            pdl.wait(PDL)
            return
        blk = tl.load(order_ptr + pid_m)
        code = tl.load(codes_ptr + blk)
        if code < 0:
            pdl.wait(PDL)
            return
        pair = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    w_base, s_base, z_base, g_base = _row_bases(
        code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
    )
    pdl.wait(PDL)
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = pair < num_pairs
    slot = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if SWAP_AB:  # acc^T [BLOCK_N, BLOCK_M] = W_tile @ act^T (see GemmConfig.swap_ab)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        if SWAP_AB:
            at = tl.load(
                act_ptr + slot[None, :] * stride_act + offs_k[:, None],
                mask=row_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            w = load_w_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, I, w_sn, s_sn, z_sn,
                            FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            acc = _mma(w, at, acc, DOT_F32)
        else:
            a = tl.load(
                act_ptr + slot[:, None] * stride_act + offs_k[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, I, w_sn, s_sn, z_sn,
                            FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4)  # fmt: skip
            acc = _mma(a, b, acc, DOT_F32)
    if SWAP_AB:
        ptrs = y_ptr + pair.to(tl.int64)[None, :] * stride_y + offs_n[:, None]
        tl.store(ptrs, acc.to(COMPUTE), mask=row_ok[None, :] & n_ok[:, None])
    else:
        ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(ptrs, acc.to(COMPUTE), mask=row_ok[:, None] & n_ok[None, :])
    if FUSE_COMBINE:
        _arrive_and_combine(y_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr, pair, row_ok, offs_n, n_ok, pid_n,
                            num_nb, num_experts, stride_y, stride_out, TOP_K, K_POW2, COMPUTE)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# int4 MMA tiles dequantized in the compute dtype with packed half ops (`dequant._int4_tile_h`: the same values
# as the fp32 path, about half the instructions per value on sm_90). On by default: on the H200 (2026-11-30,
# commit e87d7f6, bench/kernels.py --variants) bitwise the fp32 tiles' output and 1.08-1.09x faster on the
# DeepSeek-like int4-g128 layer at M=1 and 8 (213.4 -> 196.3 µs, 1145 -> 1068 µs). Under the interpreter only
# for fp16: Triton's interpreter stores bf16 as raw uint16 and has no bf16 arithmetic.
HALF_INT4 = True


# Triton 3.6 fails to compile the half-math int4 tiles of groups narrower than a K tile of 64 into the 64- and
# 128-row (wgmma) tiles for sm_90 ("PassManager::run failed" in TritonGPUOptimizeDotOperands; compiled without a
# GPU, 2026-12-07; Triton 3.8 compiles them): those take the fp32 int4 math, the same values
HALF_INT4_MIN_GROUP_WIDE = 64


def _half_int4(fmt: KernelFormat, dtype: torch.dtype, config: GemmConfig) -> bool:
    if config.block_m >= 64 and fmt.group < HALF_INT4_MIN_GROUP_WIDE:
        return False
    return HALF_INT4 and fmt.fmt == FMT_INT4 and (not interpreting() or dtype == torch.float16)


def gemm1(
    x: torch.Tensor,
    align: AlignOutput | None,
    w13: Projection,
    fmt: KernelFormat,
    top_k: int,
    config: GemmConfig,
    routing: DecodeRouting | None = None,
) -> torch.Tensor:
    """`act [max_blocks * block_m, I]` (compute dtype) for the aligned slots; padding slots are left unset.

    x: `[T, H]` bf16/fp16, row-major. w13: the `[2I, H]` projection in pool and host view.
    align None: the blocks are computed inside every program from `routing` (decode widths, <= INLINE_MAX_PAIRS
    pairs), at the same slots as `align_blocks` would place them. PDL (`kernels/pdl.py`): first waits for the
    kernel before it, except in OVERLAP (`routing.after_plan`): then only on a host code, and before it ends.
    """
    T, H = x.shape
    I = w13.weight.shape[1] // 2
    _check_act_inputs(x, x.dtype, "x", H)
    _check_dense_dtype(fmt, w13, x.dtype)
    _check_proj_shape(fmt, w13, 2 * I, H, "gemm1 w13")
    if align is not None and config.block_m != align.block_m:
        raise ValueError(f"config.block_m={config.block_m} != align block_m={align.block_m}")
    num_experts = routing.num_experts if routing is not None else 0
    tables, max_blocks = _inline_args(align, routing, T * top_k, num_experts, config.block_m)
    act = torch.empty((max_blocks * config.block_m, I), dtype=x.dtype, device=x.device)
    ptrs, strides, native = _launch_args(w13, fmt)
    ids, l2p = (routing.topk_ids, routing.l2p) if routing is not None else (tables[0], tables[1])
    grid = (max_blocks * triton.cdiv(I, config.block_n),)
    use_pdl = pdl.pdl_enabled(x, fmt.fmt)  # also a programmatic dependent of the kernel before it
    overlap = overlap_mode(align, routing, use_pdl)
    launch_fitting(_gemm1_kernel, grid,
        x, act, *tables, ids, l2p, *ptrs, *strides,
        T * top_k, w13.num_rows, max_blocks, I, H, x.stride(0), act.stride(0), num_experts,
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, DOT_F32=interpreting(), COMPUTE=_TL_DTYPES[x.dtype],
        INLINE_ALIGN=align is None, P_POW2=routing.p_pow2() if routing is not None else 16,
        HALF_INT4=_half_int4(fmt, x.dtype, config), SWAP_AB=config.swap_ab, PDL=use_pdl, OVERLAP=overlap,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return act


def gemm2(
    act: torch.Tensor,
    align: AlignOutput | None,
    w2: Projection,
    fmt: KernelFormat,
    num_pairs: int,
    config: GemmConfig,
    routing: DecodeRouting | None = None,
    fuse_combine: bool = False,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """`y [num_pairs, H]` (compute dtype): each routed pair's expert output; unrouted pairs are left unset.

    `y` given (`[>= max(num_pairs, 1), H]`, act's dtype and device, row-major): written in place and returned,
    only the rows of the pairs computed here (passes with disjoint location tables share one output: staging).

    align None: blocks computed in the programs from `routing` (as `gemm1`). fuse_combine (decode widths,
    `routing` with topk_weights): returns `out [T, H]` = `combine(y, ...)`, summed by the last of each token's
    routed-here pairs to finish an N block (arrival counters in `gemv`'s workspace, reset by the kernel).

    PDL (`kernels/pdl.py`, sm_90+): gemm2 may start before the kernel before it (gemm1) ends. Until its wait it
    reads only the routing tables (align output, or topk ids and l2p) and, with fuse_combine, zeroes rows of
    its fresh `out`; so between gemm1's launch and this call nothing may write those tables, and only `act` may
    be pending from gemm1 (every caller launches gemm1 then gemm2 back to back).
    """
    H = w2.weight.shape[1]
    I = act.shape[1]
    _check_act_inputs(act, act.dtype, "act", I)
    _check_dense_dtype(fmt, w2, act.dtype)
    _check_proj_shape(fmt, w2, H, I, "gemm2 w2")
    if align is not None and config.block_m != align.block_m:
        raise ValueError(f"config.block_m={config.block_m} != align block_m={align.block_m}")
    num_experts = routing.num_experts if routing is not None else 0
    tables, max_blocks = _inline_args(align, routing, num_pairs, num_experts, config.block_m)
    if y is None:
        y = torch.empty((max(num_pairs, 1), H), dtype=act.dtype, device=act.device)
    elif (
        fuse_combine
        or y.dim() != 2
        or y.shape[0] < max(num_pairs, 1)
        or y.shape[1] != H
        or y.stride(1) != 1
        or y.dtype != act.dtype
        or y.device != act.device
    ):
        raise ValueError(
            f"gemm2 y: shape {tuple(y.shape)} strides {y.stride()} {y.dtype} on {y.device}, expected "
            f"[>= {max(num_pairs, 1)}, {H}] row-major {act.dtype} on {act.device} (and no fuse_combine)"
        )
    ptrs, strides, native = _launch_args(w2, fmt)
    num_nb = triton.cdiv(H, config.block_n)
    # a programmatic dependent of the kernel before it on the stream (gemm1, or the workspace fill of a first
    # fused-combine call at this size, itself launched after gemm1 completed): kernels/pdl.py
    use_pdl = pdl.pdl_enabled(act, fmt.fmt)
    if fuse_combine:
        if routing is None or routing.topk_weights is None or num_pairs > MAX_SYNC_PAIRS:
            raise ValueError(
                f"gemm2 fuse_combine: decode routing with topk_weights, <= {MAX_SYNC_PAIRS} pairs"
            )
        T, K = routing.topk_ids.shape
        out = torch.empty((T, H), dtype=act.dtype, device=act.device)
        cnt = _counters(act.device, T * num_nb)[SYNC_WORDS:]
        ids, l2p, tw = routing.topk_ids, routing.l2p, routing.topk_weights
    else:
        K = 1
        out, cnt = y, tables[0]
        ids, l2p = (routing.topk_ids, routing.l2p) if routing is not None else (tables[0], tables[1])
        tw = y
    launch_fitting(_gemm2_kernel, (max_blocks * num_nb,),
        act, y, *tables, ids, l2p, tw, out, cnt,
        *ptrs, *strides,
        num_pairs, w2.num_rows, max_blocks, H, I, act.stride(0), y.stride(0), num_experts, out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, DOT_F32=interpreting(), COMPUTE=_TL_DTYPES[act.dtype],
        INLINE_ALIGN=align is None, FUSE_COMBINE=fuse_combine,
        P_POW2=routing.p_pow2() if routing is not None else 16, TOP_K=K, K_POW2=triton.next_power_of_2(K),
        HALF_INT4=_half_int4(fmt, act.dtype, config), SWAP_AB=config.swap_ab, PDL=use_pdl,
        OVERLAP=overlap_mode(align, routing, use_pdl),
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return out if fuse_combine else y
