"""The router-ordered policy with two membership memories, their orders dueled (`adaptive-router-duel`).

`RouterAdaptivePolicy` orders each layer's experts by a decayed router membership. How long that membership
remembers decides which traces it wins (docs/BENCHMARKS.md, twenty-fifth session): a half-life of ~355 steps
(`member_decay_shift` 9) ranks a stationary skewed layer well but outlives a drift of popularity (mixed traces at
25% rows: 1.0009-1.0013x LRU's misses); ~22 steps (shift 5) follows the drift (0.91-0.92x) but ranks the skewed
layers worse (skew A at 50% rows: 0.81-0.825x against 0.743-0.767x).

`MemoryDuelPolicy` keeps both memories and both ranked orders, and picks the order as the adaptive policy picks
between LRU and frequency: at each tick, before the update, an idealized frequency cache of the pool's size is
scored under each order; the misses where the two disagree are summed (x SCORE, decayed by `>> duel_shift` every
step), and the fast order is used while `fast_only + (fast_only >> margin_shift) + order_floor * SCORE <
slow_only`. The chosen order's ranked counts are then the policy's, for the LRU-against-frequency duel (at the
next tick: it scores the order chosen at the previous one) and the frequency mode's decisions alike. With equal
memories the two orders are the same, nothing disagrees, and it decides as `RouterAdaptivePolicy` (tested).

On the quality bench's traces (CPU, `bench/memory_duel.py`, 30 cells over seven seed bases) it met both halves of
#5's target: at most 0.768x LRU's misses on the skewed families, at most 1.0000x on the drifting ones.

Forms: the fused plan (`kernels/plan_adaptive.py` with DUEL: both orders' shadows in the shadow pass, both
rankings, the order duel; the membership launch adds to both memberships), the planner's torch ops and the host
form the twin runs. The state holds both orders side by side (`members [2, N]`, `rankeds [2, N + 1]`: slow,
fast); the chosen order is an index on the device (`order_state[0]`), so a captured step reads no host value.
"""

from __future__ import annotations

import torch

from pooled_runner.kernels.membership import add_membership
from pooled_runner.policy_adaptive import SCORE, AdaptivePolicy
from pooled_runner.policy_router import (
    MEMBER_UNIT,
    RouterAdaptivePolicy,
    membership_units,
    membership_units_host,
    ramp_scale,
    ranked_counts_host,
)


class MemoryDuelPolicy(RouterAdaptivePolicy):
    """`RouterAdaptivePolicy` whose ranked order comes from a slow or a fast membership (decay shifts `slow`,
    `fast`), whichever an idealized frequency cache misses less on (module docstring). Fused, torch ops and
    host forms."""

    name = "adaptive-router-duel"
    # 8 warps: its shadow and ranking passes compare twice the pairs of the router's (H200, 2026-12-04,
    # bench.planner, 6 layers, E 128, R 384: one-launch plan + MoE 238.2 / 654.0 / 931.8 µs per step at M = 1 /
    # 4 / 8 against 266.2 / 700.0 / 996.1 with 4; bench.plan_blocks, the plan alone: 138.1 / 190.6 / 292.8 against
    # 164.2 / 229.0 / 351.6). The router's one launch gained nothing at M = 1 and lost at M = 8: it keeps 4.
    plan_warps = 8

    def __init__(self, num_rows: int, slow: int = 9, fast: int = 5, order_floor: int = 8, **kwargs: int):
        if not (1 <= fast <= 30 and 1 <= slow <= 30) or order_floor < 0:
            raise ValueError(f"slow={slow}, fast={fast} must be in [1, 30], order_floor={order_floor} >= 0")
        super().__init__(num_rows, member_decay_shift=slow, **kwargs)
        self.slow, self.fast, self._order_floor = slow, fast, order_floor * SCORE
        self.members: torch.Tensor | None = None  # [2, N] memberships: slow, fast
        self.rankeds: torch.Tensor | None = None  # [2, N + 1] ranked counts: slow, fast (last slot a dummy)
        self.order_misses: torch.Tensor | None = None  # [2] decayed slow-only, fast-only shadow misses
        # [3] the order chosen at the last tick (1: fast), ticks that ended with it fast, all ticks: on the
        # device, so that a captured step updates them (no host read inside the planner)
        self.order_state: torch.Tensor | None = None
        self._h_members: list[list[int]] = []
        self._h_rankeds: list[list[int]] = []
        self._h_order_misses = [0, 0]
        self._h_order_state = [0, 0, 0]  # as `order_state`

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        # the adaptive state only: the duel's two orders replace the router policy's single copies
        AdaptivePolicy.bind(self, num_layers, max_experts, device)
        size = num_layers * max_experts
        self.members = torch.zeros(2, size, dtype=torch.int64, device=device)
        self.rankeds = torch.zeros(2, size + 1, dtype=torch.int64, device=device)
        self.order_misses = torch.zeros(2, dtype=torch.int64, device=device)
        self.order_state = torch.zeros(3, dtype=torch.int64, device=device)
        self._scale = torch.tensor([ramp_scale(self.width)], dtype=torch.float64, device=device)
        self._kernel_state = AdaptivePolicy.kernel_state(self)._replace(
            member=self.members.view(-1),
            ranked=self.rankeds.view(-1),
            order_misses=self.order_misses,
            order_state=self.order_state,
        )
        self._kernel_rule = AdaptivePolicy.kernel_rule(self)._replace(
            member_decay_shift=self.slow, fast_decay_shift=self.fast, order_floor=self._order_floor
        )

    def _duel_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if (
            self.members is None
            or self.rankeds is None
            or self.order_misses is None
            or self.order_state is None
        ):
            raise RuntimeError(f"{type(self).__name__} used before bind()")
        return self.members, self.rankeds, self.order_misses, self.order_state

    def _member_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen order's membership `[N]` and ranked counts `[N + 1]` (new tensors, read only)."""
        members, rankeds, _, order_state = self._duel_state()
        fast = order_state[0] == 1  # 0-dim: no host read
        return torch.where(fast, members[1], members[0]), torch.where(fast, rankeds[1], rankeds[0])

    @property
    def uses_fast(self) -> int:
        """The order chosen at the last tick (1: fast). Syncs: outside capture."""
        return int(self._duel_state()[3][0])

    @property
    def fast_share(self) -> float:
        """The share of ticks that ended with the fast order chosen. Syncs: outside capture."""
        state = self._duel_state()[3]
        return int(state[1]) / max(int(state[2]), 1)

    def observe_scores(self, layer: int, scores: torch.Tensor, valid: torch.Tensor, top_k: int) -> None:
        lo = layer * self._max_experts
        units = membership_units(scores, valid, top_k, self.width) * MEMBER_UNIT
        self._duel_state()[0][:, lo : lo + scores.shape[1]] += units

    def observe_scores_fused(
        self, layer: int, scores: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
    ) -> None:
        """`observe_scores` in one launch (`kernels/membership.py`), into both memberships."""
        members = self._duel_state()[0]
        assert self._scale is not None  # set by bind, with the members
        lo = layer * self._max_experts
        add_membership(
            scores, topk_ids, members[:, lo : lo + self._max_experts], num_experts, self._scale, MEMBER_UNIT
        )

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        members, rankeds, order_misses, order_state = self._duel_state()
        # each order's frequency shadow, as of the previous tick (before the last uses move)
        out = [self.frequency_shadow_miss(ranked, layer, present, now) for ranked in rankeds]  # [E] each
        AdaptivePolicy.observe(self, layer, present, now)  # the LRU / frequency duel on the chosen order
        if layer == 0:  # once per step
            order_misses -= order_misses >> self.duel_shift
            for member, shift in zip(members, (self.slow, self.fast)):
                member -= member >> shift
            rankeds -= rankeds >> self.decay_shift
        disagree = out[0] != out[1]
        order_misses += torch.stack([(out[0] & disagree).sum(), (out[1] & disagree).sum()]) * SCORE
        fast_only, slow_only = order_misses[1:2], order_misses[0:1]
        fast = fast_only + (fast_only >> self.margin_shift) + self._order_floor < slow_only  # [1] bool
        order_state[0:1].copy_(fast.to(torch.int64))
        order_state[1:2] += fast.to(torch.int64)
        order_state[2:3] += 1
        for member, ranked in zip(members, rankeds):
            self.rank_layer(layer, member, ranked)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live state (views: a residency plan's rollback copies into them); the chosen order's member and
        ranked counts are not state of their own (`order_state[0]` picks them)."""
        members, rankeds, order_misses, order_state = self._duel_state()
        return {
            **AdaptivePolicy.state_tensors(self),
            "member_slow": members[0],
            "member_fast": members[1],
            "ranked_slow": rankeds[0][:-1],
            "ranked_fast": rankeds[1][:-1],
            "order_misses": order_misses,
            "order_state": order_state,
        }

    # Host form (the twin's).
    def host_reset(self, num_layers: int, max_experts: int) -> None:
        super().host_reset(num_layers, max_experts)
        size = num_layers * max_experts
        self._h_members = [[0] * size for _ in range(2)]
        self._h_rankeds = [[0] * size for _ in range(2)]
        self._h_order_misses, self._h_order_state = [0, 0], [0, 0, 0]

    def host_observe_scores(
        self, layer: int, scores: list[list[float]], valid: list[bool], top_k: int
    ) -> None:
        lo, num_experts = layer * self._max_experts, len(scores[0]) if scores else 0
        for e, units in enumerate(membership_units_host(scores, valid, top_k, num_experts, self.width)):
            for member in self._h_members:
                member[lo + e] += units * MEMBER_UNIT

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        out = [self.host_frequency_out(ranked, layer, present, now) for ranked in self._h_rankeds]
        AdaptivePolicy.host_observe(self, layer, present, now)
        if layer == 0:
            self._h_order_misses = [m - (m >> self.duel_shift) for m in self._h_order_misses]
            for i, shift in enumerate((self.slow, self.fast)):
                self._h_members[i] = [m - (m >> shift) for m in self._h_members[i]]
                self._h_rankeds[i] = [r - (r >> self.decay_shift) for r in self._h_rankeds[i]]
        self._h_order_misses[0] += sum(a and not b for a, b in zip(out[0], out[1])) * SCORE
        self._h_order_misses[1] += sum(b and not a for a, b in zip(out[0], out[1])) * SCORE
        fast_only, slow_only = self._h_order_misses[1], self._h_order_misses[0]
        fast = int(fast_only + (fast_only >> self.margin_shift) + self._order_floor < slow_only)
        self._h_order_state = [fast, self._h_order_state[1] + fast, self._h_order_state[2] + 1]
        lo, hi = layer * self._max_experts, (layer + 1) * self._max_experts
        for member, ranked in zip(self._h_members, self._h_rankeds):
            ranked[lo:hi] = ranked_counts_host(self._h_count[lo:hi], member[lo:hi])
        self._h_ranked = list(self._h_rankeds[fast])  # the chosen order, read by the host keys

    def host_state(self) -> dict[str, list[int]]:
        return {
            **AdaptivePolicy.host_state(self),
            "member_slow": list(self._h_members[0]),
            "member_fast": list(self._h_members[1]),
            "ranked_slow": list(self._h_rankeds[0]),
            "ranked_fast": list(self._h_rankeds[1]),
            "order_misses": list(self._h_order_misses),
            "order_state": list(self._h_order_state),
        }
