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

The policy is `pooled_runner/policy_duel.py` (`--moe-expert-pool-planner-policy adaptive-router-duel`): the fused
plan (`kernels/plan_adaptive.py`, DUEL), the planner's torch ops and the host twin this bench runs make the same
decisions (tested), so these numbers hold for every form.

Usage: python -m bench.memory_duel [--cells "mixed:0.25:100,200;skew A:0.5:100"] [--slow 9] [--fast 5]
"""

from __future__ import annotations

import argparse
import time

from bench.planner import TRACES
from bench.traces import policy_hit_rate, synthetic_trace
from pooled_runner.policies import LRUPolicy
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy


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
                f"{(1 - dueled) / (1 - lru):.4f} | {duel.fast_share:.2f} | "
                f"{time.time() - start:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
