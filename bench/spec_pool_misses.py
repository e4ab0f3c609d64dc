"""CPU experiment (issue #9): does the pool need steps to re-warm after a speculative-depth probe?

The governor (`pooled_runner/spec_governor.py`) leaves untimed only the first step after a change of depth,
on the premise that the pool follows a new working set in one step. This replays `bench/spec_governed.py`'s
trace (Qwen3-30B-like: 128 experts, top-8, per-layer skew; right drafts from the request's own lane, wrong ones
from its other lane) through the device planner's plain-Python twin (`HostTwin`, the residency policy named)
and counts the pool's misses (distinct experts read over PCIe) per verify step: a run at depth 0 alone, and a
run at depth 0 with a probe of `--probe-depth` for `--probe-steps` steps every `--interval` steps. Where the
pool follows in a step, the depth-0 steps right after a probe miss as often as those of the depth-0 run; a
re-warm would show as more misses in the first steps after each probe. Misses, not time: at pool 50%, bs 16 a
step's time on the H200 is mostly its misses' copies (36 ms for about 160 misses of 9.4 MB at depth 0).

Usage: python -m bench.spec_pool_misses [--pools 0.25,0.5,0.75] [--batches 1,4,16] [--policy lru-cycle]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch

from bench.decode_steps import Shape
from bench.spec_governor_model import sample_accepted
from bench.spec_steps import request_lanes, verify_ids
from pooled_runner.bank import ExpertBank
from pooled_runner.formats.base import OperandSpec
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import policy_for_pool
from pooled_runner.pool import ExpertPool

# one tiny operand: the twin tracks tables only, and the pool needs a bank to hold fewer rows than experts
_OPERANDS = (OperandSpec("w", (1,), torch.float32),)
# the steps after a probe told apart (later ones pooled): 0 is the first depth-0 step after it
MAX_AFTER = 3


def filled_pool(shape: Shape, num_rows: int) -> ExpertPool:
    """A pool of `num_rows` rows filled as bench.decode_steps.make_ours fills it (experts 0.. of every layer)."""
    bank = ExpertBank(_OPERANDS, [shape.E] * shape.L, pin=False)
    pool = ExpertPool(_OPERANDS, [shape.E] * shape.L, num_rows, torch.device("cpu"), bank)
    pool.fill([(layer, e) for e in range(shape.E) for layer in range(shape.L)])
    return pool


def replay(
    planner: Callable[[int, list[list[int]]], None],
    misses: Callable[[], int],
    lanes: torch.Tensor,
    depths: list[int],
    accept: float,
    seed: int,
) -> list[int]:
    """Misses of each verify step at `depths[i]` (the bench's routing and sampled acceptance), planned layer by
    layer through `planner(layer, topk_ids)`; `misses()` reads the planner's running count."""
    L, bs = lanes.shape[1], lanes.shape[2] // 2
    rng = random.Random(seed)
    positions = [0] * bs
    out = []
    for d in depths:
        if max(positions) + 1 + d > lanes.shape[0]:
            raise ValueError(f"the trace has {lanes.shape[0]} tokens: too few for {len(depths)} steps")
        accepted = [sample_accepted(d, rng, accept) for _ in range(bs)]
        ids = verify_ids(lanes, positions, d, accepted)  # [L, bs * (1 + d), K]
        before = misses()
        for layer in range(L):
            planner(layer, ids[layer].tolist())
        out.append(misses() - before)
        positions = [p + 1 + a for p, a in zip(positions, accepted)]
    return out


def probe_schedule(num_steps: int, warm: int, depth: int, probe_steps: int, interval: int) -> list[int]:
    """Depth of each step: `warm` at depth 0, then a probe of `depth` for `probe_steps` steps every `interval`."""
    assert 0 < probe_steps < interval, (probe_steps, interval)
    return [0] * warm + [depth if i % interval < probe_steps else 0 for i in range(num_steps - warm)]


def after_probe(depths: list[int], misses: list[int], warm: int) -> dict[int, list[int]]:
    """Misses of the depth-0 steps after `warm`, by steps since the last probe ended (MAX_AFTER: that or more;
    steps before the first probe are left out)."""
    out: dict[int, list[int]] = {}
    since = None
    for i in range(warm, len(depths)):
        if depths[i] != 0:
            since = 0
            continue
        if since is not None:
            out.setdefault(min(since, MAX_AFTER), []).append(misses[i])
            since += 1
    return out


def cell(shape: Shape, frac: float, bs: int, policy: str, args: argparse.Namespace) -> list[object]:
    """One (pool, bs) row: depth 0's misses per step, the probe's, and the depth-0 steps' after a probe (over
    depth 0's)."""
    lanes = request_lanes(shape, bs, args.steps * (1 + args.probe_depth) + 1)
    runs = {}
    schedules = {
        "depth 0": [0] * args.steps,
        "probed": probe_schedule(args.steps, args.warm, args.probe_depth, args.probe_steps, args.interval),
    }
    for name, depths in schedules.items():
        pool = filled_pool(shape, int(frac * shape.L * shape.E))
        twin = HostTwin(pool, policy_for_pool(policy, pool.num_rows))
        runs[name] = replay(twin.plan, lambda t=twin: t.misses, lanes, depths, args.accept, seed=bs)
    base = statistics.fmean(runs["depth 0"][args.warm :])
    probed = schedules["probed"]
    probe = [m for d, m in zip(probed, runs["probed"]) if d != 0]
    after = after_probe(probed, runs["probed"], args.warm)
    ratios = [statistics.fmean(after[k]) / base if k in after else float("nan") for k in range(MAX_AFTER + 1)]
    return [f"{frac:.0%}", bs, base, statistics.fmean(probe), *ratios]


COLUMNS = ["pool", "bs", "depth 0 misses/step", "probe misses/step"] + [
    f"after probe, step {k + 1}{'+' if k == MAX_AFTER else ''} / depth 0" for k in range(MAX_AFTER + 1)
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="0.25,0.5,0.75")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--policy", default="lru-cycle", help="residency policy (PoolConfig.planner_policy)")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers (bench_spec_governed --quick: 8)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--accept", type=float, default=0.6)
    ap.add_argument("--probe-depth", type=int, default=1)
    ap.add_argument("--probe-steps", type=int, default=3)
    ap.add_argument("--interval", type=int, default=32)
    args = ap.parse_args()
    shape = Shape(L=args.layers)
    print(
        f"policy {args.policy}; {shape}; {args.steps} steps, first {args.warm} at depth 0 not counted; probe of "
        f"depth {args.probe_depth} for {args.probe_steps} steps every {args.interval}; acceptance {args.accept}"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for frac in (float(p) for p in args.pools.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            row = cell(shape, frac, bs, args.policy, args)
            print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
