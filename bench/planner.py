"""Planner benchmark: device-planner and telemetry overhead under graph replay (GPU), decode steps against the
bound on a synthetic trace (GPU), and policy quality against LRU and Belady on synthetic traces (CPU).

GPU (default): Qwen3-30B-like layers (H 2048, I 768, E 128, top-8, bf16), 6 pooled layers, R = 384 rows (50%).
  - overhead: graph replay of one decode step (every layer) with routing that only hits, for M in 1, 4, 8:
    MoE kernel path alone; planner alone; planner + MoE; telemetry alone; telemetry + planner + MoE; for each
    planner of `--planners` (one: plan + admission copy in one launch, the CUDA default; two: plan, then copy;
    ops: the torch-ops planner).
  - trace: a skew-dominated synthetic trace replayed step by step (ids copied into the captured step's static
    buffer, then replay) with LRU and the frequency policy; time per step against the DESIGN.md §4 bound at the
    achieved hit rate, `hits x row / B_hbm + misses x row / B_zero_copy` (bandwidths measured in this run).
CPU (`--quality`): hit rates of LRU, the frequency, aging and adaptive policies and Belady (MIN with bypass) on
synthetic traces (24 layers, 128 experts, top-8, per-layer Zipf skew, token-to-token reuse, popularity drift), 25%
and 50% rows.

Usage: python bench/planner.py [--out results.md] [--quick] [--planners one,two,ops] [--copy-programs 32,64]  (GPU)
       python bench/planner.py --quality [--out quality.md]        (CPU)
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pooled_runner.kernels.plan_copy import COPY_PROGRAMS

from bench.common import time_graphs
from bench.traces import Trace, belady_hit_rate, policy_hit_rate, synthetic_trace
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import AgingFreqPolicy, FreqDecayPolicy, LRUPolicy, Policy
from pooled_runner.policy_adaptive import AdaptivePolicy
from pooled_runner.telemetry import RouteTelemetry

# Synthetic trace families: (skew range, reuse, drift_every). Skew-dominated first, then recency-dominated.
TRACES = {
    "skew A (Zipf 0.8-1.4, reuse 0.3)": dict(skew=(0.8, 1.4), reuse=0.3),
    "skew B (Zipf 0.6-1.2, reuse 0.1)": dict(skew=(0.6, 1.2), reuse=0.1),
    "skew C (Zipf 1.0-1.6, reuse 0)": dict(skew=(1.0, 1.6), reuse=0.0),
    "recency A (Zipf 0.2-0.6, reuse 0.7, drift 32)": dict(skew=(0.2, 0.6), reuse=0.7, drift_every=32),
    "recency B (Zipf 0-0.3, reuse 0.8, drift 16)": dict(skew=(0.0, 0.3), reuse=0.8, drift_every=16),
    "mixed (Zipf 0.6-1.2, reuse 0.5, drift 64)": dict(skew=(0.6, 1.2), reuse=0.5, drift_every=64),
}


def commit_of_checkout() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "n/a"


def write(path: str | None, lines: list[str]) -> None:
    print("\n".join(lines[-1:]), flush=True)
    if path:
        Path(path).write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------------
# CPU: policy quality
def quality(args: argparse.Namespace) -> None:
    steps, warmup = (120, 30) if args.quick else (300, 80)
    lines = [
        f"date {datetime.date.today()}, CPU simulation (the shipped DevicePlanner on CPU tensors), "
        f"commit {args.commit or commit_of_checkout()}; {steps} decode steps of {args.tokens} token(s), "
        f"first {warmup} not counted",
        "",
        "| trace | rows | Belady | LRU | lru-cycle | freq | aging | adaptive | LRU / Belady | lru-cycle / Belady | "
        "freq / Belady | aging / Belady | adaptive / Belady | lru-cycle miss / LRU miss | freq miss / LRU miss | "
        "aging miss / LRU miss | adaptive miss / LRU miss | Belady miss / LRU miss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    write(args.out, lines)
    for i, (name, spec) in enumerate(TRACES.items()):
        trace = synthetic_trace(steps, tokens_per_step=args.tokens, seed=100 + i, **spec)  # type: ignore[arg-type]
        total = sum(trace.num_experts_per_layer)
        for frac in (0.25, 0.5):
            rows = int(frac * total)
            best = belady_hit_rate(trace, rows, warmup)
            lru = policy_hit_rate(trace, rows, LRUPolicy(), warmup)
            cyc = policy_hit_rate(trace, rows, CycleLRUPolicy(), warmup)
            freq = policy_hit_rate(trace, rows, FreqDecayPolicy(), warmup)
            aging = policy_hit_rate(trace, rows, AgingFreqPolicy(), warmup)
            ada = policy_hit_rate(trace, rows, AdaptivePolicy(rows), warmup)

            def miss_ratio(rate: float, lru: float = lru, digits: int = 2) -> str:
                return f"{(1 - rate) / (1 - lru):.{digits}f}" if lru < 1 else "n/a"

            lines.append(
                f"| {name} | {frac:.0%} | {best:.3f} | {lru:.3f} | {cyc:.3f} | {freq:.3f} | {aging:.3f} | "
                f"{ada:.3f} | {lru / best:.2f} | {cyc / best:.2f} | {freq / best:.2f} | {aging / best:.2f} | "
                f"{ada / best:.2f} | {miss_ratio(cyc)} | {miss_ratio(freq)} | {miss_ratio(aging)} | "
                f"{miss_ratio(ada, digits=3)} | {miss_ratio(best)} |"
            )
            write(args.out, lines)
    lines += [
        "",
        "lru-cycle = cycle-protected LRU (the default; a row used by another layer within the last decode cycle "
        "is not evicted); freq = `FreqDecayPolicy()` defaults (counters of uncorrelated routings halved every 128 steps, +32 for "
        "experts routed in the last step, value admission); aging = `AgingFreqPolicy()` defaults (LFU with "
        "dynamic aging: key = inflation + count, inflation = largest evicted key); adaptive = "
        "`AdaptivePolicy(rows)` defaults (LRU or chain-start frequency, whichever an idealized shadow cache of "
        "the pool's size misses less on; see policy_adaptive.py). Belady = offline MIN with bypass per tick.",
    ]
    write(args.out, lines)


# --------------------------------------------------------------------------------------------------
# GPU
H, I, E, K, L = 2048, 768, 128, 8, 6
ROWS = 384
RESIDENT_PER_LAYER = ROWS // L


# --planners: name -> (label, DevicePlanner keywords)
PLANNERS: dict[str, tuple[str, dict[str, object]]] = {
    "one": ("fused, one launch (the default: plain grid, PDL, overlap)", {"fused": True, "one_launch": True}),
    "one-coop": (
        "fused, one launch, cooperative, no PDL, no overlap (the default before 2026-12-02)",
        {"fused": True, "one_launch": True, "cooperative": True, "pdl": False, "overlap": False},
    ),
    "one-overlap": (
        "fused, one launch, overlap, cooperative, no PDL",
        {"fused": True, "one_launch": True, "cooperative": True, "pdl": False, "overlap": True},
    ),
    "one-overlap-coop-pdl": (
        "fused, one launch, overlap, cooperative, PDL",
        {"fused": True, "one_launch": True, "cooperative": True, "pdl": True, "overlap": True},
    ),
    "one-coop-pdl": (
        "fused, one launch, cooperative, PDL, no overlap",
        {"fused": True, "one_launch": True, "cooperative": True, "pdl": True, "overlap": False},
    ),
    "one-nc": (
        "fused, one launch, plain grid, no PDL, no overlap",
        {"fused": True, "one_launch": True, "cooperative": False, "pdl": False, "overlap": False},
    ),
    "one-pdl": (
        "fused, one launch, plain grid, PDL, no overlap",
        {"fused": True, "one_launch": True, "cooperative": False, "pdl": True, "overlap": False},
    ),
    "one-w1": ("fused, one launch, 1 warp", {"fused": True, "one_launch": True, "plan_warps": 1}),
    "two": ("fused, two launches", {"fused": True, "one_launch": False}),
    "ops": ("torch ops", {"fused": False}),
}


def build(policy: Policy, **planner_kwargs: object):  # type: ignore[no-untyped-def]
    """Pooled stack, DevicePlanner(**planner_kwargs), telemetry and kernel path of the GPU rows."""
    from pooled_runner import PoolConfig, PooledMoE
    from pooled_runner.kernel_path import KernelPath

    g = torch.Generator().manual_seed(0)
    distinct = [
        {
            "w13": (torch.randn(2 * I, H, generator=g) / H**0.5).bfloat16(),
            "w2": (torch.randn(H, I, generator=g) / I**0.5).bfloat16(),
        }
        for _ in range(8)
    ]
    config = PoolConfig.resolve(pool_rows=ROWS, device="cuda", prefill_staging=False)
    moe = PooledMoE(config, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    priority = [(layer, e) for e in range(E) for layer in range(L)]  # experts 0..63 of every layer resident
    moe.install(lambda layer, e: distinct[(layer * E + e) % len(distinct)], priority)
    assert moe.pool is not None
    planner = DevicePlanner(moe.pool, policy, max_routed=8 * K, debug_checks=False, **planner_kwargs)  # type: ignore[arg-type]
    tel = RouteTelemetry([E] * L, moe.pool.device, fused=planner.fused)
    return moe, planner, tel, KernelPath(moe.format, moe.pool, moe.bank, H, I)


def overhead(lines: list[str], args: argparse.Namespace) -> None:
    lines += [
        "",
        "### Overhead per decode step (6 layers, routing that only hits; graph replay)",
        "",
        "| planner | M | MoE µs | planner µs | planner+MoE µs | planner / MoE | telemetry µs | "
        "tel+planner+MoE µs | telemetry / MoE layer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.planners:
        _overhead_rows(lines, args, name)
        torch.cuda.empty_cache()
    lines += [
        "",
        "planner / MoE = (planner+MoE - MoE) / MoE (targets: <= 5% of the step at M=1); telemetry / MoE layer = "
        "added time of telemetry on / MoE time (target < 2%). 'planner µs' and 'telemetry µs' alone are the "
        "launch-bound cost of their small kernels in isolation. planner 'fused, one launch': plan + admission "
        "copy in one launch per layer (kernels/plan_copy.py; the CUDA default); 'fused, two launches': one "
        "plan_lru launch + one row gather per 4 operands (POOLED_RUNNER_PLAN_SPLIT_COPY=1); telemetry recorded "
        "inside the plan kernel in both ('telemetry µs' alone is the standalone route-count launch of "
        "host-planned steps); 'torch ops': the policy-generic planner and telemetry "
        "(POOLED_RUNNER_TORCH_PLANNER=1).",
    ]
    write(args.out, lines)


def _overhead_rows(lines: list[str], args: argparse.Namespace, name: str) -> None:
    label, kwargs = PLANNERS[name]
    _moe, planner, tel, kpath = build(CycleLRUPolicy(), **kwargs)
    g = torch.Generator(device="cuda").manual_seed(1)
    for M in (1, 4, 8):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids = torch.stack(
            [
                torch.stack([torch.randperm(RESIDENT_PER_LAYER, device="cuda")[:K] for _ in range(M)])
                for _ in range(L)
            ]
        )  # [L, M, K] resident experts only
        w = torch.softmax(torch.randn(L, M, K, generator=g, device="cuda"), -1).bfloat16()

        def moe_only(x=x, ids=ids, w=w) -> None:
            for layer in range(L):
                kpath.forward(layer, x, ids[layer], w[layer])

        def plan_only(ids=ids) -> None:
            for layer in range(L):
                planner.plan(layer, ids[layer])

        def tel_only(ids=ids) -> None:
            for layer in range(L):
                tel.record(layer, ids[layer])

        def planned(x=x, ids=ids, w=w, telemetry: bool = False) -> None:
            for layer in range(L):  # as PooledMoE on CUDA: the planner records telemetry (fused: in-kernel)
                after_plan = planner.plan(layer, ids[layer], tel if telemetry else None)
                kpath.forward(layer, x, ids[layer], w[layer], after_plan=after_plan)

        t = time_graphs(
            {
                "moe": moe_only,
                "plan": plan_only,
                "tel": tel_only,
                "both": planned,
                "all": lambda: planned(telemetry=True),
            }
        )
        t_moe, t_plan, t_tel, t_both, t_all = (t[k] for k in ("moe", "plan", "tel", "both", "all"))
        lines.append(
            f"| {label} | {M} | {1e3 * t_moe:.1f} | {1e3 * t_plan:.1f} | {1e3 * t_both:.1f} | "
            f"{(t_both - t_moe) / t_moe:.1%} | {1e3 * t_tel:.1f} | {1e3 * t_all:.1f} | "
            f"{(t_all - t_both) / t_moe:.1%} |"
        )
        write(args.out, lines)
    counters = planner.counter_values()
    assert counters["misses"] == 0, f"overhead routing missed: {counters}"


def node_cost(lines: list[str], args: argparse.Namespace) -> None:
    """MoE alone against MoE + one empty kernel per layer where the plan goes: what a launch of its own costs."""
    from bench.empty_kernel import launch_empty

    _moe, _planner, _tel, kpath = build(CycleLRUPolicy(), fused=True, one_launch=True)
    lines += [
        "",
        "### What a launch of its own costs (6 layers, graph replay, an empty one-program kernel per layer)",
        "",
        "| M | MoE µs | + empty kernel µs | + empty PDL kernel µs | + empty PDL kernel, trigger, OVERLAP GEMMs µs | "
        "per layer (plain) | per layer (PDL) | per layer (trigger, OVERLAP) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator(device="cuda").manual_seed(2)
    for M in (1, 4):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids = torch.stack(
            [torch.randperm(RESIDENT_PER_LAYER, device="cuda")[:K].repeat(M, 1) for _ in range(L)]
        )
        w = torch.softmax(torch.randn(L, M, K, generator=g, device="cuda"), -1).bfloat16()

        def step(empty: str, x=x, ids=ids, w=w) -> None:
            for layer in range(L):
                if empty is not None:
                    launch_empty(ids[layer], pdl=empty != "plain", trigger=empty == "trigger")
                kpath.forward(layer, x, ids[layer], w[layer], after_plan=empty == "trigger")

        t = time_graphs({e: (lambda e=e: step(e)) for e in ("none", "plain", "pdl", "trigger")})
        t0 = t["none"]
        lines.append(
            f"| {M} | {1e3 * t0:.1f} | {1e3 * t['plain']:.1f} | {1e3 * t['pdl']:.1f} | {1e3 * t['trigger']:.1f} | "
            + " | ".join(f"{1e3 * (t[e] - t0) / L:.2f}" for e in ("plain", "pdl", "trigger"))
            + " |"
        )
        write(args.out, lines)


def trace_replay(lines: list[str], args: argparse.Namespace) -> None:
    from bench.common import measure_bandwidths

    bw = measure_bandwidths()
    steps, warm = (60, 20) if args.quick else (200, 50)
    trace: Trace = synthetic_trace(
        steps, num_layers=L, num_experts=E, top_k=K, skew=(0.8, 1.4), reuse=0.3, seed=7
    )
    lines += [
        "",
        f"### Decode steps on a synthetic trace against the bound (M=1, {L} layers, R={ROWS} of {L * E})",
        "",
        f"measured: {bw.describe()}",
        "",
        "| policy | hit rate | Belady hit rate | ms / step | bound ms / step | time / bound |",
        "|---|---|---|---|---|---|",
    ]
    write(args.out, lines)
    best = belady_hit_rate(trace, ROWS, warm)
    # (name, policy, DevicePlanner keywords)
    policies: list[tuple[str, Policy, dict[str, object]]] = [
        (
            f"lru-cycle (fused, one launch, P={p}{'; the default' if i == 0 else ''})",
            CycleLRUPolicy(),
            {"fused": True, "one_launch": True, "copy_programs": p},
        )
        for i, p in enumerate(args.copy_programs)
    ]
    policies += [
        ("lru-cycle (" + PLANNERS["one-coop"][0] + ")", CycleLRUPolicy(), PLANNERS["one-coop"][1]),
        ("lru-cycle (fused, two launches)", CycleLRUPolicy(), {"fused": True, "one_launch": False}),
        ("lru (fused, one launch)", LRUPolicy(), {"fused": True, "one_launch": True}),
        ("lru (torch ops)", LRUPolicy(), {"fused": False}),
        ("freq", FreqDecayPolicy(), {}),
        ("aging", AgingFreqPolicy(), {}),
    ]
    for name, policy, kwargs in policies:
        hits, misses, ms, row_bytes = _replay(trace, policy, warm, **kwargs)
        bound = 1e3 * (hits * row_bytes / bw.hbm_read + misses * row_bytes / bw.host_zero_copy)
        bound /= trace.num_steps - warm
        lines.append(
            f"| {name} | {hits / (hits + misses):.3f} | {best:.3f} | {ms:.3f} | {bound:.3f} | {ms / bound:.2f} |"
        )
        write(args.out, lines)
        torch.cuda.empty_cache()
    lines += [
        "",
        "time / bound target: <= 1.15. Bound = hits x row / HBM read + misses x row / zero-copy read, per step. "
        "Misses are admitted by an SM gather from the pinned bank before the GEMM (or read in place when no row "
        "is free-able), so each miss crosses PCIe once either way. The step includes only the pooled MoE layers.",
    ]
    write(args.out, lines)


def _replay(trace: Trace, policy: Policy, warm: int, **planner_kwargs: object) -> tuple[int, int, float, int]:
    """Replay `trace` through one captured decode step: (hits, misses, ms per step, row bytes) after `warm`."""
    moe, planner, _, kpath = build(policy, **planner_kwargs)
    steps = trace.num_steps
    ids_host = trace.ids.to(torch.int64).pin_memory()  # [S, L, 1, K]
    ids = torch.zeros(L, 1, K, dtype=torch.int64, device="cuda")
    x = torch.randn(1, H, device="cuda").bfloat16()
    w = torch.full((L, 1, K), 1.0 / K, device="cuda").bfloat16()

    def step() -> None:
        for layer in range(L):
            after_plan = planner.plan(layer, ids[layer])
            kpath.forward(layer, x, ids[layer], w[layer], after_plan=after_plan)

    ids.copy_(ids_host[0])
    step()  # compile before capture (this is trace step 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before = planner.counter_values()
    for s in range(1, steps):
        if s == warm:
            torch.cuda.synchronize()
            before = planner.counter_values()
            start.record()
        ids.copy_(ids_host[s], non_blocking=True)
        graph.replay()
    end.record()
    end.synchronize()
    after = planner.counter_values()
    ms = start.elapsed_time(end) / (steps - warm)
    return after["hits"] - before["hits"], after["misses"] - before["misses"], ms, moe.pool.row_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown results here as they come")
    ap.add_argument("--quick", action="store_true", help="shorter traces")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per decode step in --quality (batch size)")
    ap.add_argument(
        "--quality", action="store_true", help="CPU policy-quality simulation instead of GPU timing"
    )
    ap.add_argument("--commit", default="", help="commit to print (default: git rev-parse HEAD)")
    ap.add_argument(
        "--planners",
        default="one,one-coop,two,ops",
        help="overhead rows: comma list of "
        + "; ".join(f"{name}: {label}" for name, (label, _) in PLANNERS.items())
        + " (default: one,one-coop,two,ops)",
    )
    ap.add_argument(
        "--copy-programs",
        default=str(COPY_PROGRAMS),
        help="trace rows: comma list of program counts of the one-launch plan + copy (first: the default row)",
    )
    ap.add_argument("--no-trace", action="store_true", help="only the overhead table")
    ap.add_argument(
        "--node-cost",
        action="store_true",
        help="also time the MoE with an empty one-program kernel per layer where the plan goes (plain and PDL "
        "launch): the floor of any plan that is a launch of its own",
    )
    args = ap.parse_args()
    args.planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    if not args.planners or any(p not in PLANNERS for p in args.planners):
        raise SystemExit(f"--planners {args.planners}: expected a comma list of {', '.join(PLANNERS)}")
    args.copy_programs = [int(p) for p in args.copy_programs.split(",")]
    if args.quality:
        quality(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("the GPU benchmark needs CUDA; use --quality for the CPU policy simulation")
    import triton

    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, commit {args.commit or commit_of_checkout()}",
    ]
    write(args.out, lines)
    overhead(lines, args)
    torch.cuda.empty_cache()
    if args.node_cost:
        node_cost(lines, args)
    if not args.no_trace:
        trace_replay(lines, args)


if __name__ == "__main__":
    main()
