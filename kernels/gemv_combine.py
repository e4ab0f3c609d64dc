"""GEMV down's fused combine (`gemv_tiles._down_tile`): a (pair, N block)'s arrival, and the last arrival's sum
of the token's rows in k order (of the split parts in split order), as `combine` computes it."""

from __future__ import annotations

import triton
import triton.language as tl

from .ids import expert_or_none


@triton.jit
def _arrive_and_combine(pair, nb, y_ptr, part_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr, num_experts, H,
                        stride_y, stride_out, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
                        SPLIT: tl.constexpr):  # fmt: skip
    """The arrival of (pair, block `nb`) after its y (or parts) are stored: the last of the token's K * SPLIT
    arrivals (acquire) sums `out[t, nb block]` from the K rows of y, read from L2, and resets the counter."""
    t = pair // TOP_K
    num_nb = tl.cdiv(H, BLOCK_N)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    arrived = tl.atomic_add(cnt_ptr + t * num_nb + nb, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K * SPLIT - 1:
        tl.store(cnt_ptr + t * num_nb + nb, 0)  # ready for the next launch
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pk = t * TOP_K + k
            e = expert_or_none(tl.load(ids_ptr + pk), num_experts)
            routed = e >= 0  # expert_or_none: -1 outside [0, E)
            routed = routed & (tl.load(l2p_ptr + e, mask=routed, other=-1) >= 0)
            wk = tl.load(tw_ptr + pk).to(tl.float32)
            if SPLIT == 1:
                yk = tl.load(y_ptr + pk.to(tl.int64) * stride_y + offs_n, mask=n_ok & routed, other=0.0,
                             cache_modifier=".cg").to(tl.float32)  # fmt: skip
            else:
                yk = _sum_parts(part_ptr + (pk * SPLIT).to(tl.int64) * H + offs_n, H, n_ok & routed, SPLIT)
                yk = yk.to(COMPUTE).to(tl.float32)
            acc += tl.where(routed, wk * yk, 0.0)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_n, acc.to(COMPUTE), mask=n_ok)


@triton.jit
def _sum_parts(part, H, mask, SPLIT: tl.constexpr):
    """fp32 sum, in split order, of the SPLIT parts at `part + s * H` (read from L2)."""
    total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part + s * H, mask=mask, other=0.0, cache_modifier=".cg")
    return total
