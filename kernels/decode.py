"""Decode path (few routed pairs): two launches, no align, no separate combine.

  gemm1_pairs:   one program per (routed pair, N-block of I): the pair's expert is located in the program
                 (`l2p[topk_ids]`), `act[pair, :I] = silu(x[t] @ gate.T) * (x[t] @ up.T)`. Programs of host
                 rows run first (their order is computed in each program from the step's ids, host pairs
                 first, then pool pairs, each in pair order).
  gemm2_combine: one program per (token, N-block of H) loops over the token's K pairs in k order:
                 `out[t] = sum_k w[t, k] * round(act[t*K + k] @ w2.T)` in fp32, as `combine` sums the rounded
                 per-pair outputs; no atomics, so the result does not depend on scheduling or residency.
A token whose experts repeat across tokens reads them once per pair (L2 serves the repeats): this path is for
steps with T*K <= DECODE_MAX_PAIRS. Graph-safe: fixed buffers, nothing read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import load_b_tile
from .gemm_args import (
    _TL_DTYPES,
    _check_act_inputs,
    _check_dense_dtype,
    _check_proj_shape,
    _launch_args,
    interpreting,
    launch_fitting,
)
from .gemm_parts import GemmConfig, _mma
from .gemv_schedule import _pair_code
from .ids import expert_or_none
from .operands import KernelFormat, Projection

DECODE_MAX_PAIRS = 64


@triton.jit
def _row_offset(code, num_rows, bank_delta, row_stride):
    """Element offset of location `code` from the pool base: pool row, or host row through `bank_delta` (the
    host view's address minus the pool's, in elements); int64."""
    is_host = code >= num_rows
    r = tl.where(is_host, code - num_rows, code).to(tl.int64)
    return tl.where(is_host, bank_delta, 0) + r * row_stride


@triton.jit
def _gemm1_pairs_kernel(
    x_ptr, act_ptr, ids_ptr, l2p_ptr,
    wp, sp, zp, gp, wd, sd, zd, gd,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_experts, num_rows, I, H, stride_x, stride_act,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    num_pid_n = tl.cdiv(I, BLOCK_N)
    slot = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    # the step's pairs in schedule order: host rows, then pool rows, then unrouted (skipped)
    p = tl.arange(0, P_POW2)
    e = expert_or_none(tl.load(ids_ptr + p, mask=p < num_pairs, other=-1), num_experts)
    ok = e >= 0  # masked pairs and ids outside [0, E) are -1
    codes = tl.where(ok, tl.load(l2p_ptr + e, mask=ok, other=-1), -1)
    host = (codes >= num_rows).to(tl.int32)
    pool = ((codes >= 0) & (codes < num_rows)).to(tl.int32)
    num_host = tl.sum(host, axis=0)
    pos = tl.where(host != 0, tl.cumsum(host, axis=0) - 1, num_host + tl.cumsum(pool, axis=0) - 1)
    pos = tl.where((host + pool) != 0, pos, P_POW2)
    mine = pos == slot
    pair = tl.sum(tl.where(mine, p, 0), axis=0)
    code = tl.sum(tl.where(mine, codes, 0), axis=0)
    if tl.sum(mine.to(tl.int32), axis=0) == 0:
        return
    w_base = wp + _row_offset(code, num_rows, wd, w_se)
    s_base = sp + _row_offset(code, num_rows, sd, s_se)
    z_base = zp + _row_offset(code, num_rows, zd, z_se)
    g_base = gp + _row_offset(code, num_rows, gd, g_se)
    token = (pair // TOP_K).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_ptr + token * stride_x + rows[:, None] * 0 + offs_k[None, :],
                    mask=(rows == 0)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        bg = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn, z_sn,
                         FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        bu = load_b_tile(w_base, s_base, z_base, g_base, offs_n + I, offs_k, n_ok, k_ok, k0, H, w_sn, s_sn,
                         z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        acc_g = _mma(a, bg, acc_g, DOT_F32)
        acc_u = _mma(a, bu, acc_u, DOT_F32)
    gate = acc_g.to(COMPUTE).to(tl.float32)
    up = acc_u.to(COMPUTE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
    ptrs = act_ptr + pair.to(tl.int64) * stride_act + rows[:, None] * 0 + offs_n[None, :]
    tl.store(ptrs, act, mask=(rows == 0)[:, None] & n_ok[None, :])


@triton.jit
def _gemm2_combine_kernel(
    act_ptr, out_ptr, ids_ptr, l2p_ptr, tw_ptr,
    wp, sp, zp, gp, wd, sd, zd, gd,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_experts, num_rows, H, I, stride_act, stride_out,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    num_pid_n = tl.cdiv(H, BLOCK_N)
    t = (tl.program_id(0) // num_pid_n).to(tl.int64)
    pid_n = tl.program_id(0) % num_pid_n
    rows = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    num_kt = tl.cdiv(I, BLOCK_K)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one flat loop over (k, K tile) so the loads stay pipelined across the token's experts
    for it in range(0, TOP_K * num_kt):
        kk = it // num_kt
        k0 = (it % num_kt) * BLOCK_K
        pair = t * TOP_K + kk
        code = _pair_code(ids_ptr, l2p_ptr, pair, num_experts)
        routed = code >= 0
        code = tl.maximum(code, 0)
        w_base = wp + _row_offset(code, num_rows, wd, w_se)
        s_base = sp + _row_offset(code, num_rows, sd, s_se)
        z_base = zp + _row_offset(code, num_rows, zd, z_se)
        g_base = gp + _row_offset(code, num_rows, gd, g_se)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < I) & routed
        a = tl.load(act_ptr + pair * stride_act + rows[:, None] * 0 + offs_k[None, :],
                    mask=(rows == 0)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = load_b_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, n_ok & routed, k_ok, k0, I, w_sn, s_sn,
                        z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K)  # fmt: skip
        acc = _mma(a, b, acc, DOT_F32)
        last = k0 + BLOCK_K >= I
        wk = tl.load(tw_ptr + pair).to(tl.float32)
        y = acc.to(COMPUTE).to(tl.float32)  # the per-pair output, rounded as gemm2 stores it
        out = tl.where(last & routed, out + wk * y, out)
        acc = tl.where(last, 0.0, acc)
    ptrs = out_ptr + t * stride_out + rows[:, None] * 0 + offs_n[None, :]
    tl.store(ptrs, out.to(COMPUTE), mask=(rows == 0)[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------------------------------------
def _delta_args(proj: Projection, fmt: KernelFormat) -> tuple[list[torch.Tensor], list[int], list[int], bool]:
    """Pool pointers, host-view deltas (host address minus pool address, in elements) and strides."""
    ptrs, strides, native = _launch_args(proj, fmt)
    deltas = []
    for pool_t, bank_t in zip(ptrs[:4], ptrs[4:]):
        delta = bank_t.data_ptr() - pool_t.data_ptr()
        size = pool_t.element_size()
        if delta % size:
            raise ValueError(f"host view and pool of one operand are not {size}-byte aligned to each other")
        deltas.append(delta // size)
    return ptrs[:4], deltas, strides, native


def decode_configs(H: int, I: int) -> tuple[GemmConfig, GemmConfig]:
    """Tiles of the decode path: N blocks small enough that the few programs still cover the SMs."""
    if interpreting():
        return GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1)
    bn1 = 32 if I <= 1024 else 64
    bn2 = 16 if H <= 4096 else 32
    return GemmConfig(16, bn1, 128, 1, 4, 4), GemmConfig(16, bn2, 128, 1, 4, 4)


def decode_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
) -> torch.Tensor:
    """`pooled_fused_moe` for T*K <= DECODE_MAX_PAIRS (same contract, same result up to MMA tile order)."""
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    num_pairs = T * K
    if num_pairs > DECODE_MAX_PAIRS:
        raise ValueError(f"decode path: {num_pairs} pairs > DECODE_MAX_PAIRS={DECODE_MAX_PAIRS}")
    _check_act_inputs(hidden, hidden.dtype, "hidden", H)
    _check_dense_dtype(fmt, w13, hidden.dtype)
    _check_dense_dtype(fmt, w2, hidden.dtype)
    _check_proj_shape(fmt, w13, 2 * I, H, "decode path w13")
    _check_proj_shape(fmt, w2, H, I, "decode path w2")
    ids = topk_ids.contiguous()
    tw = topk_weights.contiguous()
    if tw.shape != (T, K):
        raise ValueError(f"topk_weights: shape {tuple(tw.shape)}, expected [{T}, {K}]")
    cfg1, cfg2 = configs or decode_configs(H, I)
    if cfg1.swap_ab or cfg2.swap_ab:
        raise ValueError("decode path (kernels/decode.py): no swapped-operand tiles; pass unswapped configs")
    dtype = _TL_DTYPES[hidden.dtype]
    act = torch.empty((max(num_pairs, 1), I), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device)
    if T == 0:
        return out
    ptrs, deltas, strides, native = _delta_args(w13, fmt)
    launch_fitting(_gemm1_pairs_kernel, (num_pairs * triton.cdiv(I, cfg1.block_n),),
        hidden, act, ids, l2p, *ptrs, *deltas, *strides,
        num_pairs, num_experts, w13.num_rows, I, H, hidden.stride(0), act.stride(0),
        TOP_K=K, P_POW2=max(16, triton.next_power_of_2(num_pairs)), BLOCK_M=16, BLOCK_N=cfg1.block_n,
        BLOCK_K=cfg1.block_k, FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, COMPUTE=dtype, DOT_F32=interpreting(),
        num_warps=cfg1.num_warps, num_stages=cfg1.num_stages,
    )  # fmt: skip
    ptrs, deltas, strides, native = _delta_args(w2, fmt)
    launch_fitting(_gemm2_combine_kernel, (T * triton.cdiv(H, cfg2.block_n),),
        act, out, ids, l2p, tw, *ptrs, *deltas, *strides,
        num_experts, w2.num_rows, H, I, act.stride(0), out.stride(0),
        TOP_K=K, BLOCK_M=16, BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k,
        FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero,
        NATIVE_FP8=native, COMPUTE=dtype, DOT_F32=interpreting(),
        num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
    )  # fmt: skip
    return out
