"""Planner benchmark: device-planner and telemetry overhead under graph replay (GPU), decode steps against the
bound on a synthetic trace (GPU), and policy quality against LRU and Belady on synthetic traces (CPU).

GPU (default): Qwen3-30B-like layers (H 2048, I 768, E 128, top-8, bf16), 6 pooled layers, R = 384 rows (50%).
  - overhead: graph replay of one decode step (every layer) with routing that only hits, for M in 1, 4, 8:
    MoE kernel path alone; planner alone; planner + MoE; telemetry alone; telemetry + planner + MoE; for each
    planner of `--planners` (one: plan + admission copy in one launch, the CUDA default; one-coop and others: its
    launch variants, `planner_overhead.PLANNERS`; two: plan, then copy; ops: the torch-ops planner).
  - trace: a skew-dominated synthetic trace (with its router scores) replayed step by step (ids and scores
    copied into the captured step's static buffers, then replay) with the LRU, frequency, adaptive and
    router-ordered policies; time per step against the DESIGN.md §4 bound at the achieved hit rate,
    `hits x row / B_hbm + misses x row / B_zero_copy` (bandwidths measured in this run).
CPU (`--quality`): hit rates of LRU, the frequency, aging, adaptive and router-ordered adaptive policies and
Belady (MIN with bypass) on synthetic traces (24 layers, 128 experts, top-8, per-layer Zipf skew, token-to-token
reuse, popularity drift; with their router scores, `--noise-scale lo,hi` spreading each expert's differently), 25%
and 50% rows.

  - forms (`--forms`, alone): the one-launch plan + copy's launch forms on miss-heavy steps of T tokens, taking
    turns round by round (`planner_forms.py`).
Usage: python bench/planner.py [--out results.md] [--quick] [--planners one,one-coop,two,ops] [--copy-programs 32,64]
                              [--no-trace] [--node-cost]                                   (GPU)
       python bench/planner.py --forms one,one-coop,one-pdl [--form-tokens 1,4,16,64] [--quick]  (GPU)
       python bench/planner.py --quality [--out quality.md]        (CPU)
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pooled_runner.kernels.plan_copy import COPY_PROGRAMS

from bench.common import commit_id
from bench.common import write_progress as write
from bench.planner_forms import FORMS, TOKENS, launch_forms
from bench.planner_overhead import PLANNERS, ROWS, E, H, K, L, build, node_cost, overhead
from bench.traces import Trace, belady_hit_rate, policy_hit_rate, synthetic_trace
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.policies import AgingFreqPolicy, FreqDecayPolicy, LRUPolicy, Policy
from pooled_runner.policy_adaptive import AdaptivePolicy
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy

# Synthetic trace families: (skew range, reuse, drift_every). Skew-dominated first, then recency-dominated.
TRACES = {
    "skew A (Zipf 0.8-1.4, reuse 0.3)": dict(skew=(0.8, 1.4), reuse=0.3),
    "skew B (Zipf 0.6-1.2, reuse 0.1)": dict(skew=(0.6, 1.2), reuse=0.1),
    "skew C (Zipf 1.0-1.6, reuse 0)": dict(skew=(1.0, 1.6), reuse=0.0),
    "recency A (Zipf 0.2-0.6, reuse 0.7, drift 32)": dict(skew=(0.2, 0.6), reuse=0.7, drift_every=32),
    "recency B (Zipf 0-0.3, reuse 0.8, drift 16)": dict(skew=(0.0, 0.3), reuse=0.8, drift_every=16),
    "mixed (Zipf 0.6-1.2, reuse 0.5, drift 64)": dict(skew=(0.6, 1.2), reuse=0.5, drift_every=64),
}


# --------------------------------------------------------------------------------------------------
# CPU: policy quality
def quality(args: argparse.Namespace) -> None:
    steps, warmup = (120, 30) if args.quick else (300, 80)
    lines = [
        f"date {datetime.date.today()}, CPU simulation (the shipped DevicePlanner on CPU tensors), "
        f"commit {args.commit or commit_id()}; {steps} decode steps of {args.tokens} token(s), "
        f"first {warmup} not counted; seed base {args.seed_base}"
        + (f"; router score noise scaled by U{args.noise_scale}" if args.noise_scale else ""),
        "",
        "| trace | rows | Belady | LRU | lru-cycle | freq | aging | adaptive | router | LRU / Belady | "
        "lru-cycle / Belady | freq / Belady | aging / Belady | adaptive / Belady | router / Belady | "
        "lru-cycle miss / LRU miss | freq miss / LRU miss | aging miss / LRU miss | adaptive miss / LRU miss | "
        "router miss / LRU miss | Belady miss / LRU miss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    write(args.out, lines)
    for i, (name, spec) in enumerate(TRACES.items()):
        if args.families and not any(name.startswith(f) for f in args.families):
            continue
        trace = synthetic_trace(
            steps,
            tokens_per_step=args.tokens,
            seed=args.seed_base + i,
            with_scores=True,
            noise_scale=args.noise_scale,
            **spec,  # type: ignore[arg-type]
        )
        total = sum(trace.num_experts_per_layer)
        for frac in (0.25, 0.5):
            rows = int(frac * total)
            best = belady_hit_rate(trace, rows, warmup)
            lru = policy_hit_rate(trace, rows, LRUPolicy(), warmup)
            cyc = policy_hit_rate(trace, rows, CycleLRUPolicy(), warmup)
            freq = policy_hit_rate(trace, rows, FreqDecayPolicy(), warmup)
            aging = policy_hit_rate(trace, rows, AgingFreqPolicy(), warmup)
            ada = policy_hit_rate(trace, rows, AdaptivePolicy(rows), warmup)
            router = policy_hit_rate(trace, rows, RouterAdaptivePolicy(rows), warmup)

            def miss_ratio(rate: float, lru: float = lru, digits: int = 2) -> str:
                return f"{(1 - rate) / (1 - lru):.{digits}f}" if lru < 1 else "n/a"

            lines.append(
                f"| {name} | {frac:.0%} | {best:.3f} | {lru:.3f} | {cyc:.3f} | {freq:.3f} | {aging:.3f} | "
                f"{ada:.3f} | {router:.3f} | {lru / best:.2f} | {cyc / best:.2f} | {freq / best:.2f} | "
                f"{aging / best:.2f} | {ada / best:.2f} | {router / best:.2f} | {miss_ratio(cyc)} | "
                f"{miss_ratio(freq)} | {miss_ratio(aging)} | {miss_ratio(ada, digits=3)} | "
                f"{miss_ratio(router, digits=3)} | {miss_ratio(best)} |"
            )
            write(args.out, lines)
    lines += [
        "",
        "lru-cycle = cycle-protected LRU (the default; a row used by another layer within the last decode cycle "
        "is not evicted); freq = `FreqDecayPolicy()` defaults (counters of uncorrelated routings halved every 128 steps, +32 for "
        "experts routed in the last step, value admission); aging = `AgingFreqPolicy()` defaults (LFU with "
        "dynamic aging: key = inflation + count, inflation = largest evicted key); adaptive = "
        "`AdaptivePolicy(rows)` defaults (LRU or chain-start frequency, whichever an idealized shadow cache of "
        "the pool's size misses less on; see policy_adaptive.py); router = `RouterAdaptivePolicy(rows)` "
        "defaults (the adaptive policy, each layer's experts ordered by router-score membership; fed the trace's "
        "scores: Zipf log-probability + Gumbel noise, the noise scaled per expert with --noise-scale; "
        "policy_router.py). Belady = offline MIN with bypass per tick.",
    ]
    write(args.out, lines)


def trace_replay(lines: list[str], args: argparse.Namespace) -> None:
    from bench.common import measure_bandwidths

    bw = measure_bandwidths()
    steps, warm = (60, 20) if args.quick else (200, 50)
    trace: Trace = synthetic_trace(
        steps, num_layers=L, num_experts=E, top_k=K, skew=(0.8, 1.4), reuse=0.3, seed=7, with_scores=True
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
    default_label = PLANNERS["one"][0].removesuffix(" (the default)")
    policies: list[tuple[str, Policy, dict[str, object]]] = [
        (
            f"lru-cycle ({default_label}, P={p}{'; the default' if i == 0 else ''})",
            CycleLRUPolicy(),
            {**PLANNERS["one"][1], "copy_programs": p},
        )
        for i, p in enumerate(args.copy_programs)
    ]
    policies += [
        ("lru-cycle (" + PLANNERS["one-coop"][0] + ")", CycleLRUPolicy(), PLANNERS["one-coop"][1]),
        ("lru-cycle (fused, two launches)", CycleLRUPolicy(), {"fused": True, "one_launch": False}),
        ("lru (" + PLANNERS["one"][0] + ")", LRUPolicy(), PLANNERS["one"][1]),
        ("lru (torch ops)", LRUPolicy(), {"fused": False}),
        ("adaptive (" + PLANNERS["fused-adaptive"][0] + ")", AdaptivePolicy(ROWS), {"fused": True}),
        # fed the trace's router scores (`_replay`)
        ("adaptive-router (fused, one launch)", RouterAdaptivePolicy(ROWS), {"fused": True}),
        ("adaptive-router-duel (fused, one launch)", MemoryDuelPolicy(ROWS), {"fused": True}),
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
    """Replay `trace` through one captured decode step: (hits, misses, ms per step, row bytes) after `warm`.
    A router-ordered policy is also fed the trace's scores (copied beside the ids every step)."""
    moe, planner, _, kpath = build(policy, **planner_kwargs)
    steps = trace.num_steps
    ids_host = trace.ids.to(torch.int64).pin_memory()  # [S, L, 1, K]
    ids = torch.zeros(L, 1, K, dtype=torch.int64, device="cuda")
    x = torch.randn(1, H, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda").bfloat16()
    w = torch.full((L, 1, K), 1.0 / K, device="cuda").bfloat16()
    with_scores = isinstance(policy, RouterAdaptivePolicy)
    if with_scores and trace.scores is None:
        raise ValueError(f"{policy.name} reads router scores: build the trace with_scores=True")
    scores_host = trace.scores.pin_memory() if with_scores else None  # type: ignore[union-attr]  # [S, L, 1, E]
    scores = torch.zeros(L, 1, E, device="cuda")

    def step() -> None:
        for layer in range(L):
            layer_scores = scores[layer] if with_scores else None
            kpath.planned_forward(planner, layer, x, ids[layer], w[layer], router_scores=layer_scores)

    def load(s: int) -> None:
        ids.copy_(ids_host[s], non_blocking=True)
        if scores_host is not None:
            scores.copy_(scores_host[s], non_blocking=True)

    load(0)
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
        load(s)
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
    ap.add_argument("--seed-base", type=int, default=100, help="--quality: trace seeds base + family index")
    ap.add_argument(
        "--families",
        default="",
        help="--quality: only the trace families whose names start with one of these (comma list, e.g. "
        "'skew A,recency')",
    )
    ap.add_argument(
        "--noise-scale",
        default="",
        help="--quality: lo,hi: each expert's router noise scaled by U[lo, hi] (its mean score no longer orders "
        "it by popularity)",
    )
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
        "--forms",
        default="",
        help="only the launch-form table, for this comma list of --planners names (one-launch forms; ratios are "
        f"to the first), e.g. {','.join(FORMS)}",
    )
    ap.add_argument(
        "--form-tokens",
        default=",".join(map(str, TOKENS)),
        help="tokens per step of the launch-form table (comma list)",
    )
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
    args.forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if any(f not in PLANNERS or not PLANNERS[f][1].get("one_launch") for f in args.forms):
        raise SystemExit(f"--forms {args.forms}: expected one-launch names of {', '.join(PLANNERS)}")
    args.form_tokens = [int(t) for t in args.form_tokens.split(",")]
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    if args.families and not any(n.startswith(f) for n in TRACES for f in args.families):
        raise SystemExit(
            f"--families {args.families}: no trace family starts with those ({', '.join(TRACES)})"
        )
    scale = [float(x) for x in args.noise_scale.split(",")] if args.noise_scale else None
    if scale is not None and (len(scale) != 2 or not 0 < scale[0] <= scale[1]):
        raise SystemExit(f"--noise-scale {args.noise_scale!r}: expected lo,hi with 0 < lo <= hi")
    args.noise_scale = tuple(scale) if scale else None
    if not args.form_tokens or min(args.form_tokens) < 1:
        raise SystemExit(f"--form-tokens {args.form_tokens}: expected a comma list of token counts >= 1")
    if args.quality:
        quality(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("the GPU benchmark needs CUDA; use --quality for the CPU policy simulation")
    import triton

    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, commit {args.commit or commit_id()}",
    ]
    write(args.out, lines)
    if args.forms:
        launch_forms(lines, args)
        return
    overhead(lines, args)
    torch.cuda.empty_cache()
    if args.node_cost:
        node_cost(lines, args)
    if not args.no_trace:
        trace_replay(lines, args)


if __name__ == "__main__":
    main()
