"""The device planner's policy-generic step (`DevicePlanner.plan` for any `Policy`, and on the CPU): torch ops,
a few dozen small kernels, no host sync; the fused kernels implement LRU and lru-cycle
(`kernels/plan_copy.py`) and the adaptive policies (`kernels/plan_adaptive.py`, decisions equal to these ops'). `self` is the planner; its tables are updated in place (see `planner.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pooled_runner.planner_fused import gather_admitted

if TYPE_CHECKING:
    from pooled_runner.planner import DevicePlanner

INT64_MAX = torch.iinfo(torch.int64).max
INT64_MIN = torch.iinfo(torch.int64).min


def plan_ops(
    self: DevicePlanner,
    layer: int,
    topk_ids: torch.Tensor,
    E: int,
    num_pairs: int,
    router_scores: torch.Tensor | None = None,
) -> None:
    """`DevicePlanner.plan` for any policy, with torch ops (a few dozen small kernels). `router_scores [T, >= E]`
    only for a policy with `observe_scores` (checked by the caller)."""
    R, EM = self.num_rows, self.max_experts
    num_routed = topk_ids.numel()
    ids = topk_ids.reshape(-1).to(torch.int64)  # [T*K]
    routed = (ids >= 0) & (ids < E)
    counts = self._counts
    counts.zero_()
    counts.scatter_add_(0, torch.where(routed, ids, EM), self._ones[:num_routed])
    tokens = counts[:E]  # [E] tokens routed to each expert
    present = tokens > 0
    self.clock += 1
    now = self.clock
    if router_scores is not None:  # tokens with no routed id (padding lanes) do not vote
        valid = routed.view(topk_ids.shape).any(1)  # [T]
        self.policy.observe_scores(layer, router_scores[:, :E], valid, topk_ids.shape[1])  # type: ignore[attr-defined]
    self.policy.observe(layer, present, now)

    l2p_layer = self.pool.l2p_gpu[layer, :E].to(torch.int64)  # [E]
    hit = present & (l2p_layer < R)
    miss = present & (l2p_layer >= R)
    self.row_stamp.index_put_((torch.where(hit, l2p_layer, R),), now.expand(E))

    reads = (tokens + self.block_m - 1) // self.block_m
    cand = miss & (reads >= self.min_reads_to_admit)
    experts, victims, ok, victim_owner, victim_key = _pair(self, layer, E, cand, now, num_pairs)
    _apply(self, layer, experts, victims, ok, victim_owner, now)
    if victim_key is not None:
        self.policy.evicted(victim_key, ok & (victim_owner >= 0))  # [P]
    evicted = ok & (victim_owner >= 0)  # [P]
    self.counters += torch.stack([hit.sum(), miss.sum(), ok.sum(), miss.sum() - ok.sum(), evicted.sum()])


def _pair(
    self: DevicePlanner, layer: int, E: int, cand: torch.Tensor, now: torch.Tensor, num_pairs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Candidate experts, victim rows, admitted mask, victim owners and victim keys, each `[num_pairs]`."""
    R = self.num_rows
    ckey = self.policy.candidate_key(layer, E)
    if ckey is None:
        ckey = self._arange[:E]
    ckey = torch.where(cand, ckey, INT64_MAX)
    experts = torch.sort(ckey, stable=True).indices[:num_pairs]  # [P] ties by expert id

    owner, stamp = self.row_owner[:R], self.row_stamp[:R]
    busy = stamp == now  # rows used by this step
    order = torch.sort(torch.where(busy, INT64_MAX, stamp), stable=True).indices  # (stamp, row)
    vkey = self.policy.victim_key(owner, stamp, now)
    if vkey is not None:  # policy key first, then (stamp, row): a stable sort of the (stamp, row) order
        vkey = torch.where(busy, INT64_MAX, torch.where(owner < 0, INT64_MIN, vkey))
        order = order[torch.sort(vkey[order], stable=True).indices]
    victims = order[:num_pairs]  # [P]

    pair = self._arange[:num_pairs]
    victim_owner = self.row_owner[victims]  # [P]
    ok = (pair < cand.sum()) & (pair < (~busy).sum())
    victim_key = None
    if vkey is not None:
        victim_key = vkey[victims]
        accepted = self.policy.accept(layer * self.max_experts + experts, victim_key)
        if accepted is not None:
            ok = ok & ((victim_owner < 0) | accepted)
    return experts, victims, ok, victim_owner, victim_key


def _apply(
    self: DevicePlanner,
    layer: int,
    experts: torch.Tensor,
    victims: torch.Tensor,
    ok: torch.Tensor,
    victim_owner: torch.Tensor,
    now: torch.Tensor,
) -> None:
    R, EM = self.num_rows, self.max_experts
    dummy_flat = self._l2p_scratch.shape[0] - 1
    l2p_flat = self.pool.l2p_gpu.view(-1)
    scratch = self._l2p_scratch
    scratch[:dummy_flat].copy_(l2p_flat)
    evicted = ok & (victim_owner >= 0)
    scratch.index_put_(
        (torch.where(evicted, victim_owner, dummy_flat),),
        (R + torch.remainder(victim_owner, EM)).to(torch.int32),
    )
    cand_flat = layer * EM + experts
    scratch.index_put_((torch.where(ok, cand_flat, dummy_flat),), victims.to(torch.int32))
    l2p_flat.copy_(scratch[:dummy_flat])
    rows = torch.where(ok, victims, R)
    self.row_owner.index_put_((rows,), cand_flat)
    self.row_stamp.index_put_((rows,), now.expand(rows.shape[0]))
    gather_admitted(self, layer, victims, R + experts, ok.to(torch.int32))
