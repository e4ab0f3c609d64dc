"""The pooled MoE GEMMs. One program per (M-block, N-block); each M-block's B operand comes from a pool row
or, for a host code, from the layer's pinned host view, through an int64 row offset; same code path for both.

  gemm1: `act[slot, :I] = silu(x[tok] @ gate.T) * (x[tok] @ up.T)` over the aligned slots (w13 rows [2I, H]:
         gate rows first). Gate/up outputs and the activation are rounded to the compute dtype, as the torch
         path (`pooled_runner.moe.expert_mlp`) does.
  gemm2: `y[pair, :H] = act[slot] @ w2.T` (w2 rows [H, I]), written per routed pair; `combine` sums over k.

Blocks past `num_post_padded`, blocks with code -1 and padding slots are skipped (nothing read or written).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .align import AlignOutput
from .dequant import FMT_NVFP4, load_b_tile
from .operands import KernelFormat, Projection


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Decided when the kernels are imported (that is when triton.jit picks the interpreter), not per call.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether these kernels were imported under TRITON_INTERPRET=1 (CPU tests)."""
    return _INTERPRETING


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc += a @ b. DOT_F32: in fp32 (the interpreter's bf16 dot is wrong; bf16 products are exact in fp32)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _block_of(pid, num_pid_n, max_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering (GROUP_M M-blocks share their N sweep, for L2 reuse of a block's B)."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _row_bases(
    code,
    num_rows,
    wp,
    sp,
    zp,
    gp,
    wb,
    sb,
    zb,
    gb,
    w_se,
    s_se,
    z_se,
    g_se,
):
    """Base pointers of one expert's operands: pool row `code` or host row `code - R`; int64 row offsets."""
    if code >= num_rows:
        r = (code - num_rows).to(tl.int64)
        w_base = wb + r * w_se
        s_base = sb + r * s_se
        z_base = zb + r * z_se
        g_base = gb + r * g_se
    else:
        r = code.to(tl.int64)
        w_base = wp + r * w_se
        s_base = sp + r * s_se
        z_base = zp + r * z_se
        g_base = gp + r * g_se
    return w_base, s_base, z_base, g_base


@triton.jit
def _gemm1_kernel(
    x_ptr, act_ptr, sorted_ptr, codes_ptr, order_ptr, num_post_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_rows, max_blocks, I, H, stride_x, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _block_of(tl.program_id(0), tl.cdiv(I, BLOCK_N), max_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    blk = tl.load(order_ptr + pid_m)
    code = tl.load(codes_ptr + blk)
    if code < 0:
        return
    w_base, s_base, z_base, g_base = _row_bases(
        code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
    )
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(
            x_ptr + token[:, None] * stride_x + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        bg = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn, z_sn,
                         FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        bu = load_b_tile(w_base, s_base, z_base, g_base, offs_n + I, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                         z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        acc_g = _mma(a, bg, acc_g, DOT_F32)
        acc_u = _mma(a, bu, acc_u, DOT_F32)
    gate = acc_g.to(COMPUTE).to(tl.float32)
    up = acc_u.to(COMPUTE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
    ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_act + offs_n[None, :]
    tl.store(ptrs, act, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm2_kernel(
    act_ptr, y_ptr, sorted_ptr, codes_ptr, order_ptr, num_post_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_rows, max_blocks, H, I, stride_act, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _block_of(tl.program_id(0), tl.cdiv(H, BLOCK_N), max_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    blk = tl.load(order_ptr + pid_m)
    code = tl.load(codes_ptr + blk)
    if code < 0:
        return
    w_base, s_base, z_base, g_base = _row_bases(
        code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
    )
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    slot = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(
            act_ptr + slot[:, None] * stride_act + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, I, w_sn, s_sn, z_sn,
                        FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        acc = _mma(a, b, acc, DOT_F32)
    ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(ptrs, acc.to(COMPUTE), mask=row_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------------------------------------
def _as_kernel_tensor(t: torch.Tensor, native_fp8: bool) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn and not native_fp8:
        return t.view(torch.uint8)
    return t


def _launch_args(proj: Projection, fmt: KernelFormat) -> tuple[list[torch.Tensor], list[int], bool]:
    native_fp8 = not interpreting()
    ptrs = [_as_kernel_tensor(t, native_fp8) for t in proj.pointers()]
    strides = proj.row_strides()
    if fmt.fmt == FMT_NVFP4:
        # the packed bytes read as int32 words (8 values each; K % 16 == 0, rows 4-byte aligned): one load per
        # word in the kernel, the same nibble order as int4
        ptrs[0], ptrs[4] = ptrs[0].view(torch.int32), ptrs[4].view(torch.int32)
        strides[0] //= 4
        strides[4] //= 4
    return ptrs, strides, native_fp8


def _check_act_inputs(x: torch.Tensor, dtype: torch.dtype, name: str, k: int) -> None:
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype}, expected bf16 or fp16")
    if x.dtype != dtype:
        raise ValueError(f"{name}: dtype {x.dtype} differs from the compute dtype {dtype}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name}: shape {tuple(x.shape)} strides {x.stride()}, expected [*, {k}] row-major")


def _check_dense_dtype(fmt: KernelFormat, proj: Projection, dtype: torch.dtype) -> None:
    if fmt.fmt == 0 and proj.weight.dtype != dtype:
        raise ValueError(f"dense weights are {proj.weight.dtype}, activations {dtype}: expected one dtype")


def gemm1(
    x: torch.Tensor, align: AlignOutput, w13: Projection, fmt: KernelFormat, top_k: int, config: GemmConfig
) -> torch.Tensor:
    """`act [max_blocks * block_m, I]` (compute dtype) for the aligned slots; padding slots are left unset.

    x: `[T, H]` bf16/fp16, row-major. w13: the `[2I, H]` projection in pool and host view.
    """
    T, H = x.shape
    I = w13.weight.shape[1] // 2
    _check_act_inputs(x, x.dtype, "x", H)
    _check_dense_dtype(fmt, w13, x.dtype)
    if config.block_m != align.block_m:
        raise ValueError(f"config.block_m={config.block_m} != align block_m={align.block_m}")
    act = torch.empty((align.max_blocks * align.block_m, I), dtype=x.dtype, device=x.device)
    ptrs, strides, native = _launch_args(w13, fmt)
    grid = (align.max_blocks * triton.cdiv(I, config.block_n),)
    _gemm1_kernel[grid](
        x, act, align.sorted_pairs, align.block_codes, align.block_order, align.num_post_padded,
        *ptrs, *strides,
        T * top_k, w13.num_rows, align.max_blocks, I, H, x.stride(0), act.stride(0),
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, DOT_F32=interpreting(), COMPUTE=_TL_DTYPES[x.dtype],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return act


def gemm2(
    act: torch.Tensor,
    align: AlignOutput,
    w2: Projection,
    fmt: KernelFormat,
    num_pairs: int,
    config: GemmConfig,
) -> torch.Tensor:
    """`y [num_pairs, H]` (compute dtype): each routed pair's expert output; unrouted pairs are left unset."""
    H = w2.weight.shape[1]
    I = act.shape[1]
    _check_act_inputs(act, act.dtype, "act", I)
    _check_dense_dtype(fmt, w2, act.dtype)
    y = torch.empty((max(num_pairs, 1), H), dtype=act.dtype, device=act.device)
    ptrs, strides, native = _launch_args(w2, fmt)
    grid = (align.max_blocks * triton.cdiv(H, config.block_n),)
    _gemm2_kernel[grid](
        act, y, align.sorted_pairs, align.block_codes, align.block_order, align.num_post_padded,
        *ptrs, *strides,
        num_pairs, w2.num_rows, align.max_blocks, H, I, act.stride(0), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, DOT_F32=interpreting(), COMPUTE=_TL_DTYPES[act.dtype],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
