"""Router-ordered adaptive policy: the adaptive policy's frequency mode, with each layer's experts ordered by the
router's scores instead of their hit counts.

Why: on skewed traces a few hundred steps of hit counts cannot tell a layer's borderline experts apart, and the
adaptive policy stops near 0.79-0.81x LRU's misses at 50% rows. The router scores every expert for every token,
not only the top-k: a per-expert sum of how close each expert came to the top-k orders a layer far better
(docs/BENCHMARKS.md, "Ordering a layer's experts by the router").

Rule (integer arithmetic after one float64 step, rounded the same way in every form, so device and host forms
agree exactly):
  - Membership, per planned step of layer l with router scores `[T, E]` (`observe_scores`): for each token whose
    routed ids are not all padding, `d = score - the token's k-th largest score` (float64; k = the step's top-k),
    and the token adds `clamp(floor(d * RAMP / width) + RAMP / 2, 0, RAMP)` to each expert's `member` counter: a
    linear ramp from 0 (width / 2 below the k-th score) to RAMP (width / 2 above it), a smoothed "was it picked".
    A token with a NaN score adds nothing; inf - inf adds 0. Every step, at the layer-0 tick,
    `member -= member >> member_decay_shift` (by default the counts' `decay_shift`, 9: a half-life of about
    355 steps). A shorter memory follows a drift of popularity: on the quality bench's mixed traces (drift 64)
    shift 5 misses 0.91-0.92x LRU's at 25% rows and 0.945-0.975x at 50%, where 9 is at 0.9999-1.0013x, but on
    the skewed traces it gives the ranking's gain away (skew A at 50% rows 0.811-0.825x, against 0.743-0.767x).
    6-8 clear neither kind: 7 and 8 stay above LRU on mixed at 25% rows on some bases, 6 on mixed at 50% on one
    (docs/BENCHMARKS.md, twenty-fifth session). No one shift wins both kinds.
  - Ranked counts: at each tick of layer l, after the adaptive policy's own update, the layer's counts sorted
    largest first are handed out to its experts in the order (member desc, count desc, expert id): the split of
    rows between layers still follows the hits, the order inside a layer follows the router. At the layer-0 tick
    every layer's ranked counts decay as the counts do. Wherever the adaptive policy reads a count (shadow cache,
    candidate key, victim key, admission) this policy reads the ranked count.
  - A layer never given scores has all-zero members, so its ranked counts equal its counts: without scores the
    policy decides exactly as `AdaptivePolicy`.

The scores must be the ones the top-k was taken on, in logit units (e.g. softmax routers' logits; not a
router's logits when it adds a correction bias after them): with a hidden bias the order is wrong and the
policy can miss more than the count order (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math

import torch

from pooled_runner.kernels.membership import RAMP, add_membership, ramp_units
from pooled_runner.policy_adaptive import ONE, AdaptivePolicy

# `member` holds ramp steps x MEMBER_UNIT (one full token = ONE): fixed point, so that the decay
# `m - (m >> member_decay_shift)` reaches small sums too (raw steps below 2**shift would never decay)
MEMBER_UNIT = ONE // RAMP
MIN_WIDTH, MAX_WIDTH = 2.0**-20, 2.0**20  # d * RAMP / width stays finite in float64 for any fp32 difference


def ramp_scale(width: float) -> float:
    """The membership's ramp steps per logit unit (RAMP / width)."""
    return RAMP / width


def membership_units(
    scores: torch.Tensor, valid: torch.Tensor, top_k: int, width: float = 2.0
) -> torch.Tensor:
    """`scores [T, E]` (floating, any device), `valid [T]` bool (tokens routed at all), `top_k` >= 1 ->
    `[E]` int64 member units summed over the valid tokens (see module docstring). T = 0 gives zeros. Torch ops
    (the torch-ops planner's form; the fused planner's is `kernels/membership.py`)."""
    return ramp_units(scores, valid, top_k, ramp_scale(width))


def membership_units_host(
    scores: list[list[float]], valid: list[bool], top_k: int, num_experts: int, width: float = 2.0
) -> list[int]:
    """Plain-Python form of `membership_units` (scores `[T][num_experts]` as Python floats, i.e. the tensor's
    `.double().tolist()`)."""
    out = [0] * num_experts
    k = min(top_k, num_experts)
    if k < 1:
        return out
    scale = ramp_scale(width)
    for row, ok in zip(scores, valid):
        if not ok or any(math.isnan(x) for x in row):
            continue
        kth = sorted(row, reverse=True)[k - 1]
        for e, s in enumerate(row):
            d = s - kth
            if math.isnan(d):  # inf - inf
                continue
            step = math.floor(d * scale) + RAMP // 2 if math.isfinite(d) else (RAMP if d > 0 else 0)
            out[e] += min(max(step, 0), RAMP)
    return out


def ranked_counts_host(count: list[int], member: list[int]) -> list[int]:
    """The layer's counts, largest first, handed out in the order (member desc, count desc, expert id)."""
    curve = sorted(count, reverse=True)
    order = sorted(range(len(count)), key=lambda e: (-member[e], -count[e], e))
    out = [0] * len(count)
    for value, e in zip(curve, order):
        out[e] = value
    return out


class RouterAdaptivePolicy(AdaptivePolicy):
    """`AdaptivePolicy` whose frequency mode orders each layer's experts by router-score membership (see module
    docstring). Feed it the scores through `DevicePlanner.plan(..., router_scores=)`."""

    name = "adaptive-router"

    def __init__(
        self, num_rows: int, width: float = 2.0, member_decay_shift: int | None = None, **kwargs: int
    ):
        if not MIN_WIDTH <= width <= MAX_WIDTH:  # NaN fails too
            raise ValueError(f"width={width} must be in [2**-20, 2**20] logit units")
        if member_decay_shift is not None and not 1 <= member_decay_shift <= 30:
            raise ValueError(f"member_decay_shift={member_decay_shift} must be in [1, 30]")
        super().__init__(num_rows, **kwargs)
        self.width = width
        # None: the counts' decay_shift (the rule before the two were apart)
        self.member_decay_shift = self.decay_shift if member_decay_shift is None else member_decay_shift
        self.member: torch.Tensor | None = None  # [L * E_max] int64 ramp steps x MEMBER_UNIT (decayed)
        self.ranked: torch.Tensor | None = None  # [L * E_max + 1] int64 ranked counts; last slot a dummy
        self._scale: torch.Tensor | None = None  # [1] float64 RAMP / width, for the fused membership
        self._h_member: list[int] = []
        self._h_ranked: list[int] = []

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        super().bind(num_layers, max_experts, device)
        size = num_layers * max_experts
        self.member = torch.zeros(size, dtype=torch.int64, device=device)
        self.ranked = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self._scale = torch.tensor([ramp_scale(self.width)], dtype=torch.float64, device=device)
        self._kernel_state = super().kernel_state()._replace(member=self.member, ranked=self.ranked)
        self._kernel_rule = super().kernel_rule()._replace(member_decay_shift=self.member_decay_shift)

    def _member_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.member is None or self.ranked is None:
            raise RuntimeError("RouterAdaptivePolicy used before bind()")
        return self.member, self.ranked

    def _value_counts(self) -> torch.Tensor:
        return self._member_state()[1]

    def observe_scores(self, layer: int, scores: torch.Tensor, valid: torch.Tensor, top_k: int) -> None:
        """`scores [T, E]` of this step of `layer` (E = the layer's experts), `valid [T]`; before `observe`."""
        member = self._member_state()[0]
        lo = layer * self._max_experts
        member[lo : lo + scores.shape[1]] += membership_units(scores, valid, top_k, self.width) * MEMBER_UNIT

    def observe_scores_fused(
        self, layer: int, scores: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
    ) -> None:
        """`observe_scores` in one launch (`kernels/membership.py`; the fused planner's form): `scores [T, >=
        num_experts]` with unit stride along the experts, the votes from `topk_ids [T, K]` (a token votes when
        one of its ids is in [0, num_experts)), top-k = K."""
        member = self._member_state()[0]
        assert self._scale is not None  # set by bind, with member
        lo = layer * self._max_experts
        add_membership(
            scores, topk_ids, member[lo : lo + self._max_experts], num_experts, self._scale, MEMBER_UNIT
        )

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        member, ranked = self._member_state()
        super().observe(layer, present, now)  # the shadows read the ranked counts of the previous tick
        if layer == 0:  # once per step, as the counts
            member -= member >> self.member_decay_shift
            ranked -= ranked >> self.decay_shift
        self.rank_layer(layer, member, ranked)

    def rank_layer(self, layer: int, member: torch.Tensor, ranked: torch.Tensor) -> None:
        """`ranked [N + 1]`'s slice of `layer` := the layer's counts, largest first, handed out in the order
        (`member [N]` desc, count desc, expert id)."""
        # the whole E_max slice: padding experts (count 0, member 0, ids above the layer's) take the curve's zeros
        count = self._state()[0]
        lo, E = layer * self._max_experts, self._max_experts
        layer_count, layer_member = count[lo : lo + E], member[lo : lo + E]
        curve = torch.sort(layer_count, descending=True).values  # [E]
        by_count = torch.sort(layer_count, descending=True, stable=True).indices  # ties by expert id
        order = by_count[torch.sort(layer_member[by_count], descending=True, stable=True).indices]  # [E]
        ranked[lo : lo + E].index_copy_(0, order, curve)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        member, ranked = self._member_state()
        return {**super().state_tensors(), "member": member, "ranked": ranked[:-1]}

    # Host form (the twin's).
    def host_reset(self, num_layers: int, max_experts: int) -> None:
        super().host_reset(num_layers, max_experts)
        size = num_layers * max_experts
        self._h_member, self._h_ranked = [0] * size, [0] * size

    def _h_value_counts(self) -> list[int]:
        return self._h_ranked

    def host_observe_scores(
        self, layer: int, scores: list[list[float]], valid: list[bool], top_k: int
    ) -> None:
        lo, num_experts = layer * self._max_experts, len(scores[0]) if scores else 0
        for e, units in enumerate(membership_units_host(scores, valid, top_k, num_experts, self.width)):
            self._h_member[lo + e] += units * MEMBER_UNIT

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        super().host_observe(layer, present, now)
        if layer == 0:
            self._h_member = [m - (m >> self.member_decay_shift) for m in self._h_member]
            self._h_ranked = [r - (r >> self.decay_shift) for r in self._h_ranked]
        lo, hi = layer * self._max_experts, (layer + 1) * self._max_experts
        self._h_ranked[lo:hi] = ranked_counts_host(self._h_count[lo:hi], self._h_member[lo:hi])

    def host_state(self) -> dict[str, list[int]]:
        return {**super().host_state(), "member": list(self._h_member), "ranked": list(self._h_ranked)}
