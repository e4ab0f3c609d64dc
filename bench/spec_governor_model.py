"""CPU experiment (issue #9): `SpecGovernor` replayed over cost models of the H200's verify steps.

Each cost model gives a step's milliseconds at depths 0 / 1 / 3 (from `bench_spec_governed` on the H200, or
made up where said); the replay adds the H200's noise: lognormal step times (coefficient of variation by
batch size), 1% of steps 2.5x slow, and a change of depth slowing its first step by 1.5x and its second by
1.05x (the pool follows the new working set). Drafts are accepted as a chain, each with probability 0.6.
Reported: tokens/s per request over depth 0's under the same noise (the reference issue #9 names), and over
the best fixed depth's (what a governor could get at most), mean and worst over seeds.

`--governor FILE` replays another `spec_governor.py` (e.g. `git show 9aca555:pooled_runner/spec_governor.py
> /tmp/old.py`) through the same steps, for a before/after. `--floor` adds this tree's governor with probes
that never come back (each depth probed once, when first in reach): where drafting loses, what any governor
that must measure a depth before it rules it out pays at least over the run, the probes' share of issue #9's
"never below depth 0".

`--learn N`: each governor decides N steps before the counted ones (a serving process past its start).

`--restore N` adds this tree's governor as a restarted server has it (`--moe-expert-pool-spec-governor-state`):
a family that decided N steps of the same cost model in a previous run (its own noise draws) is saved to a JSON
file and loaded back (`pooled_runner.spec_state`), and the loaded governor is counted from its first step,
under the same noise draws as the cold one: what the saved state saves of a cold start's probes.

Usage: python -m bench.spec_governor_model [--seeds 40] [--steps 150,400,2000] [--governor FILE] [--floor]
                                          [--learn N] [--restore N]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import random
import statistics
import sys
import tempfile
from types import ModuleType
from typing import Any

from pooled_runner import spec_governor
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_state import load_family, save_family

ACCEPT = 0.6
# lognormal step-time noise by batch size (misses vary most at bs 1)
NOISE_CV = {1: 0.25, 4: 0.12, 16: 0.06}
# name -> (batch size, step ms by depth)
COST_MODELS: dict[str, tuple[int, dict[int, float]]] = {
    # drafting loses: H200 step times (docs/BENCHMARKS.md, bench_spec_governed, 75c17ab)
    "loses, bs 1": (1, {0: 1.94, 1: 3.89, 3: 6.42}),
    "loses, bs 4": (4, {0: 9.91, 1: 20.8, 3: 30.9}),
    "loses, bs 16": (16, {0: 14.2, 1: 24.8, 3: 38.2}),
    # drafting wins by 6% (depth 1) and 12% (depth 3): H200 tokens/s per request 14.6 / 15.5 / 16.3, pool
    # 25%, bs 16 (a8ed710), as step times
    "wins 6-12%, bs 16": (16, {0: 1000 / 14.6, 1: 1600 / 15.5, 3: 2176 / 16.3}),
    # made up: depth 1 loses 3%, depth 3 5%
    "loses 3-5%, bs 4": (4, {0: 1.0, 1: 1.6 / 0.97, 3: 2.176 / 0.95}),
    # made up: drafting wins by a lot (depth 3: 1.40x, depth 1: 1.27x)
    "wins 27-40%, bs 4": (4, {0: 3.1, 1: 3.9, 3: 4.8}),
}


def tokens_at(depth: int) -> float:
    """Expected tokens per request of a step at `depth` (chain drafts, ACCEPT each)."""
    return sum(ACCEPT**i for i in range(depth + 1))


def sample_accepted(depth: int, rng: random.Random, accept: float = ACCEPT) -> int:
    """Accepted drafts of one request: a chain, each draft accepted with `accept` while the chain lasts."""
    n = 0
    while n < depth and rng.random() < accept:
        n += 1
    return n


# the previous run of a restored governor draws its noise from seed + this (not the counted run's draws)
PREVIOUS_RUN = 7_777_777


def noisy_run(
    costs_ms: dict[int, float],
    batch_size: int,
    num_steps: int,
    seed: int,
    module: ModuleType = spec_governor,
    learn: int = 0,
    restore: int = 0,
) -> tuple[float, float, int]:
    """One replay: (tokens/s per request over depth 0's, over the best fixed depth's, the depth it ends at).
    Both references run under the same noise draws as the governor. `learn`: steps the governor decides before
    the `num_steps` counted ones (not counted: a serving process past its start). `restore` > 0: this tree's
    governor restored from a previous run of `restore` steps (`restored_governor`), not `module`'s cold one."""
    if restore > 0:
        governor = restored_governor(costs_ms, batch_size, restore, seed + PREVIOUS_RUN)
    else:
        governor = module.SpecGovernor(sorted(costs_ms))
    return run_governor(governor, costs_ms, batch_size, num_steps, random.Random(seed), learn)


def restored_governor(costs_ms: dict[int, float], batch_size: int, num_steps: int, seed: int) -> Any:
    """The governor of `batch_size` as a restarted server loads it: a `GovernorFamily` that decided `num_steps`
    steps of `costs_ms` (noise from `seed`), saved to a JSON file and loaded back into a new family."""
    family = GovernorFamily()
    run_governor(
        family.governor(batch_size, sorted(costs_ms)), costs_ms, batch_size, num_steps, random.Random(seed)
    )
    fingerprint = {"cost model": sorted(costs_ms.items()), "batch size": batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spec_governor_state.json")
        save_family(family, path, fingerprint)
        loaded = load_family(path, fingerprint)
    assert loaded is not None, "the state just saved did not load"
    return loaded.governor(batch_size, sorted(costs_ms))


def run_governor(
    governor: Any,
    costs_ms: dict[int, float],
    batch_size: int,
    num_steps: int,
    rng: random.Random,
    learn: int = 0,
) -> tuple[float, float, int]:
    """`noisy_run` with a given governor and noise generator."""
    cv = NOISE_CV[batch_size]
    tokens = seconds = 0.0
    fixed_seconds = dict.fromkeys(costs_ms, 0.0)  # each fixed depth under the same noise (no switches)
    last, since = None, 2
    for step in range(learn + num_steps):
        depth = governor.choose()
        since = 0 if depth != last and last is not None else since + 1
        last = depth
        noise = math.exp(rng.gauss(0.0, cv) - cv * cv / 2) * (2.5 if rng.random() < 0.01 else 1.0)
        seconds_step = costs_ms[depth] * 1e-3 * noise * (1.5 if since == 0 else 1.05 if since == 1 else 1.0)
        accepted = [sample_accepted(depth, rng) for _ in range(batch_size)]
        governor.observe(depth, accepted, seconds_step)
        if step < learn:
            continue
        tokens += 1.0 + sum(accepted) / batch_size
        seconds += seconds_step
        for d, ms in costs_ms.items():
            fixed_seconds[d] += ms * 1e-3 * noise
    rate = tokens / seconds
    fixed = {d: num_steps * tokens_at(d) / s for d, s in fixed_seconds.items()}
    return rate / fixed[0], rate / max(fixed.values()), governor.current


def load_governor(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_governor_alt", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def probing_once() -> ModuleType:
    """This tree's governor, each depth probed once (when first in reach) and never again: a floor of what
    measuring a depth before ruling it out costs."""
    module = ModuleType("spec_governor_once")
    never = 1 << 40
    module.SpecGovernor = functools.partial(  # type: ignore[attr-defined]
        spec_governor.SpecGovernor, min_probe_interval=never, max_probe_interval=never
    )
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", default="150,400,2000", help="steps per replay, comma-separated")
    ap.add_argument("--governor", default="", help="another spec_governor.py to replay beside this tree's")
    ap.add_argument("--floor", action="store_true", help="also this tree's governor probing each depth once")
    ap.add_argument(
        "--learn", type=int, default=0, help="steps each governor decides before the counted ones"
    )
    ap.add_argument(
        "--restore",
        type=int,
        default=0,
        help="also this tree's governor saved after this many steps of a previous run and loaded back",
    )
    args = ap.parse_args()
    governors = {"this tree": spec_governor}
    if args.governor:
        governors[args.governor] = load_governor(args.governor)
    if args.floor:
        governors["probes once"] = probing_once()
    runners: dict[str, functools.partial[tuple[float, float, int]]] = {
        label: functools.partial(noisy_run, module=module, learn=args.learn)
        for label, module in governors.items()
    }
    if args.restore:
        runners[f"restored after {args.restore}"] = functools.partial(
            noisy_run, learn=args.learn, restore=args.restore
        )
    print(
        f"acceptance {ACCEPT} (chain); seeds {args.seeds}; noise cv by bs {NOISE_CV}; {args.learn} steps not counted"
    )
    print(
        "| cost model | steps | governor | vs depth 0, mean | worst | vs best fixed, mean | worst | ends at best |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (bs, costs) in COST_MODELS.items():
        best = max(costs, key=lambda d: tokens_at(d) / costs[d])
        for steps in (int(s) for s in args.steps.split(",")):
            for label, runner in runners.items():
                runs = [runner(costs, bs, steps, 1000 * bs + seed) for seed in range(args.seeds)]
                vs0, vsbest = [r[0] for r in runs], [r[1] for r in runs]
                at_best = sum(r[2] == best for r in runs)
                print(
                    f"| {name} | {steps} | {label} | {statistics.fmean(vs0):.3f} | {min(vs0):.3f} | "
                    f"{statistics.fmean(vsbest):.3f} | {min(vsbest):.3f} | {at_best}/{len(runs)} |"
                )


if __name__ == "__main__":
    main()
