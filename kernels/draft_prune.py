"""Draft-lane pruning of one layer of an MTP verify step in one launch (`pooled_runner/draft_prune.py` has the
rule and why): replaces the ~25 torch ops of `draft_prune_reference` (one launch each in a graph) by one program.

One program, three phases over global scratch `paid [E + 1]` int8, ordered by barriers (the program's own
stores are visible to its threads after `tl.debug_barrier()`, as in `align.py`):
  1. `paid[e] = l2p[e] < R` for e < E, `paid[E] = 1` (the slot of ids that are not routed);
  2. `paid[e] = 1` for every expert routed by a request's lane 0 (same-value stores, order irrelevant);
  3. per block of requests `[BLOCK_R, LANES, K]`: unpaid routes per lane added to the lane's step total
     `misses`, lane 0 always ok, a lane dies when its total exceeds `max_misses` or `alive` already says dead;
     a running sum of dead lanes along the lanes kills every higher lane (chain); writes `alive` and `misses`,
     and the routes with dead lanes as padding (-1, weight 0).
Graph-safe: no host sync; the outputs and the scratch are fresh allocations (the graph's pool under capture).
"""

from __future__ import annotations

import torch

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

BLOCK_R = 16  # requests per block of phase 3
BLOCK_E = 256  # experts per block of phase 1


def draft_prune_check(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    alive: torch.Tensor,
    misses: torch.Tensor,
    num_rows: int,
    num_experts: int,
    num_spec: int,
    max_misses: int,
) -> None:
    """ValueError naming the argument unless shapes, dtypes, strides and devices fit (before any launch)."""
    if (
        topk_ids.dim() != 2
        or topk_ids.dtype not in (torch.int32, torch.int64)
        or not topk_ids.is_contiguous()
    ):
        raise ValueError(
            f"topk_ids: shape {tuple(topk_ids.shape)} dtype {topk_ids.dtype}; expected contiguous [T, K] int32/int64"
        )
    T = topk_ids.shape[0]
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} dtype {topk_weights.dtype}; expected "
            f"{tuple(topk_ids.shape)} floating"
        )
    if l2p.dim() != 1 or l2p.dtype != torch.int32 or l2p.shape[0] < num_experts:
        raise ValueError(
            f"l2p: shape {tuple(l2p.shape)} dtype {l2p.dtype}; expected [>= {num_experts}] int32"
        )
    if alive.shape != (T,) or alive.dtype != torch.bool:
        raise ValueError(f"alive: shape {tuple(alive.shape)} dtype {alive.dtype}; expected [{T}] bool")
    if misses.shape != (T,) or misses.dtype != torch.int32:
        raise ValueError(f"misses: shape {tuple(misses.shape)} dtype {misses.dtype}; expected [{T}] int32")
    if num_spec < 1 or T % (1 + num_spec):
        raise ValueError(f"{T} tokens do not split into requests of 1 + num_spec {num_spec} lanes")
    if num_rows < 1 or num_experts < 1 or max_misses < 0:
        raise ValueError(
            f"num_rows={num_rows}, num_experts={num_experts}, max_misses={max_misses} out of range"
        )
    for name, t in (("topk_weights", topk_weights), ("l2p", l2p), ("alive", alive), ("misses", misses)):
        if t.device != topk_ids.device or not t.is_contiguous():
            raise ValueError(
                f"{name}: on {t.device} with strides {t.stride()}; expected contiguous on {topk_ids.device}"
            )


def draft_prune_reference(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    alive: torch.Tensor,
    misses: torch.Tensor,
    num_rows: int,
    num_experts: int,
    num_spec: int,
    max_misses: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `draft_prune` (same arguments, same results): `alive [T]` and `misses [T]` updated in
    place; returns `(topk_ids, topk_weights)` with dead lanes' routes as padding (-1, 0)."""
    draft_prune_check(topk_ids, topk_weights, l2p, alive, misses, num_rows, num_experts, num_spec, max_misses)
    T, K = topk_ids.shape
    lanes, E = 1 + num_spec, num_experts
    ids = topk_ids.to(torch.int64)  # [T, K]
    routed = (ids >= 0) & (ids < E)
    safe = torch.where(routed, ids, E)  # [T, K], E: the "not routed" slot, always paid
    paid = torch.ones(E + 1, dtype=torch.bool, device=ids.device)  # [E + 1]
    paid[:E] = l2p[:E] < num_rows
    paid.index_fill_(0, safe.view(T // lanes, lanes, K)[:, 0].reshape(-1), True)
    misses += (~paid[safe]).sum(1).to(torch.int32)  # [T] unpaid routes of the step so far
    ok = (misses <= max_misses).view(T // lanes, lanes)  # [requests, lanes]
    ok[:, 0] = True  # lane 0 is never pruned
    chain = (alive.view(T // lanes, lanes) & ok).to(torch.int32).cumprod(1) > 0  # a dead lane kills the rest
    alive.copy_(chain.reshape(T))
    keep = alive[:, None]  # [T, 1]
    return (
        torch.where(keep, topk_ids, -1).to(topk_ids.dtype),
        torch.where(keep, topk_weights, 0).to(topk_weights.dtype),
    )


if triton is not None:

    @triton.jit
    def _draft_prune_kernel(
        ids_ptr, w_ptr, l2p_ptr, alive_ptr, misses_ptr, paid_ptr, ids_out_ptr, w_out_ptr,
        num_requests, num_rows, num_experts, max_misses,
        LANES: tl.constexpr, LANES_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        # 1. resident experts are paid; slot E (not routed) always
        for e0 in range(0, num_experts + 1, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            code = tl.load(l2p_ptr + e, mask=e < num_experts, other=0)
            paid = tl.where(e < num_experts, code < num_rows, 1)
            tl.store(paid_ptr + e, paid.to(tl.int8), mask=e <= num_experts)
        tl.debug_barrier()
        # 2. lane 0's experts are paid
        k = tl.arange(0, K_POW2)
        for r0 in range(0, num_requests, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            m = (r[:, None] < num_requests) & (k[None, :] < K)
            e = tl.load(ids_ptr + r[:, None] * (LANES * K) + k[None, :], mask=m, other=-1)
            ok = m & (e >= 0) & (e < num_experts)
            tl.store(paid_ptr + tl.where(ok, e, 0), tl.full([BLOCK_R, K_POW2], 1, tl.int8), mask=ok)
        tl.debug_barrier()
        # 3. lanes: count unpaid routes, chain, write
        j = tl.arange(0, LANES_POW2)
        for r0 in range(0, num_requests, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            t = r[:, None] * LANES + j[None, :]  # [BR, LP]
            tmask = (r[:, None] < num_requests) & (j[None, :] < LANES)
            off = t[:, :, None] * K + k[None, None, :]  # [BR, LP, KP]
            m3 = tmask[:, :, None] & (k[None, None, :] < K)
            e = tl.load(ids_ptr + off, mask=m3, other=-1)
            routed = m3 & (e >= 0) & (e < num_experts)
            paid = tl.load(paid_ptr + tl.where(routed, e, num_experts), mask=m3, other=1)
            num_unpaid = tl.sum((routed & (paid == 0)).to(tl.int32), axis=2)  # [BR, LP]
            num_unpaid += tl.load(misses_ptr + t, mask=tmask, other=0)
            tl.store(misses_ptr + t, num_unpaid, mask=tmask)
            ok = (num_unpaid <= max_misses) | (j[None, :] == 0)
            alive_in = tl.load(alive_ptr + t, mask=tmask, other=0)
            dead = tl.where(tmask & ((alive_in == 0) | (ok == 0)), 1, 0)
            alive = tmask & (tl.cumsum(dead, axis=1) == 0)
            tl.store(alive_ptr + t, alive.to(tl.int8), mask=tmask)
            keep = alive[:, :, None]
            tl.store(ids_out_ptr + off, tl.where(keep, e, -1), mask=m3)
            w = tl.load(w_ptr + off, mask=m3, other=0.0)
            tl.store(w_out_ptr + off, tl.where(keep, w, tl.zeros_like(w)), mask=m3)


def draft_prune(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    alive: torch.Tensor,
    misses: torch.Tensor,
    num_rows: int,
    num_experts: int,
    num_spec: int,
    max_misses: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pruning (module docstring) in one launch.

    Args:
      topk_ids: `[T, K]` int32/int64 (-1 padding), T = requests x (1 + num_spec), request-major; contiguous.
      topk_weights: `[T, K]` floating, contiguous.
      l2p: `[>= E]` int32 location codes of the layer before it is planned.
      alive: `[T]` bool, the lanes alive before this layer (lane 0 live); updated in place.
      misses: `[T]` int32, each lane's unpaid routes in this step's earlier layers; this layer's added in place.
      num_rows: R. num_experts: E. max_misses: unpaid routes a draft lane may have in the step and stay alive.
    Returns `(topk_ids, topk_weights)`, new tensors with dead lanes' routes as -1 / 0. T may be 0.
    """
    if triton is None:  # pragma: no cover
        raise RuntimeError("draft_prune needs Triton")
    draft_prune_check(topk_ids, topk_weights, l2p, alive, misses, num_rows, num_experts, num_spec, max_misses)
    T, K = topk_ids.shape
    ids_out, w_out = torch.empty_like(topk_ids), torch.empty_like(topk_weights)
    if T == 0:
        return ids_out, w_out
    lanes = 1 + num_spec
    paid = torch.empty(num_experts + 1, dtype=torch.int8, device=topk_ids.device)
    _draft_prune_kernel[(1,)](
        topk_ids, topk_weights, l2p, alive.view(torch.int8), misses, paid, ids_out, w_out,
        T // lanes, num_rows, num_experts, max_misses,
        LANES=lanes, LANES_POW2=triton.next_power_of_2(lanes), K=K, K_POW2=triton.next_power_of_2(K),
        BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E, num_warps=4,
    )  # fmt: skip
    return ids_out, w_out
