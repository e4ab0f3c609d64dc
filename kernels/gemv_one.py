"""GEMV decode path in one launch (`GemvConfig.one_launch`): gate_up and down tiles in one grid
(`_fused_kernel`), a down tile waiting for its pair's act; see `gemv.py` for the path and the kernel for why
the waits cannot deadlock and what happens if one gives up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_args import _TL_DTYPES, _check_act_inputs, _check_dense_dtype, _check_proj_shape
from .gemv import SPIN_LIMIT
from .gemv_args import _check_gemv, _half_x, _word_args
from .gemv_config import _VALUES_PER_WORD, GemvConfig, _pairs_pow2, reg_limit
from .gemv_schedule import _slot_pair
from .gemv_tiles import _down_tile, _gate_up_tile
from .operands import KernelFormat, Projection
from .workspace import SYNC_WORDS, _counters


@triton.jit
def _wait_for_act(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit):
    """A down tile: poll until the pair's `nb1` gate_up tiles are counted (at most `spin_limit` polls, then
    raise the sticky error word), acquire their act, count this tile past the wait; the pair's last of `nb2`
    resets both counters for the next launch."""
    polls = 0
    while (tl.load(ready_ptr + pair, volatile=True) < nb1) & (polls < spin_limit):
        polls += 1
    if polls >= spin_limit:  # thread 0's verdict is the one that counts: it alone acquires below
        tl.store(sync_ptr, 1)
    # every warp has left the loop before this program counts as passed (the pair's last waiter resets
    # `ready`: a warp still polling then would poll to the limit; as `plan_sync._wait_for_plan`)
    tl.debug_barrier()
    tl.atomic_add(ready_ptr + pair, 0, sem="acquire", scope="gpu")  # order the act loads after the wait
    tl.debug_barrier()  # ... every warp's act loads, not only the acquiring thread's
    if tl.atomic_add(passed_ptr + pair, 1, sem="relaxed") == nb2 - 1:
        # the pair's last waiter: reset for the next launch (atomics, as every other access to the counters)
        tl.atomic_xchg(ready_ptr + pair, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(passed_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fused_kernel(
    x_ptr, act_ptr, y_ptr, out_ptr, sync_ptr, ids_ptr, l2p_ptr, tw_ptr,
    wp1, sp1, zp1, gp1, wb1, sb1, zb1, gb1,
    w_se1, s_se1, z_se1, g_se1, w_sn1, s_sn1, z_sn1,
    wp2, sp2, zp2, gp2, wb2, sb2, zb2, gb2,
    w_se2, s_se2, z_se2, g_se2, w_sn2, s_sn2, z_sn2,
    num_pairs, num_experts, num_rows, H, I, stride_x, stride_act, stride_y, stride_out, c0, c1, spin_limit,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, VPW: tl.constexpr,
    PREFETCH: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr, TICKETS: tl.constexpr,
    SYNC: tl.constexpr, HALF_X1: tl.constexpr, HALF_X2: tl.constexpr,
):  # fmt: skip
    """gate_up tiles (work items [0, G1)) then down tiles (G1 on) in one launch. A down tile waits until its
    pair's act is complete (a per-pair count of finished gate_up tiles); gate_up items never wait, and every
    down item is taken after all gate_up items were taken (TICKETS: items in the order programs arrive; else
    by program id, relying on blocks being dispatched in id order), so waiting cannot deadlock. The wait
    gives up after `spin_limit` polls and raises the sticky error word (results are then wrong, not hung).
    Counters are reset by their last user; `sync_ptr` words: [0] error, [1] ticket, [2, 2 + P) ready per pair,
    [2 + P, 2 + 2P) down tiles past their wait per pair, then the combine arrival counters."""
    nb1 = tl.cdiv(I, BLOCK_N1)
    nb2 = tl.cdiv(H, BLOCK_N2)
    g1 = num_pairs * nb1
    total = g1 + num_pairs * nb2
    ready_ptr = sync_ptr + 2
    passed_ptr = sync_ptr + 2 + P_POW2
    cnt_ptr = sync_ptr + SYNC
    if TICKETS:
        item = tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
        if item == total - 1:  # every item is taken: reset for the next launch
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
    else:
        item = tl.program_id(0)
    if item < g1:
        pair, code = _slot_pair(ids_ptr, l2p_ptr, item // nb1, num_pairs, num_experts, num_rows, P_POW2)
        _gate_up_tile(
            pair, code, item % nb1, 0, 0, x_ptr, act_ptr, act_ptr, cnt_ptr, ids_ptr, l2p_ptr, act_ptr,
            wp1, sp1, zp1, gp1, wb1, sb1, zb1, gb1, w_se1, s_se1, z_se1, g_se1, w_sn1, s_sn1, z_sn1,
            num_pairs, num_experts, num_rows, I, H, stride_x, stride_act, 0, c0, c1,
            TOP_K, P_POW2, BLOCK_N1, BLOCK_K1, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH, EVEN_K1,
            1, HALF_X1, False,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's act stores before the (release) count
        tl.atomic_add(ready_ptr + pair, 1, sem="release", scope="gpu")
    else:
        item2 = item - g1
        pair, code = _slot_pair(ids_ptr, l2p_ptr, item2 // nb2, num_pairs, num_experts, num_rows, P_POW2)
        _wait_for_act(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit)
        _down_tile(
            pair, code, item2 % nb2, 0, 0, act_ptr, y_ptr, y_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
            act_ptr, wp2, sp2, zp2, gp2, wb2, sb2, zb2, gb2, w_se2, s_se2, z_se2, g_se2, w_sn2, s_sn2, z_sn2,
            num_experts, num_rows, H, I, stride_act, stride_y, stride_out, 0, c0, c1,
            TOP_K, BLOCK_N2, BLOCK_K2, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH, True,
            EVEN_K2, True, 1, HALF_X2, False,
        )  # fmt: skip


def gemv_one_launch(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    config: GemvConfig,
) -> torch.Tensor:
    """`gemv_moe` in one launch (`_fused_kernel`): the same tiles and result as the two launches."""
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    _check_act_inputs(hidden, hidden.dtype, "hidden", H)
    _check_dense_dtype(fmt, w13, hidden.dtype)
    _check_dense_dtype(fmt, w2, hidden.dtype)
    _check_proj_shape(fmt, w13, 2 * I, H, "one-launch GEMV w13")
    _check_proj_shape(fmt, w2, H, I, "one-launch GEMV w2")
    _check_gemv(fmt, H, config.block_k1)
    _check_gemv(fmt, I, config.block_k2)
    tw = topk_weights.contiguous()
    if tw.shape != (T, K) or not topk_ids.is_contiguous() or hidden.shape[0] != T:
        raise ValueError(
            f"topk_weights {tuple(tw.shape)}, topk_ids {tuple(topk_ids.shape)}, T={hidden.shape[0]}"
        )
    num_pairs = T * K
    act = torch.empty((max(num_pairs, 1), I), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((max(num_pairs, 1), H), dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:  # top-k 0: every token's output is the empty sum
        return torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device)
    nb1, nb2 = triton.cdiv(I, config.block_n1), triton.cdiv(H, config.block_n2)
    sync = _counters(hidden.device, T * nb2)
    if w13.num_rows != w2.num_rows:
        raise ValueError(f"w13 has {w13.num_rows} pool rows, w2 {w2.num_rows}: expected one pool")
    ptrs1, strides1, native, c0, c1 = _word_args(w13, fmt)
    ptrs2, strides2, _, _, _ = _word_args(w2, fmt)
    _fused_kernel[(num_pairs * (nb1 + nb2),)](
        hidden, act, y, out, sync, topk_ids, l2p, tw, *ptrs1, *strides1, *ptrs2, *strides2,
        num_pairs, num_experts, w13.num_rows, H, I, hidden.stride(0), act.stride(0), y.stride(0),
        out.stride(0), c0, c1, SPIN_LIMIT,
        TOP_K=K, P_POW2=_pairs_pow2(num_pairs, config.schedule_width), BLOCK_N1=config.block_n1,
        BLOCK_K1=config.block_k1, BLOCK_N2=config.block_n2, BLOCK_K2=config.block_k2, FMT=fmt.fmt, GROUP=fmt.group,
        HAS_ZERO=fmt.has_zero, NATIVE_FP8=native, COMPUTE=_TL_DTYPES[hidden.dtype],
        VPW=_VALUES_PER_WORD[fmt.fmt], PREFETCH=config.prefetch_code(), EVEN_K1=H % config.block_k1 == 0,
        EVEN_K2=I % config.block_k2 == 0, TICKETS=config.tickets, SYNC=SYNC_WORDS,
        HALF_X1=_half_x(config, fmt, H), HALF_X2=_half_x(config, fmt, I), num_warps=config.num_warps, num_stages=1,
        **reg_limit(config),
    )  # fmt: skip
    return out
