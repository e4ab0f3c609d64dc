"""CPU experiment (issue #9): the spec governors of a server whose batch size wanders, shared or independent.

SGLang's adapter runs one `SpecGovernor` per batch size (`pooled_runner.spec_family.GovernorFamily`). Replayed
here over a batch size that wanders over 1..16 (`wander`: it holds for a geometric number of steps, mean
`--hold`, then moves by 1-3 either way), or runs 300 steps at 16 and then wanders over 1..4 (`burst`), with step times per depth interpolated in log batch size between the H200's bs 1 / 4
/ 16 cost models of `bench.spec_governor_model` (its noise, and a step after a change of batch size or depth
untimed, as the adapter does). Compared: the family as shipped (one acceptance estimate, a new batch size
starting from its neighbour's verdicts) and independent governors (`share=False`, the adapter before).
Reported: tokens/s per request over depth 0's and over the best fixed depth per batch size (an oracle), under
the same noise draws, per batch size and averaged by steps; and the share of steps spent off the oracle's
depth. A step after a change of batch size is 1.5x slower for every policy, after a change of depth for the
governor only.

Usage: python -m bench.spec_family_model [--seeds 20] [--steps 2000,8000] [--hold 20] [--traces wander,burst]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics

from bench.spec_governor_model import ACCEPT, sample_accepted, tokens_at
from pooled_runner.spec_family import GovernorFamily

MAX_BATCH = 16
BURST_STEPS = 300
# name -> step ms by depth at bs 1, 4 and 16 (interpolated between, in log batch size)
SCENARIOS: dict[str, dict[int, dict[int, float]]] = {
    # drafting loses everywhere: pool 50%, H200 (docs/BENCHMARKS.md, bench_spec_governed, 75c17ab)
    "loses everywhere": {
        1: {0: 1.94, 1: 3.89, 3: 6.42},
        4: {0: 9.91, 1: 20.8, 3: 30.9},
        16: {0: 14.2, 1: 24.8, 3: 38.2},
    },
    # drafting loses at bs 1-4, wins at 16 (depth 3 by 12%): pool 25%, H200 bs 16 (a8ed710) as step times
    "wins at bs 16 only": {
        1: {0: 1.94, 1: 3.89, 3: 6.42},
        4: {0: 9.91, 1: 20.8, 3: 30.9},
        16: {0: 1000 / 14.6, 1: 1600 / 15.5, 3: 2176 / 16.3},
    },
    # made up: drafting wins everywhere (depth 3 by 40%, depth 1 by 27%), step time 3x from bs 1 to 16
    "wins everywhere": {
        1: {0: 3.1, 1: 3.9, 3: 4.8},
        4: {0: 6.2, 1: 7.8, 3: 9.6},
        16: {0: 9.3, 1: 11.7, 3: 14.4},
    },
}
NOISE_CV = {1: 0.25, 4: 0.12, 16: 0.06}


def interpolate(table: dict[int, float], batch_size: int) -> float:
    """`table` (at batch sizes 1, 4, 16) at `batch_size` (1..16), linear in log batch size."""
    points = sorted(table)
    x = math.log(batch_size)
    for lo, hi in itertools.pairwise(points):
        if batch_size <= hi:
            t = (x - math.log(lo)) / (math.log(hi) - math.log(lo))
            return table[lo] + t * (table[hi] - table[lo])
    return table[points[-1]]


def step_ms(scenario: dict[int, dict[int, float]], batch_size: int) -> dict[int, float]:
    return {d: interpolate({b: costs[d] for b, costs in scenario.items()}, batch_size) for d in scenario[1]}


def wander(num_steps: int, hold: float, rng: random.Random, low: int = 1, high: int = MAX_BATCH) -> list[int]:
    """Batch sizes of `num_steps` steps: each holds for a geometric number of steps (mean `hold`), then moves
    by 1-3 either way within low..high."""
    batch_size, sizes = rng.randint(low, high), []
    for _ in range(num_steps):
        sizes.append(batch_size)
        if rng.random() < 1.0 / hold:
            batch_size = min(max(batch_size + rng.choice((-3, -2, -1, 1, 2, 3)), low), high)
    return sizes


def burst(num_steps: int, hold: float, rng: random.Random) -> list[int]:
    """A burst, then a trickle: BURST_STEPS steps at MAX_BATCH, then a batch size wandering over 1..4 (a new
    small batch size whose nearest neighbour is far)."""
    return [MAX_BATCH] * min(BURST_STEPS, num_steps) + wander(
        max(num_steps - BURST_STEPS, 0), hold, rng, 1, 4
    )


TRACES = {"wander": wander, "burst": burst}


def replay(
    scenario: dict[int, dict[int, float]], sizes: list[int], seed: int, share: bool
) -> tuple[float, ...]:
    """(tokens/s per request over depth 0's, over the per-batch-size best fixed depth's, share of steps off
    that depth), the step noise drawn from `seed` alike for both families. The ratios are taken per batch size
    and averaged weighted by its steps (a ratio of sums over the whole run would weigh a deeper depth's longer
    steps more: a trace in steps is not one in requests)."""
    rng = random.Random(seed)  # step noise: the same draws for every policy replayed with `seed`
    accept_rng = random.Random(seed + 0x5EED)  # accepted drafts (their number of draws depends on the depth)
    family = GovernorFamily(share=share)
    # per batch size: tokens per request, seconds, depth 0's seconds, the best depth's tokens and seconds
    tally = {b: [0.0] * 5 for b in set(sizes)}
    off_best = 0
    last: tuple[int, int] | None = None
    for batch_size in sizes:
        costs = step_ms(scenario, batch_size)
        best = max(costs, key=lambda d: tokens_at(d) / costs[d])
        governor = family.governor(batch_size, sorted(costs))
        depth = governor.choose()
        cv = interpolate(NOISE_CV, batch_size)
        noise = math.exp(rng.gauss(0.0, cv) - cv * cv / 2) * (2.5 if rng.random() < 0.01 else 1.0)
        # a new batch slows every policy's step (new requests' experts), a new depth only the governor's
        noise *= 1.5 if last is not None and last[0] != batch_size else 1.0
        new_depth = last is not None and last[0] == batch_size and last[1] != depth
        seconds_step = costs[depth] * 1e-3 * noise * (1.5 if new_depth else 1.0)
        accepted = [sample_accepted(depth, accept_rng) for _ in range(batch_size)]
        # the adapter times a step only after a step of the same batch size (the governor: of the same depth)
        timed = last is not None and last[0] == batch_size
        governor.observe(depth, accepted, seconds_step, timed=timed)
        last = (batch_size, depth)
        row = tally[batch_size]
        row[0] += 1.0 + sum(accepted) / batch_size
        row[1] += seconds_step
        row[2] += costs[0] * 1e-3 * noise
        row[3] += tokens_at(best)
        row[4] += costs[best] * 1e-3 * noise
        off_best += depth != best
    steps = {b: sizes.count(b) for b in tally}
    vs_zero = sum(steps[b] * (r[0] / r[1]) / (steps[b] / r[2]) for b, r in tally.items()) / len(sizes)
    vs_best = sum(steps[b] * (r[0] / r[1]) / (r[3] / r[4]) for b, r in tally.items()) / len(sizes)
    return vs_zero, vs_best, off_best / len(sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", default="2000,8000", help="steps per replay, comma-separated")
    ap.add_argument("--hold", type=float, default=20.0, help="mean steps between changes of batch size")
    ap.add_argument("--traces", default="wander,burst", help=f"batch-size traces, of {sorted(TRACES)}")
    args = ap.parse_args()
    print(
        f"acceptance {ACCEPT} (chain); seeds {args.seeds}; batch size 1..{MAX_BATCH}, held {args.hold} steps"
    )
    print(
        "| trace | scenario | steps | governors | vs depth 0, mean | worst | vs best per bs, mean | worst | off best |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for trace in args.traces.split(","):
        for name, scenario in SCENARIOS.items():
            for num_steps in (int(s) for s in args.steps.split(",")):
                for label, share in (("family", True), ("independent", False)):
                    runs = []
                    for seed in range(args.seeds):
                        sizes = TRACES[trace](num_steps, args.hold, random.Random(seed))
                        runs.append(replay(scenario, sizes, 7919 * seed + 1, share))
                    vs0, vsbest, off = ([r[i] for r in runs] for i in range(3))
                    print(
                        f"| {trace} | {name} | {num_steps} | {label} | {statistics.fmean(vs0):.3f} | "
                        f"{min(vs0):.3f} | {statistics.fmean(vsbest):.3f} | {min(vsbest):.3f} | "
                        f"{statistics.fmean(off):.1%} |"
                    )


if __name__ == "__main__":
    main()
