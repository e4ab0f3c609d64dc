"""Cost-aware speculation (issue #9's MTP target) on the GPU: ours with the draft depth fixed at 0, 1 or 3, and
with `SpecGovernor` choosing it before every verify step, side by side on the same traces and harness.

Stack and bank as bench/decode.py (Qwen3-30B-like, bf16, 8 layers with `--quick`); one pool per fraction
(25/50/75% of all experts, rows filled as the decode bench fills them), shared by every policy of that fraction
(each policy starts with `--warm` uncounted steps at its first depth, so the pool follows its working set; the
governor starts after them, and every step it decides is counted). Trace: the decode
bench's per-layer skew family (Zipf 0.4-1.6, reuse 0.3), one lane of consecutive tokens per request (its true
continuation) and one lane of other tokens from the same distribution (what rejected drafts route like). A
verify step at depth d of a request at position p whose acceptance (chain, `--accept` per draft, sampled and
seeded) will be a drafts: tokens p .. p + a from its true lane (the committed token and the drafts that are
right), tokens p + a + 1 .. p + d from its other lane (wrong drafts route like some other token), request-major;
the request then advances by 1 + a, as a real verifier's does. So right drafts overlap their neighbours'
experts as adjacent tokens do, wrong ones do not, and the next step re-reads the corrected position.

Timing: one CUDA graph per depth (all on the same pool and device planner), replayed with the step's routing
copied into its static ids; CUDA events around each replay, read one step late (the governor is fed as an
overlapped server feeds it: the next step is chosen and launched before the last one's time is known), so the
GPU queue never drains; summed over the counted steps. tok/s/req = accepted tokens per request over the counted
steps / their time. The governed row counts its climb and its probes. misses/step: the pool's misses (distinct
expert reads over PCIe, the planner's counters) over the counted steps, read at the run's two ends (a boundary
read: syncs, outside the timed steps).

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
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.baselines import Ours
from bench.common import commit_id, print_table, write
from bench.decode_steps import Shape, empty_cache, make_bank, make_ours, sync
from bench.decode_traces import PER_LAYER, SYNTHETIC
from bench.traces import synthetic_trace
from pooled_runner.lanes import decode_lanes
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import SpecGovernor
from pooled_runner.spec_state import load_family, save_family

DEPTHS = (0, 1, 3)
POOLS = (0.25, 0.5, 0.75)
BATCHES = (1, 4, 16)


def request_lanes(shape: Shape, bs: int, tokens: int) -> torch.Tensor:
    """`[tokens, L, 2 * bs, K]` on the CPU (the decode bench's per-layer skew family): lane b < bs is request b's
    true continuation, lane bs + b the tokens its wrong drafts route like (same layers' popularity)."""
    spec = SYNTHETIC[PER_LAYER]
    trace = synthetic_trace(tokens, shape.L, shape.E, shape.K, 2 * bs, seed=17 + bs, **spec)  # type: ignore[arg-type]
    return trace.ids.long()


def verify_ids(lanes: torch.Tensor, positions: list[int], depth: int, accepted: list[int]) -> torch.Tensor:
    """A verify step's routing `[L, bs * (1 + depth), K]`, request-major: request b's tokens p .. p + a_b from its
    true lane b, then p + a_b + 1 .. p + depth from its other lane bs + b (`lanes [tokens, L, 2 * bs, K]`)."""
    n, bs = 1 + depth, len(positions)
    token = torch.tensor([p + j for p in positions for j in range(n)])
    lane = torch.tensor([b if j <= a else bs + b for b, a in enumerate(accepted) for j in range(n)])
    return lanes[token, :, lane, :].permute(1, 0, 2)


class DepthGraphs:
    """One captured verify step per depth, all on one `Ours` (pool and device planner shared between them)."""

    def __init__(self, system: Ours, shape: Shape, bs: int, depths: tuple[int, ...], lanes: torch.Tensor, device: torch.device, g):  # type: ignore[no-untyped-def]  # fmt: skip
        self.system, self.L, self.device, self.bs = system, shape.L, device, bs
        self.cuda = device.type == "cuda"
        self.static: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.x: dict[int, torch.Tensor] = {}
        self.w: dict[int, torch.Tensor] = {}
        for d in depths:
            width = bs * (1 + d)
            self.x[d] = torch.randn(shape.L, width, shape.H, generator=g, device=device).bfloat16()
            self.w[d] = torch.softmax(torch.randn(shape.L, width, shape.K, generator=g, device=device), -1)
            self.static[d] = verify_ids(lanes, [0] * bs, d, [d] * bs).to(device)
            self._eager(d)  # compiles; on CUDA the planner takes the tables at the first step
            if self.cuda:
                sync(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._eager(d)
                self.graphs[d] = graph

    def _eager(self, d: int) -> None:
        for layer in range(self.L):
            self.system.forward(layer, self.x[d][layer], self.static[d][layer], self.w[d][layer])

    def launch(self, d: int, ids: torch.Tensor) -> Callable[[], float]:
        """Enqueue one verify step at depth `d` with routing `ids` (CPU); returns a function giving its
        milliseconds (on CUDA it waits for the step's end event: call it after enqueueing the next step)."""
        if not self.cuda:
            t0 = time.perf_counter()
            self.static[d].copy_(ids)
            self._eager(d)
            ms = (time.perf_counter() - t0) * 1e3
            return lambda: ms
        self.static[d].copy_(ids.pin_memory(), non_blocking=True)  # stream-ordered after the last replay
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graphs[d].replay()
        end.record()

        def elapsed() -> float:
            end.synchronize()
            return start.elapsed_time(end)

        return elapsed


@dataclass
class PolicyRun:
    policy: str
    steps: int = 0
    tokens: float = 0.0  # accepted tokens per request, summed over counted steps
    ms: float = 0.0
    misses: int = 0  # pool misses over the counted steps
    at_depth: dict[int, int] = field(default_factory=dict)

    def add(self, other: PolicyRun) -> None:
        """Sum `other` (another round of the same policy) into this one."""
        assert other.policy == self.policy, (other.policy, self.policy)
        self.steps += other.steps
        self.tokens += other.tokens
        self.ms += other.ms
        self.misses += other.misses
        for d, n in other.at_depth.items():
            self.at_depth[d] = self.at_depth.get(d, 0) + n

    @property
    def tok_s_req(self) -> float:
        return self.tokens / (self.ms * 1e-3) if self.ms > 0 else math.nan


def sample_accepted(depth: int, accept: float, rng: random.Random) -> int:
    n = 0
    while n < depth and rng.random() < accept:
        n += 1
    return n


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


def run_steps(graphs: DepthGraphs, lanes: torch.Tensor, governor: SpecGovernor | None, fixed: int | None, num_steps: int, warm: int, accept: float, seed: int, out: PolicyRun | None, start: int = 0) -> int:  # fmt: skip
    """`num_steps` verify steps from trace position `start` at `fixed` or the governor's choice (the first
    `warm` at the smallest depth, not observed); the later ones observed by the governor and, with `out`,
    counted there. Stops early when a request's lanes have fewer than 1 + max depth tokens left; returns the
    steps run. Each step's time is read after the next step is enqueued (the governor's overlapped-caller
    contract)."""
    depths = tuple(sorted(graphs.static))
    bs = lanes.shape[2] // 2
    rng = random.Random(seed)
    positions = [start] * bs
    pending: tuple[int, int, list[int], Callable[[], float]] | None = None
    misses_before = graphs.system.traffic().misses  # uncounted steps, if any, are taken off below

    def finish(step: int, d: int, accepted: list[int], elapsed: Callable[[], float]) -> None:
        ms = elapsed()
        if step < warm:  # the pool follows the working set; the governor has not started
            return
        if governor is not None:
            governor.observe(d, accepted, ms * 1e-3)
        if out is not None:
            out.steps += 1
            out.tokens += 1.0 + sum(accepted) / bs
            out.ms += ms
            out.at_depth[d] = out.at_depth.get(d, 0) + 1

    ran = 0
    for step in range(num_steps):
        if step == warm and warm > 0:
            if pending is not None:  # the last uncounted step's time before the boundary read
                finish(*pending)
                pending = None
            misses_before = graphs.system.traffic().misses
        # warm-up steps run where the policy starts: its fixed depth, or the governor's first (smallest) depth
        d = fixed if governor is None else depths[0] if step < warm else governor.choose()
        assert d is not None
        if max(positions) + 1 + max(depths) > lanes.shape[0]:
            break
        accepted = [
            sample_accepted(d, accept, rng) for _ in range(bs)
        ]  # known to the trace, not to the governor
        elapsed = graphs.launch(d, verify_ids(lanes, positions, d, accepted))
        positions = [p + 1 + a for p, a in zip(positions, accepted)]
        if pending is not None:
            finish(*pending)
        pending = (step, d, accepted, elapsed)
        ran += 1
    if pending is not None:
        finish(*pending)
    if out is not None:
        out.misses += graphs.system.traffic().misses - misses_before
    return ran


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
