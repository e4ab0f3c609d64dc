"""CPU experiment (issue #5): the router-ordered policy with two membership memories, their orders dueled.

`RouterAdaptivePolicy` orders each layer's experts by a decayed router membership. How long that membership
remembers decides which traces it wins (docs/BENCHMARKS.md, twenty-fifth session): a half-life of ~355 steps
(`member_decay_shift` 9, the default) ranks a stationary skewed layer well but outlives a drift of popularity
(mixed traces at 25% rows: 1.0009-1.0013x LRU's misses); ~22 steps (shift 5) follows the drift (0.91-0.92x) but
ranks the skewed layers worse (skew A at 50% rows: 0.81-0.825x against 0.743-0.767x).

`MemoryDuelPolicy` keeps both memories and both ranked orders, and picks the order as the adaptive policy picks
between LRU and frequency: at each tick, before the update, an idealized frequency cache of the pool's size is
scored under each order; the misses where the two disagree are summed (x SCORE, decayed by `>> duel_shift` every
step), and the fast order is used while `fast_only + (fast_only >> margin_shift) + floor * SCORE < slow_only`.
The chosen order is then the policy's ranked counts, for the LRU-against-frequency duel and the frequency mode
alike. With equal memories the two orders are the same, nothing disagrees, and it decides as
`RouterAdaptivePolicy` (tested).

It runs on the planner's torch-ops form only (`DevicePlanner(fused=False)`, a subclass is never fused): this is
the model of a rule, not a shipped policy. Shipping it means a third shadow pass, a second membership and the
order duel in `kernels/plan_adaptive.py`, and the same in the host twin.

Usage: python -m bench.memory_duel [--cells "mixed:0.25:100,200;skew A:0.5:100"] [--slow 9] [--fast 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.planner import TRACES
from bench.traces import policy_hit_rate, synthetic_trace
from pooled_runner.policies import LRUPolicy
from pooled_runner.policy_adaptive import SCORE, AdaptivePolicy
from pooled_runner.policy_router import MEMBER_UNIT, RouterAdaptivePolicy, membership_units


class MemoryDuelPolicy(RouterAdaptivePolicy):
    """`RouterAdaptivePolicy` whose ranked order comes from a slow or a fast membership, whichever an idealized
    frequency cache misses less on (module docstring). Torch ops only."""

    name = "adaptive-router-duel"

    def __init__(self, num_rows: int, slow: int = 9, fast: int = 5, order_floor: int = 8, **kwargs: int):
        if not (1 <= fast <= 30 and 1 <= slow <= 30) or order_floor < 0:
            raise ValueError(f"slow={slow}, fast={fast} must be in [1, 30], order_floor={order_floor} >= 0")
        super().__init__(num_rows, member_decay_shift=slow, **kwargs)
        self.slow, self.fast, self._order_floor = slow, fast, order_floor * SCORE
        self.fast_ticks = 0  # ticks that ended with the fast order chosen
        self.ticks = 0

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        super().bind(num_layers, max_experts, device)
        size = num_layers * max_experts
        # [slow, fast]: memberships [N], ranked counts [N + 1] (last slot a dummy, as `ranked`)
        self.members = [torch.zeros(size, dtype=torch.int64, device=device) for _ in range(2)]
        self.rankeds = [torch.zeros(size + 1, dtype=torch.int64, device=device) for _ in range(2)]
        self.order_misses = torch.zeros(2, dtype=torch.int64, device=device)  # slow-only, fast-only
        self.uses_fast = self.fast_ticks = self.ticks = 0

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        # the inherited host forms are the plain router policy's: a twin of this one would disagree with it
        raise NotImplementedError(f"{self.name} has no host form (a model on the torch-ops planner only)")

    def observe_scores(self, layer: int, scores: torch.Tensor, valid: torch.Tensor, top_k: int) -> None:
        lo = layer * self._max_experts
        units = membership_units(scores, valid, top_k, self.width) * MEMBER_UNIT
        for member in self.members:
            member[lo : lo + scores.shape[1]] += units

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        out = [self.frequency_shadow_miss(ranked, layer, present, now) for ranked in self.rankeds]  # [E] each
        AdaptivePolicy.observe(self, layer, present, now)  # the LRU / frequency duel on the chosen order
        if layer == 0:  # once per step
            self.order_misses -= self.order_misses >> self.duel_shift
            for member, shift in zip(self.members, (self.slow, self.fast)):
                member -= member >> shift
            for ranked in self.rankeds:
                ranked -= ranked >> self.decay_shift
        disagree = out[0] != out[1]
        self.order_misses += torch.stack([(out[0] & disagree).sum(), (out[1] & disagree).sum()]) * SCORE
        fast_only, slow_only = int(self.order_misses[1]), int(self.order_misses[0])
        self.uses_fast = int(fast_only + (fast_only >> self.margin_shift) + self._order_floor < slow_only)
        self.fast_ticks += self.uses_fast
        self.ticks += 1
        for member, ranked in zip(self.members, self.rankeds):
            self.rank_layer(layer, member, ranked)
        chosen_member, chosen_ranked = self._member_state()
        chosen_member.copy_(self.members[self.uses_fast])
        chosen_ranked.copy_(self.rankeds[self.uses_fast])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="mixed:0.25:100;mixed:0.5:100;skew A:0.5:100;recency A:0.25:100")
    ap.add_argument("--slow", type=int, default=9)
    ap.add_argument("--fast", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=80)
    args = ap.parse_args()
    names = list(TRACES)
    print(
        "| trace | rows | base | LRU hit rate | router (slow) / LRU misses | duel / LRU misses | fast order share "
        "| s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cell in args.cells.split(";"):
        family, frac_text, bases = cell.split(":")
        index = next(i for i, name in enumerate(names) if name.startswith(family))
        for base in (int(b) for b in bases.split(",")):
            start = time.time()
            trace = synthetic_trace(
                args.steps, tokens_per_step=1, seed=base + index, with_scores=True, **TRACES[names[index]]
            )
            rows = int(float(frac_text) * sum(trace.num_experts_per_layer))
            lru = policy_hit_rate(trace, rows, LRUPolicy(), args.warmup)
            router = policy_hit_rate(
                trace, rows, RouterAdaptivePolicy(rows, member_decay_shift=args.slow), args.warmup
            )
            duel = MemoryDuelPolicy(rows, slow=args.slow, fast=args.fast)
            dueled = policy_hit_rate(trace, rows, duel, args.warmup)
            print(
                f"| {family} | {float(frac_text):.0%} | {base} | {lru:.4f} | {(1 - router) / (1 - lru):.4f} | "
                f"{(1 - dueled) / (1 - lru):.4f} | {duel.fast_ticks / max(duel.ticks, 1):.2f} | "
                f"{time.time() - start:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
