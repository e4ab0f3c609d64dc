"""Cost-aware speculation (issue #9's MTP target) on the GPU: ours with the draft depth fixed at 0, 1 or 3, and
with `SpecGovernor` choosing it before every verify step, side by side on the same traces and harness.

Stack and bank as bench/decode.py (Qwen3-30B-like, bf16, 8 layers with `--quick`); one pool per fraction
(25/50/75% of all experts, rows filled as the decode bench fills them), shared by every policy of that fraction
(each policy starts with `--warm` uncounted steps at its first depth, so the pool follows its working set; the
governor starts after them, and every step it decides is counted). The trace, the graphs per depth and the
stepping are `bench/spec_steps.py`'s (CUDA events read one step late). tok/s/req = accepted tokens per request
over the counted steps / the sum of their times. The governed row counts its climb and its probes.
misses/step: the pool's misses (distinct expert reads over PCIe, the planner's counters) over the counted
steps, read at the run's two ends (a boundary read: syncs, outside the timed steps).

`--rounds N` runs every policy of a cell N times, in the listed order and then reversed (ABBA: a drift of the
machine over the cell, e.g. the host link's speed, weighs on every policy alike); a row sums its rounds, and
"vs depth 0 by round" gives each round's ratio, so a ratio's spread from run to run shows beside the mean.
`--governor-warm N` adds a row "governed, warmed N, reloaded": a governor that decided N steps (probes included)
before its counted ones, as a restarted server has it with `--moe-expert-pool-spec-governor-state`: its family
is saved to a temporary JSON file after those N steps and a fresh family loaded from it counts (the real
persistence path, `pooled_runner.spec_state`: a probe in flight dropped, the first step after the load untimed),
over the same trace window from the trace's start as every other row (the learning run reads a later stretch
of the trace, under other acceptance draws: a previous run saw other traffic); the "governed" row counts from
the governor's start. Governors are those of a one-batch-size `GovernorFamily` (the same decisions as a lone
`SpecGovernor`).

Usage: python -m bench.spec_governed [--quick] [--accept 0.6] [--rounds 1] [--governor-warm 0] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch

from bench.common import commit_id, print_table, write
from bench.decode_steps import Shape, empty_cache, make_bank, make_ours
from bench.decode_traces import PER_LAYER
from bench.spec_steps import DepthGraphs, PolicyRun, request_lanes, run_steps
from pooled_runner.lanes import decode_lanes
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import SpecGovernor
from pooled_runner.spec_state import load_family, save_family

DEPTHS = (0, 1, 3)
POOLS = (0.25, 0.5, 0.75)
BATCHES = (1, 4, 16)
WARMED = "governed, warmed "


def warmed_policy(steps: int) -> str:
    """The row of a governor that learned `steps` steps and went through a save and a load before counting."""
    return f"{WARMED}{steps}, reloaded"


def reloaded(family: GovernorFamily, bs: int, depths: tuple[int, ...]) -> SpecGovernor:
    """`family`'s governor of `bs` after a save to a temporary JSON file and a load into a fresh family
    (`spec_state`, as a restarted server's `--moe-expert-pool-spec-governor-state`)."""
    fingerprint = {"bench": "spec_governed", "bs": bs, "depths": list(depths)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spec_governor_state.json")
        save_family(family, path, fingerprint)
        loaded = load_family(path, fingerprint)
    if loaded is None:
        raise RuntimeError(f"the governor state saved to {path} did not load back (see the log)")
    return loaded.governor(bs, depths)


def run_policy(graphs: DepthGraphs, lanes: torch.Tensor, policy: str, num_steps: int, warm: int, accept: float, seed: int) -> PolicyRun:  # fmt: skip
    """`policy` "depth N" (fixed), "governed", or `warmed_policy(N)` over `num_steps` verify steps from the
    trace's start (the first `warm` not counted, at the policy's first depth). A warmed governor first decides N
    steps (after its own `warm`), observed but not counted (a server's previous run), on the stretch of the
    trace past any counted run's reach and under other acceptance draws (a previous run saw other traffic than
    the one it is counted on), is saved and loaded back (`reloaded`, a restart), and then runs the counted steps
    from the trace's start under the same acceptance draws as the other rows: every row is counted over the same
    trace window (a learning phase that moved the counted window past the others' measured another stretch of
    the trace: pool 75%, bs 4 read 0.965x depth 0 for a governor that ran depth 0 on 1152 of 1168 steps, H100,
    2026-12-06)."""
    depths = tuple(sorted(graphs.static))
    bs = lanes.shape[2] // 2
    family = GovernorFamily() if policy.startswith("governed") else None
    governor = family.governor(bs, depths) if family is not None else None
    fixed = None if governor else int(policy.split()[1])
    learn = int(policy.removeprefix(WARMED).split(",")[0]) if policy.startswith(WARMED) else 0
    out = PolicyRun(policy)
    if learn:
        assert family is not None and governor is not None
        beyond = num_steps * (1 + max(depths))  # no counted run reads this far
        ran = run_steps(
            graphs, lanes, governor, fixed, warm + learn, warm, accept, seed + 1, None, start=beyond
        )
        if ran < warm + learn:
            raise ValueError(
                f"{policy}: the lanes held {ran} learning steps of {warm + learn} (`request_lanes`)"
            )
        governor = reloaded(family, bs, depths)
    run_steps(graphs, lanes, governor, fixed, num_steps, warm, accept, seed, out)
    return out


def run_cell(graphs: DepthGraphs, lanes: torch.Tensor, policies: list[str], num_steps: int, warm: int, accept: float, rounds: int, label: str) -> tuple[dict[str, PolicyRun], dict[str, list[float]]]:  # fmt: skip
    """Every policy of one (pool, bs) cell `rounds` times, in order and then reversed (ABBA): each policy's
    runs summed, and each round's tok/s/req over that round's depth 0."""
    runs = {p: PolicyRun(p) for p in policies}
    by_round: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(rounds):
        this = {}
        for p in policies if r % 2 == 0 else policies[::-1]:
            this[p] = run_policy(graphs, lanes, p, num_steps, warm, accept, seed=graphs.bs)
            print(f"{label}, round {r}, {p}: {this[p].tok_s_req:.1f} tok/s/req", flush=True)
            runs[p].add(this[p])
        for p in policies:
            by_round[p].append(this[p].tok_s_req / this["depth 0"].tok_s_req)
    return runs, by_round


def run(
    shape: Shape,
    device: torch.device,
    steps: dict[int, int],
    warm: int,
    accept: float,
    pools: tuple[float, ...] = POOLS,
    batches: tuple[int, ...] = BATCHES,
    commit: str = "",
    fixed_depths: tuple[int, ...] = DEPTHS,
    rounds: int = 1,
    governor_warm: int = 0,
) -> tuple[list[str], list[list]]:
    """Every (pool, bs, policy): header lines and table rows. `fixed_depths`: the fixed-depth rows (0 always;
    the governor chooses among all of `DEPTHS`). `rounds`: runs of each policy per cell, in order then
    reversed (module docstring). `governor_warm` > 0: also a row of a governor that decided that many steps
    before the counted ones and was saved and loaded back (`warmed_policy`)."""
    assert 0 in fixed_depths and set(fixed_depths) <= set(DEPTHS), fixed_depths
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least one run of each policy per cell (--rounds)")
    g = torch.Generator(device=device).manual_seed(0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = [
        f"date {datetime.date.today()}, GPU {where}, torch {torch.__version__}, commit {commit_id(commit)}",
        f"shape: H {shape.H}, I {shape.I}, E {shape.E}, top-{shape.K}, bf16, {shape.L} MoE layers; trace "
        f"'{PER_LAYER}'; acceptance {accept} per draft (chain, sampled); verify steps per policy "
        f"{steps} (by bs), first {warm} not counted; depths {list(DEPTHS)}; rounds {rounds} (ABBA order)",
    ]
    print("\n".join(header), flush=True)
    bank = make_bank(shape, device, g)
    if governor_warm < 0:
        raise ValueError(f"governor_warm={governor_warm}: steps a governor learns before it is counted, >= 0")
    lanes = {  # each run reads from the trace's start; a warmed governor's learning run past their reach
        bs: request_lanes(shape, bs, (steps[bs] + warm + governor_warm) * (1 + max(DEPTHS)) + 1)
        for bs in batches
    }
    rows = []
    policies = [f"depth {d}" for d in fixed_depths] + ["governed"]
    policies += [warmed_policy(governor_warm)] if governor_warm else []
    for frac in pools:
        ours = make_ours(
            bank, shape, int(frac * shape.L * shape.E), decode_lanes(max(batches), max(DEPTHS)), device
        )
        for bs in batches:
            graphs = DepthGraphs(ours, shape, bs, DEPTHS, lanes[bs], device, g)
            runs, by_round = run_cell(graphs, lanes[bs], policies, steps[bs], warm, accept, rounds, f"pool {frac:.0%}, bs {bs}")  # fmt: skip
            base = runs["depth 0"].tok_s_req
            best_fixed = max(runs[f"depth {d}"].tok_s_req for d in fixed_depths)
            for p, run_ in runs.items():
                mix = ", ".join(f"{d}: {run_.at_depth.get(d, 0)}" for d in DEPTHS)
                rows.append(
                    [bs, f"{frac:.0%}", p, run_.steps, run_.tokens / max(run_.steps, 1), run_.ms / max(run_.steps, 1),
                     run_.tok_s_req, run_.tok_s_req / base, run_.tok_s_req / best_fixed, mix,
                     run_.misses / max(run_.steps, 1), ", ".join(f"{v:.3f}" for v in by_round[p])]
                )  # fmt: skip
            print(f"done: pool {frac:.0%}, bs {bs}", flush=True)
            del graphs
        if ours.moe.bank is not None:
            ours.moe.bank.close()
        del ours
        empty_cache(device)
    bank.close()
    return header, rows


COLUMNS = [
    "bs", "pool", "policy", "steps", "tok/req/step", "ms/step", "tok/s/req", "vs depth 0", "vs best fixed",
    "steps at depth (0, 1, 3)", "misses/step", "vs depth 0 by round",
]  # fmt: skip


def summary(rows: list[list]) -> str:
    governed = [r for r in rows if r[2] == "governed"]
    depth3 = [r for r in rows if r[2] == "depth 3"]
    if not governed:
        return "no governed rows"
    lo, hi = min(r[7] for r in governed), max(r[7] for r in governed)
    below = sum(r[7] < 1.0 for r in governed)
    best = min(r[8] for r in governed)
    line = f"governed / depth 0: {lo:.3f}x to {hi:.3f}x over {len(governed)} (bs, pool) cases, below 1 in {below}"
    if depth3:
        line += f"; depth 3 / depth 0: {min(r[7] for r in depth3):.2f}x to {max(r[7] for r in depth3):.2f}x"
    return line + f"; governed / best fixed depth >= {best:.3f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers (default 12)")
    ap.add_argument("--accept", type=float, default=0.6)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument(
        "--pools", default=",".join(str(p) for p in POOLS), help="pool fractions, comma-separated"
    )
    ap.add_argument(
        "--batches", default=",".join(str(b) for b in BATCHES), help="batch sizes, comma-separated"
    )
    ap.add_argument(
        "--steps", type=int, default=0, help="verify steps per policy at every bs (0: 400/300/150)"
    )
    ap.add_argument("--fixed", default="0,1,3", help="fixed-depth rows (0 always), comma-separated")
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of every policy per cell, order reversed each round"
    )
    ap.add_argument(
        "--governor-warm",
        type=int,
        default=0,
        help="also a governor that decided this many steps, then was saved and loaded back, before counting",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/spec_governed.py needs a CUDA GPU (tests run it on the CPU at a tiny shape)")
    shape = Shape(L=8 if args.quick else 12)
    pools = tuple(float(p) for p in args.pools.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    steps = {bs: args.steps or {1: 400, 4: 300}.get(bs, 150) for bs in batches}
    fixed = tuple(int(d) for d in args.fixed.split(","))
    header, rows = run(
        shape,
        torch.device("cuda"),
        steps,
        args.warm,
        args.accept,
        pools,
        batches,
        args.commit,
        fixed,
        args.rounds,
        args.governor_warm,
    )
    text = print_table("Cost-aware speculation: fixed depths and the governor (ours)", COLUMNS, rows)
    line = summary(rows)
    print(line)
    write(args.out, [*header, "", text, "", line])


if __name__ == "__main__":
    main()
