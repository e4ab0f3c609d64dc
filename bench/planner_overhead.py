"""GPU rows of `bench/planner.py`: the Qwen3-like pooled stack those rows build, the planner launch variants
(`--planners`), the planner and telemetry overhead per decode step, and what an empty launch of its own costs
(`--node-cost`). Run through `bench/planner.py`."""

from __future__ import annotations

import argparse

import torch

from bench.common import time_graphs
from bench.common import write_progress as write
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import Policy, policy_for_pool
from pooled_runner.telemetry import RouteTelemetry

H, I, E, K, L = 2048, 768, 128, 8, 6
ROWS = 384
RESIDENT_PER_LAYER = ROWS // L


def _one_launch(
    cooperative: bool, pdl: bool, overlap: bool, note: str = "", **more: object
) -> tuple[str, dict[str, object]]:
    """A one-launch planner row with every launch choice explicit (the environment's defaults do not leak in)."""
    label = ", ".join(
        [
            "fused, one launch",
            "cooperative" if cooperative else "plain grid",
            "PDL" if pdl else "no PDL",
            "overlap" if overlap else "no overlap",
        ]
    )
    kwargs = {"fused": True, "one_launch": True, "cooperative": cooperative, "pdl": pdl, "overlap": overlap}
    return label + note, {**kwargs, **more}


# --planners: name -> (label, DevicePlanner keywords)
PLANNERS: dict[str, tuple[str, dict[str, object]]] = {
    "one": _one_launch(False, True, True, " (the default)"),
    "one-coop": _one_launch(True, False, False, " (the default before 2026-12-02)"),
    "one-overlap": _one_launch(True, False, True),
    "one-overlap-coop-pdl": _one_launch(True, True, True),
    "one-coop-pdl": _one_launch(True, True, False),
    "one-nc": _one_launch(False, False, False),
    "one-pdl": _one_launch(False, True, False),
    "one-w1": _one_launch(False, True, True, ", 1 warp", plan_warps=1),
    "two": ("fused, two launches", {"fused": True, "one_launch": False}),
    "ops": ("torch ops", {"fused": False}),
    # the policies the torch-ops planner exists for (--moe-expert-pool-planner-policy), fed random router logits
    "ops-adaptive": ("torch ops, adaptive", {"fused": False, "policy": "adaptive"}),
    "ops-router": ("torch ops, adaptive-router", {"fused": False, "policy": "adaptive-router"}),
    "ops-duel": ("torch ops, adaptive-router-duel", {"fused": False, "policy": "adaptive-router-duel"}),
    # the adaptive policies' fused plan: one launch with the copy, PDL and overlap (the planner's CUDA defaults)
    "fused-adaptive": ("fused, one launch, adaptive", {"fused": True, "policy": "adaptive"}),
    "fused-router": ("fused, one launch, adaptive-router", {"fused": True, "policy": "adaptive-router"}),
    "fused-router-w8": (
        "fused, one launch, adaptive-router, 8 plan warps",
        {"fused": True, "policy": "adaptive-router", "plan_warps": 8},
    ),
    "fused-duel-w4": (  # the duel's plan at the other policies' warps (its default: MemoryDuelPolicy.plan_warps)
        "fused, one launch, adaptive-router-duel, 4 plan warps",
        {"fused": True, "policy": "adaptive-router-duel", "plan_warps": 4},
    ),
    "fused-duel": (
        "fused, one launch, adaptive-router-duel",
        {"fused": True, "policy": "adaptive-router-duel"},
    ),
    "two-adaptive": (
        "fused plan + row gather, adaptive",
        {"fused": True, "one_launch": False, "policy": "adaptive"},
    ),
    "two-router": (
        "fused plan + row gather, adaptive-router",
        {"fused": True, "one_launch": False, "policy": "adaptive-router"},
    ),
}


def build(policy: Policy, max_routed: int = 8 * K, **planner_kwargs: object):  # type: ignore[no-untyped-def]
    """Pooled stack, DevicePlanner(max_routed=..., **planner_kwargs), telemetry and kernel path of the GPU rows."""
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
    planner = DevicePlanner(moe.pool, policy, max_routed=max_routed, debug_checks=False, **planner_kwargs)  # type: ignore[arg-type]
    tel = RouteTelemetry([E] * L, moe.pool.device, fused=planner.fused)
    return moe, planner, tel, KernelPath(moe.format, moe.pool, moe.bank, H, I)


def overhead(lines: list[str], args: argparse.Namespace) -> None:
    lines += [
        "",
        "### Overhead per decode step (6 layers, routing that only hits; graph replay)",
        "",
        "| planner | M | MoE µs | planner µs | planner+MoE µs | planner / MoE | telemetry µs | "
        "tel+planner+MoE µs | telemetry / MoE layer | planner+MoE, path chosen as if no plan beside µs | "
        "planner+MoE / that |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
        "(POOLED_RUNNER_TORCH_PLANNER=1). 'as if no plan beside': the MoE's decode path picked without "
        "`long_plan` and aligned after the plan (as before 2026-12-04: inline up to 8 pairs, the align kernel "
        "behind the plan above), in the same process, for an A/B of `KernelPath.planned_forward`'s choice.",
    ]
    write(args.out, lines)


def _overhead_rows(lines: list[str], args: argparse.Namespace, name: str) -> None:
    label, kwargs = PLANNERS[name]
    kwargs = dict(kwargs)
    policy_name = str(kwargs.pop("policy", "lru-cycle"))
    _moe, planner, tel, kpath = build(policy_for_pool(policy_name, ROWS), **kwargs)
    g = torch.Generator(device="cuda").manual_seed(1)
    for M in (1, 4, 8):
        scores = None
        if policy_name.startswith("adaptive-router"):
            scores = torch.randn(L, M, E, generator=g, device="cuda").bfloat16()  # [L, M, E] router logits
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids = torch.stack(
            [
                torch.stack(
                    [torch.randperm(RESIDENT_PER_LAYER, generator=g, device="cuda")[:K] for _ in range(M)]
                )
                for _ in range(L)
            ]
        )  # [L, M, K] resident experts only
        w = torch.softmax(torch.randn(L, M, K, generator=g, device="cuda"), -1).bfloat16()

        def moe_only(x=x, ids=ids, w=w) -> None:
            for layer in range(L):
                kpath.forward(layer, x, ids[layer], w[layer])

        def plan_only(ids=ids, scores=scores) -> None:
            for layer in range(L):
                planner.plan(layer, ids[layer], router_scores=None if scores is None else scores[layer])

        def tel_only(ids=ids) -> None:
            for layer in range(L):
                tel.record(layer, ids[layer])

        def planned(x=x, ids=ids, w=w, scores=scores, telemetry: bool = False) -> None:
            for layer in range(L):  # as PooledMoE on CUDA: the planner records telemetry (fused: in-kernel)
                layer_scores = None if scores is None else scores[layer]
                tel_here = tel if telemetry else None
                kpath.planned_forward(planner, layer, x, ids[layer], w[layer], tel_here, layer_scores)

        def behind(x=x, ids=ids, w=w, scores=scores) -> None:
            for layer in range(L):  # the MoE's path chosen as if no plan ran beside it (before 2026-12-04)
                layer_scores = None if scores is None else scores[layer]
                after_plan = planner.plan(layer, ids[layer], router_scores=layer_scores)
                kpath.forward(layer, x, ids[layer], w[layer], after_plan=after_plan)

        t = time_graphs(
            {
                "moe": moe_only,
                "plan": plan_only,
                "tel": tel_only,
                "both": planned,
                "all": lambda: planned(telemetry=True),
                "behind": behind,
            }
        )
        t_moe, t_plan, t_tel, t_both, t_all = (t[k] for k in ("moe", "plan", "tel", "both", "all"))
        lines.append(
            f"| {label} | {M} | {1e3 * t_moe:.1f} | {1e3 * t_plan:.1f} | {1e3 * t_both:.1f} | "
            f"{(t_both - t_moe) / t_moe:.1%} | {1e3 * t_tel:.1f} | {1e3 * t_all:.1f} | "
            f"{(t_all - t_both) / t_moe:.1%} | {1e3 * t['behind']:.1f} | {t_both / t['behind']:.3f} |"
        )
        write(args.out, lines)
    counters = planner.counter_values()
    assert counters["misses"] == 0, f"overhead routing missed: {counters}"


def node_cost(lines: list[str], args: argparse.Namespace) -> None:
    """MoE alone against MoE + one empty kernel per layer where the plan goes: what a launch of its own costs.
    Every token of a step routes the same 8 resident experts (M=1: the inline GEMMs, where the trigger column
    runs them in OVERLAP; M=4: 32 pairs, the align path, which ignores it)."""
    from bench.empty_kernel import launch_empty

    kpath = build(CycleLRUPolicy(), fused=True, one_launch=True)[3]
    lines += [
        "",
        "### What a launch of its own costs (6 layers, graph replay, an empty one-program kernel per layer)",
        "",
        "| M | MoE µs | + empty kernel µs | + empty PDL kernel µs | + empty PDL kernel, trigger, OVERLAP GEMMs (M=1) µs | "
        "per layer (plain) | per layer (PDL) | per layer (trigger, OVERLAP) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator(device="cuda").manual_seed(2)
    for M in (1, 4):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids = torch.stack(
            [
                torch.randperm(RESIDENT_PER_LAYER, generator=g, device="cuda")[:K].repeat(M, 1)
                for _ in range(L)
            ]
        )
        w = torch.softmax(torch.randn(L, M, K, generator=g, device="cuda"), -1).bfloat16()

        def step(empty: str, x=x, ids=ids, w=w) -> None:
            for layer in range(L):
                if empty != "none":
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
