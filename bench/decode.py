"""Decode benchmark (GPU): a model-shaped stack of MoE layers, decode steps on routing traces, four systems side
by side in one process (`bench/baselines.py`, `bench/baseline_slots.py`), plain decode and MTP verify steps.

Shape: Qwen3-30B-like (H 2048, I 768, E 128, top-8, bf16), 8 layers (`--quick`) or 12. The bank is generated
on the GPU and copied into a pinned `ExpertBank` (as bench/prefill.py does); every system reads that bank (ours
copies it into its own). Traces (`bench/decode_traces.py`): the same Zipf skew in every layer, or a per-layer
skew drawn from a range (some layers hot, some flat), token-to-token reuse 0.3, and one recorded from a real
transformers `generate` run of a random-init Qwen3-MoE with the bench's E, top-k and layer count (near-uniform
routing: random routers have no hot experts), at bs 1 / 4 / 16; pool 25/50/75% of all experts (`R` rows for
ours, `R // L` slots per layer for the per-layer baseline: equal VRAM).

MTP (`--mtp`): verify steps of bs x (1 + 3) tokens, each request's drafts the next tokens of its trace lane (so
they overlap their neighbours' experts as adjacent tokens do), synthetic acceptance 0.6 per draft, chain drafts:
1 + a + a^2 + a^3 = 2.18 tokens per request per verify step; tokens/s per request = that / step time, reported
against ours at num_spec 0 on the same trace, bs and pool. Ours runs them with decode lanes bs_max x 4 (every
verify step device-planned and captured; a step leaving the decode path fails its row). Rows for ours and
all-resident; all-host-view and per-layer slots only at bs <= 4 (full run; their bs-16 verify steps read nearly
every expert over PCIe). `--quick` runs MTP on the per-layer-skew family only. Ours with draft-lane pruning
(`pooled_runner/draft_prune.py`: a draft lane that routes an expert neither resident nor routed by a verified
token dies, with every later draft of its request) gets its own MTP rows: its accepted tokens per request per
step are measured, from the live lanes after each step (`1 + sum_{j<=m} a^j`, m = the request's last live
lane), not assumed.

Timing: the first `warm` trace steps are not counted; then CUDA events around the remaining steps (all layers),
mean ms per step. Ours, all-resident and all-host-view run a captured CUDA graph of one step, replayed with the
step's routing copied into static buffers (their real counterparts capture decode); the per-layer slots
baseline runs eager (host-planned residency, one sync per layer, as SGLang's eager executor), and the table says
whether SGLang would have captured that step width (tokens <= S // top_k). Steps hold the MoE layers only.
Draft pruning rows: the graph holds the lane reset and one pruning launch per layer; after each timed replay a
device copy of the live lanes is enqueued (one tiny copy, no sync, inside the timed region), read after it.

Bound (DESIGN.md §4, bandwidths measured in this run): misses' bytes / PCIe + hits' bytes / HBM, per system from
its own traffic (PCIe = zero-copy read for ours and the host view, copy engine for the slots).

Usage: python -m bench.decode [--quick] [--mtp {none,per-layer,all}] [--families {all,per-layer}] [--ours-only]
                              [--draft-budgets 0,8] [--out results.md]
(also writes results.json beside --out)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from bench.baseline_slots import PerLayerSlots
from bench.baselines import AllHostView, AllResident, Ours
from bench.common import Bandwidths, bound_ms, commit_id, measure_bandwidths, print_table, write
from bench.decode_steps import (
    FMT,
    NO_MTP,
    Mtp,
    OursDraftPruned,
    Shape,
    empty_cache,
    make_bank,
    make_ours,
    time_steps,
)
from bench.decode_traces import FAMILIES, PER_LAYER, TraceKey, build_traces
from pooled_runner.lanes import decode_lanes

__all__ = ["BATCHES", "FAMILIES", "POOLS", "QWEN3", "Mtp", "Result", "Shape", "run", "table"]

QWEN3 = Shape()
BATCHES = (1, 4, 16)
DEFAULT_MTP = Mtp()
POOLS = (0.25, 0.5, 0.75)


@dataclass
class Result:
    trace: str
    bs: int
    pool: float
    system: str
    ms: float  # per step (a verify step with MTP)
    tok_s: float  # accepted tokens/s of the whole batch
    hit_rate: float
    pcie_mb: float  # per step
    bound_ms: float
    over_bound: float
    ours_speedup: float  # this system's ms / ours' ms at the same (trace, bs, pool, num_spec)
    graph: str
    error: str = ""
    num_spec: int = 0
    tokens: int = 0  # tokens per step: bs x (1 + num_spec)
    tok_s_req: float = math.nan  # accepted tokens/s per request
    vs_ours_spec0: float = math.nan  # tok_s_req / ours' tok_s_req at num_spec 0, same (trace, bs, pool)
    tokens_per_req: float = math.nan  # accepted tokens per request per step (measured with draft pruning)


def measure(system, key: TraceKey, pool: float, ids, x, w, warm, bw: Bandwidths, per_step: float) -> Result:  # type: ignore[no-untyped-def]
    """One row: `system` on trace `ids [S, L, T, K]`; `per_step` accepted tokens per request per step."""
    steps = ids.shape[0] - warm
    nan = math.nan
    try:
        left = sum(system.moe.step_widths["prefill"].values()) if isinstance(system, Ours) else 0
        if isinstance(system, OursDraftPruned):
            system.clear()
        ms, t = time_steps(system, ids, x, w, warm)
        if isinstance(system, Ours) and sum(system.moe.step_widths["prefill"].values()) > left:
            widths = dict(system.moe.step_widths["prefill"])
            raise RuntimeError(f"steps left the decode path: {widths} (lanes {system.moe.decode_lanes})")
    except Exception as exc:  # report and keep going: one failing system must not cost the others' rows
        traceback.print_exc()
        return Result(
            key.family, key.bs, pool, system.name, nan, nan, nan, nan, nan, nan, nan, "-", repr(exc)[:200],
            num_spec=key.num_spec, tokens=key.tokens,
        )  # fmt: skip
    graph_note = ""
    if isinstance(system, OursDraftPruned):  # measured from the live lanes of the timed steps
        per_step, live_drafts = system.take_emitted()
        graph_note = f", live drafts {live_drafts:.2f}/{system.num_spec} per request"
    miss_bytes, hit_bytes = t.pcie_bytes / steps, t.hits * system.row_bytes / steps
    host_path = "copy" if isinstance(system, PerLayerSlots) else "zero_copy"
    bound = bound_ms(miss_bytes, hit_bytes, bw, host_path)
    if isinstance(system, PerLayerSlots):
        eligible = t.graph_eligible == t.layer_steps
        graph = f"eager, {t.waves / t.layer_steps:.2f} waves/layer; SGLang graph {'yes' if eligible else 'no'} (tokens <= {system.max_graph_bs})"
    else:
        graph = "captured" if ids.is_cuda else "eager (no CUDA)"
        if isinstance(system, Ours):
            graph += f", lanes {system.moe.decode_lanes}{graph_note}"
    per_s = per_step / (ms * 1e-3)
    return Result(
        key.family, key.bs, pool, system.name, ms, key.bs * per_s, t.hit_rate, miss_bytes / 1e6, bound,
        ms / bound if bound > 0 else nan, nan, graph, tok_s_req=per_s,
        num_spec=key.num_spec, tokens=key.tokens, tokens_per_req=per_step,
    )  # fmt: skip


_T = TypeVar("_T")


def _build(what: str, make: Callable[[], _T]) -> _T | None:
    try:
        return make()
    except Exception as exc:  # report and keep going: the other systems still get their rows
        traceback.print_exc()
        print(f"{what}: build failed: {exc!r}", flush=True)
        return None


def _close(system: Ours | None) -> None:
    if system is not None and system.moe.bank is not None:
        system.moe.bank.close()


def run(
    shape: Shape,
    steps: int,
    warm: int,
    device: torch.device,
    commit: str = "",
    bw: Bandwidths | None = None,
    batches: tuple[int, ...] = BATCHES,
    pools: tuple[float, ...] = POOLS,
    families: tuple[str, ...] = FAMILIES,
    mtp: Mtp = DEFAULT_MTP,
    references: bool = True,
) -> tuple[list[str], list[Result]]:
    """Every system on every (trace, bs, pool, num_spec): header lines and one `Result` per row, in table order.
    `references` False: ours only (with and without draft pruning), no baseline systems."""
    H, I, E, K, L = shape.H, shape.I, shape.E, shape.K, shape.L
    g = torch.Generator(device=device).manual_seed(0)
    bw = bw or measure_bandwidths()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    traces_cpu, trace_lines = build_traces(
        L, E, K, steps, batches, families, mtp.num_spec, mtp.families if mtp.num_spec else ()
    )
    header = [
        f"date {datetime.date.today()}, GPU {where}, torch {torch.__version__}, commit {commit_id(commit)}",
        f"measured: {bw.describe()}",
        f"shape: H {H}, I {I}, E {E}, top-{K}, {FMT}, {L} MoE layers; {steps} decode steps per trace, first "
        f"{warm} not counted",
        *trace_lines,
    ]
    if mtp.num_spec:
        header.append(
            f"MTP: num_spec {mtp.num_spec}, acceptance {mtp.accept} per draft (chain): "
            f"{mtp.tokens_per_step:.3f} tokens per request per verify step; on {', '.join(mtp.families)}"
            + (
                f"; draft pruning rows with budgets {list(mtp.draft_budgets)} (unpaid routes a draft lane may "
                "have per verify step)"
                if mtp.draft_budgets
                else ""
            )
        )
    print("\n".join(header), flush=True)
    bank = make_bank(shape, device, g)
    widths = sorted({key.tokens for key in traces_cpu})
    x = {n: torch.randn(L, n, H, generator=g, device=device).bfloat16() for n in widths}
    w = {n: torch.softmax(torch.randn(L, n, K, generator=g, device=device), -1) for n in widths}
    traces = {key: ids.to(device) for key, ids in traces_cpu.items()}

    def row(system, key: TraceKey, pool: float) -> Result:  # type: ignore[no-untyped-def]
        per_step = mtp.tokens_per_step if key.num_spec else 1.0
        ids = traces[key]
        return measure(system, key, pool, ids, x[key.tokens], w[key.tokens], warm, bw, per_step)

    fixed: dict[TraceKey, list[Result]] = {}
    for cls in (AllResident, AllHostView) if references else ():
        static = cls(bank, FMT, torch.bfloat16, H, I, device.type)
        for key in traces:
            if mtp.runs(cls.name, key):
                fixed.setdefault(key, []).append(row(static, key, 0.0))
        del static
        empty_cache(device)
    results: list[Result] = []
    plain = [key for key in traces if key.num_spec == 0]
    verify = [key for key in traces if key.num_spec > 0]
    for frac in pools:
        rows = int(frac * L * E)
        measured: dict[TraceKey, list[Result]] = {key: [] for key in traces}
        slots = None
        if references:
            slots = _build(
                f"pool {frac:.0%} per-layer slots",
                partial(
                    PerLayerSlots, bank, FMT, torch.bfloat16, H, I, device.type, num_slots=rows // L, top_k=K
                ),
            )
        verify_lanes = decode_lanes(max(batches), mtp.num_spec)
        # (lanes, keys, (num_spec, acceptance) with draft pruning or None, budget)
        passes: list[tuple[int, list[TraceKey], tuple[int, float] | None, int]] = [
            (max(batches), plain, None, 0),
            (verify_lanes, verify, None, 0),
        ]
        passes += [(verify_lanes, verify, (mtp.num_spec, mtp.accept), b) for b in mtp.draft_budgets]
        for lanes, keys, pruning, budget in passes:
            if not keys:
                continue
            what = "" if pruning is None else f", draft pruning, budget {budget}"
            ours = _build(
                f"pool {frac:.0%} ours{what}",
                partial(make_ours, bank, shape, rows, lanes, device, pruning, budget),
            )
            for key in keys:
                for system in (slots, ours) if pruning is None else (ours,):
                    if system is not None and mtp.runs(system.name, key):
                        measured[key].append(row(system, key, frac))
                print(
                    f"done: {key.family}, bs {key.bs}, num_spec {key.num_spec}, pool {frac:.0%}", flush=True
                )
            _close(ours)
            del ours
            empty_cache(device)
        for key in traces:
            results += measured[key] + [replace(r, pool=frac) for r in fixed.get(key, [])]
        del slots
        empty_cache(device)
    bank.close()
    relate(results)
    return header, results


def relate(results: list[Result]) -> None:
    """Fill each row's `ours_speedup` and `vs_ours_spec0` from ours' rows."""
    ours = {(r.trace, r.bs, r.pool, r.num_spec): r for r in results if r.system == Ours.name}
    for r in results:
        same, spec0 = ours.get((r.trace, r.bs, r.pool, r.num_spec)), ours.get((r.trace, r.bs, r.pool, 0))
        r.ours_speedup = r.ms / same.ms if same is not None else math.nan
        r.vs_ours_spec0 = r.tok_s_req / spec0.tok_s_req if spec0 is not None else math.nan


def mtp_summary(results: list[Result]) -> str:
    """One line per MTP system of ours (plain, draft pruning): its tokens/s per request against ours at num_spec
    0, over every (trace, bs, pool) that has both."""
    lines = []
    pruned = dict.fromkeys(r.system for r in results if r.system.startswith(OursDraftPruned.name))
    for system in (Ours.name, *pruned):
        gains = [
            (r.vs_ours_spec0, r)
            for r in results
            if r.system == system and r.num_spec and math.isfinite(r.vs_ours_spec0)
        ]
        if not gains:
            continue
        lo, worst = min(gains, key=lambda p: p[0])
        hi = max(g for g, _ in gains)
        below = sum(g < 1 for g, _ in gains)
        lines.append(
            f"MTP: {system}'s tokens/s per request with num_spec {worst.num_spec} / ours at num_spec 0: {lo:.2f}x "
            f"to {hi:.2f}x over {len(gains)} (trace, bs, pool) cases; below 1 in {below} (lowest: "
            f"{worst.trace}, bs {worst.bs}, pool {worst.pool:.0%})"
        )
    return "\n".join(lines) or "MTP: no rows"


def table(results: list[Result]) -> str:
    header = [
        "trace", "bs", "spec", "pool", "system", "tokens/step", "tok/req/step", "ms/step", "tok/s", "tok/s/req",
        "vs ours spec 0", "hit rate", "PCIe MB/step", "bound ms", "time/bound", "its ms / ours", "graph",
    ]  # fmt: skip
    rows = [
        [
            r.trace, r.bs, r.num_spec, f"{r.pool:.0%}", r.system, r.tokens, r.tokens_per_req, r.ms, f"{r.tok_s:.0f}",
            f"{r.tok_s_req:.1f}", r.vs_ours_spec0, r.hit_rate, r.pcie_mb, r.bound_ms, r.over_bound,
            r.ours_speedup, r.graph + (f" ERROR {r.error}" if r.error else ""),
        ]
        for r in results
    ]  # fmt: skip
    return print_table("Decode step, MoE layers only", header, rows)


NOTES = [
    "",
    "its ms / ours > 1: ours is that many times faster (same num_spec). Pool = R / all experts (the slots get "
    "R // L per layer). All-resident and all-host-view do not depend on the pool (measured once per trace, bs "
    "and num_spec). Traffic: distinct (layer, expert) per step; the host view reads each routed expert once per "
    "layer step at decode widths. Per-layer slots run eager here; at widths marked 'SGLang graph yes' SGLang "
    "would capture them (device decide + gather), so their time there includes host planning it would not pay.",
    "spec > 0: MTP verify steps (tokens/step = bs x (1 + spec)); tok/s/req = accepted tokens per request per "
    "verify step (synthetic acceptance, see the header) / step time; 'vs ours spec 0' = tok/s/req / ours' at "
    "spec 0 on the same trace, bs and pool (for ours' MTP rows: the gain from MTP). tok/req/step: accepted tokens "
    "per request per step; measured for 'draft pruning' rows (a draft lane whose experts are neither resident "
    "nor routed by a verified token is dropped, with the drafts after it; the verifier accepts only up to the "
    "last live lane), assumed from the acceptance for the others.",
    "The recorded trace comes from a random-init model: its routers spread tokens near-uniformly over the "
    "experts (no hot experts, unlike a trained model), so it shows how a pool does without skew; its adjacent-"
    "token overlap is the model's own (header).",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, 24 steps per trace, MTP on one family")
    ap.add_argument(
        "--mtp",
        choices=("none", "per-layer", "all"),
        default=None,
        help="MTP rows: none, the per-layer-skew family (the --quick default), every family (the default)",
    )
    ap.add_argument(
        "--families",
        choices=("all", "per-layer"),
        default="all",
        help="trace families of every row (per-layer: the per-layer-skew family only)",
    )
    ap.add_argument(
        "--ours-only", action="store_true", help="only ours (with and without draft pruning): no baselines"
    )
    ap.add_argument(
        "--draft-budgets",
        default=",".join(map(str, Mtp.draft_budgets)),
        help="draft pruning rows, one system per budget (comma-separated; unpaid routes a draft lane may have "
        "per verify step, all layers, and stay live); empty: no draft pruning rows",
    )
    ap.add_argument("--out", default=None, help="markdown results; the JSON goes beside it (.json)")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode needs a CUDA GPU")
    shape = replace(QWEN3, L=8) if args.quick else QWEN3
    steps, warm = (24, 6) if args.quick else (100, 25)
    choice = args.mtp or ("per-layer" if args.quick else "all")
    mtp_families = {"none": (), "per-layer": (PER_LAYER,), "all": FAMILIES}[choice]
    # --quick: MTP rows for ours and all-resident only (the reference systems' verify steps are the slow rows)
    mtp = (
        Mtp(
            families=mtp_families,
            reference_max_bs=0 if args.quick else 4,
            draft_budgets=tuple(int(b) for b in args.draft_budgets.split(",") if b.strip()),
        )
        if mtp_families
        else NO_MTP
    )
    families = FAMILIES if args.families == "all" else (PER_LAYER,)
    header, results = run(
        shape,
        steps,
        warm,
        torch.device("cuda"),
        args.commit,
        families=families,
        mtp=mtp,
        references=not args.ours_only,
    )
    text = table(results)
    write(args.out, [*header, "", text, *NOTES, "", mtp_summary(results)])
    if args.out:
        meta = {"header": header, "results": [asdict(r) for r in results]}
        Path(args.out).with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
