"""Decode benchmark (GPU): a model-shaped stack of MoE layers, decode steps on synthetic routing traces, four
systems side by side in one process (`bench/baselines.py`).

Shape: Qwen3-30B-like (H 2048, I 768, E 128, top-8, bf16), 8 layers (`--quick`) or 12. The bank is generated
on the GPU and copied into a pinned `ExpertBank` (as bench/prefill.py does); every system reads that bank (ours
copies it into its own). Traces (`bench/traces.py`): the same Zipf skew in every layer, or a per-layer skew
drawn from a range (some layers hot, some flat), token-to-token reuse 0.3, at bs 1 / 4 / 16; pool 25/50/75% of
all experts (`R` rows for ours, `R // L` slots per layer for the per-layer baseline: equal VRAM).

Timing: the first `warm` trace steps are not counted; then CUDA events around the remaining steps (all layers),
mean ms per step. Ours, all-resident and all-host-view run a captured CUDA graph of one step, replayed with the
step's routing copied into static buffers (their real counterparts capture decode); the per-layer slots
baseline runs eager (host-planned residency, one sync per layer, as SGLang's eager executor), and the table says
whether SGLang would have captured that batch size (bs <= S // top_k). Steps hold the MoE layers only.

Bound (DESIGN.md §4, bandwidths measured in this run): misses' bytes / PCIe + hits' bytes / HBM, per system from
its own traffic (PCIe = zero-copy read for ours and the host view, copy engine for the slots).

Usage: python -m bench.decode [--quick] [--out results.md]   (also writes results.json beside --out)
"""

from __future__ import annotations

import argparse
import datetime
import json
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.baselines import AllHostView, AllResident, Ours, PerLayerSlots
from bench.common import Bandwidths, bound_ms, commit_id, measure_bandwidths, print_table, write
from bench.decode_steps import FMT, Shape, empty_cache, make_bank, make_ours, time_steps
from bench.traces import synthetic_trace

__all__ = ["BATCHES", "POOLS", "QWEN3", "TRACES", "Result", "Shape", "run", "table"]

QWEN3 = Shape()
TRACES = {  # name: synthetic_trace arguments
    "same skew (Zipf 1.0)": dict(skew=(1.0, 1.0), reuse=0.3),
    "per-layer skew (Zipf 0.4-1.6)": dict(skew=(0.4, 1.6), reuse=0.3),
}
BATCHES = (1, 4, 16)
POOLS = (0.25, 0.5, 0.75)


@dataclass
class Result:
    trace: str
    bs: int
    pool: float
    system: str
    ms: float
    tok_s: float
    hit_rate: float
    pcie_mb: float  # per step
    bound_ms: float
    over_bound: float
    ours_speedup: float  # this system's ms / ours' ms at the same (trace, bs, pool)
    graph: str
    error: str = ""


def measure(system, ids, x, w, warm, bw: Bandwidths, key: tuple[str, int, float]) -> Result:  # type: ignore[no-untyped-def]
    trace, bs, pool = key
    steps = ids.shape[0] - warm
    try:
        ms, t = time_steps(system, ids, x, w, warm)
    except Exception as exc:  # report and keep going: one failing system must not cost the others' rows
        traceback.print_exc()
        nan = float("nan")
        return Result(trace, bs, pool, system.name, nan, nan, nan, nan, nan, nan, nan, "-", repr(exc)[:200])
    miss_bytes, hit_bytes = t.pcie_bytes / steps, t.hits * system.row_bytes / steps
    host_path = "copy" if isinstance(system, PerLayerSlots) else "zero_copy"
    bound = bound_ms(miss_bytes, hit_bytes, bw, host_path)
    if isinstance(system, PerLayerSlots):
        eligible = t.graph_eligible == t.layer_steps
        graph = f"eager, {t.waves / t.layer_steps:.2f} waves/layer; SGLang graph {'yes' if eligible else 'no'} (bs <= {system.max_graph_bs})"
    else:
        graph = "captured" if ids.is_cuda else "eager (no CUDA)"
    return Result(
        trace, bs, pool, system.name, ms, bs / (ms * 1e-3), t.hit_rate, miss_bytes / 1e6, bound,
        ms / bound if bound > 0 else float("nan"), float("nan"), graph,
    )  # fmt: skip


def run(
    shape: Shape,
    steps: int,
    warm: int,
    device: torch.device,
    commit: str = "",
    bw: Bandwidths | None = None,
    batches: tuple[int, ...] = BATCHES,
    pools: tuple[float, ...] = POOLS,
) -> tuple[list[str], list[Result]]:
    """Every system on every (trace, bs, pool): header lines and one `Result` per row, in table order."""
    H, I, E, K, L = shape.H, shape.I, shape.E, shape.K, shape.L
    g = torch.Generator(device=device).manual_seed(0)
    bw = bw or measure_bandwidths()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = [
        f"date {datetime.date.today()}, GPU {where}, torch {torch.__version__}, commit {commit_id(commit)}",
        f"measured: {bw.describe()}",
        f"shape: H {H}, I {I}, E {E}, top-{K}, {FMT}, {L} MoE layers; {steps} decode steps per trace, first "
        f"{warm} not counted",
    ]
    print("\n".join(header), flush=True)
    bank = make_bank(shape, device, g)
    x = {bs: torch.randn(L, bs, H, generator=g, device=device).bfloat16() for bs in batches}
    w = {bs: torch.softmax(torch.randn(L, bs, K, generator=g, device=device), -1) for bs in batches}
    traces = {
        (name, bs): synthetic_trace(steps, L, E, K, bs, seed=17 + bs, **spec).ids.to(device, torch.int64)  # type: ignore[arg-type]
        for name, spec in TRACES.items()
        for bs in batches
    }
    fixed: dict[tuple[str, int], list[Result]] = {}
    for cls in (AllResident, AllHostView):
        system = cls(bank, FMT, torch.bfloat16, H, I, device.type)
        for (name, bs), ids in traces.items():
            r = measure(system, ids, x[bs], w[bs], warm, bw, (name, bs, 0.0))
            fixed.setdefault((name, bs), []).append(r)
        del system
        empty_cache(device)
    results: list[Result] = []
    for frac in pools:
        rows = int(frac * L * E)
        systems: list[PerLayerSlots | Ours] = []
        try:
            systems = [
                PerLayerSlots(bank, FMT, torch.bfloat16, H, I, device.type, num_slots=rows // L, top_k=K),
                make_ours(bank, shape, rows, max(batches), device),
            ]
        except Exception as exc:
            traceback.print_exc()
            print(f"pool {frac:.0%}: build failed: {exc!r}", flush=True)
        for (name, bs), ids in traces.items():
            block = [measure(s, ids, x[bs], w[bs], warm, bw, (name, bs, frac)) for s in systems]
            block += [replace(r, pool=frac) for r in fixed[(name, bs)]]
            ours_ms = next((r.ms for r in block if r.system == Ours.name), float("nan"))
            for r in block:
                r.ours_speedup = r.ms / ours_ms
            results += block
            print(f"done: {name}, bs {bs}, pool {frac:.0%}", flush=True)
        for s in systems:
            if isinstance(s, Ours) and s.moe.bank is not None:
                s.moe.bank.close()
        del systems
        empty_cache(device)
    bank.close()
    return header, results


def table(results: list[Result]) -> str:
    header = [
        "trace", "bs", "pool", "system", "ms/step", "tok/s", "hit rate", "PCIe MB/step", "bound ms",
        "time/bound", "its ms / ours", "graph",
    ]  # fmt: skip
    rows = [
        [
            r.trace, r.bs, f"{r.pool:.0%}", r.system, r.ms, f"{r.tok_s:.0f}", r.hit_rate, r.pcie_mb, r.bound_ms,
            r.over_bound, r.ours_speedup, r.graph + (f" ERROR {r.error}" if r.error else ""),
        ]
        for r in results
    ]  # fmt: skip
    return print_table("Decode step, MoE layers only", header, rows)


NOTES = [
    "",
    "its ms / ours > 1: ours is that many times faster. Pool = R / all experts (the slots get R // L per layer). "
    "All-resident and all-host-view do not depend on the pool (measured once per trace and bs). Traffic: "
    "distinct (layer, expert) per step; the host view reads each routed expert once per layer step at decode "
    "widths. Per-layer slots run eager here; at batch sizes marked 'SGLang graph yes' SGLang would capture them "
    "(device decide + gather), so their time there includes host planning it would not pay.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, 24 steps per trace")
    ap.add_argument("--out", default=None, help="markdown results; the JSON goes beside it (.json)")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode needs a CUDA GPU")
    shape = replace(QWEN3, L=8) if args.quick else QWEN3
    steps, warm = (24, 6) if args.quick else (100, 25)
    header, results = run(shape, steps, warm, torch.device("cuda"), args.commit)
    text = table(results)
    write(args.out, [*header, "", text, *NOTES])
    if args.out:
        meta = {"header": header, "results": [asdict(r) for r in results]}
        Path(args.out).with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
