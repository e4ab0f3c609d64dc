"""GPU test of the one-launch plan + admission copy (`kernels/plan_copy.py`) under CUDA graphs.

Two identical pools (int4-like, six operands of mixed dtypes, rows longer than one copy block, a pinned bank,
20 rows for 54 experts), one planned by the one-launch path and one by the two-launch path (`plan_lru`, then
`gather_rows_multi` per four operands), for LRU, lru-cycle and the two adaptive policies (`plan_adaptive_copy`
against `plan_adaptive` and the gather). Each captures one decode step (4 layers: plan + telemetry) in a CUDA
graph, replays it 25 times with new routing (misses, evictions, padding and out-of-range ids); after every
replay the tables, counters, telemetry and every used pool row must be equal, and the sync words zero. Four
launch modes of the one-launch kernel, each pinned by the environment: cooperative (roles by program id) and a
plain grid (roles by ticket), both without PDL and overlap; and each as a programmatic dependent launch with
overlap (the early trigger and the deferred commit; the plain one is the default), skipped where PDL is not
available.

Programs of the one-launch kernel wait for its role 0: a scheduling bug would hang, not fail. So the check runs
in a subprocess under a timeout: a deadlock fails the test (and the hung process is killed with it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from pooled_runner.bank import ExpertBank
    from pooled_runner.cycle_lru import CycleLRUPolicy
    from pooled_runner.formats.base import OperandSpec
    from pooled_runner.planner import DevicePlanner
    from functools import partial
    from pooled_runner.policies import LRUPolicy
    from pooled_runner.policy_adaptive import AdaptivePolicy
    from pooled_runner.policy_router import RouterAdaptivePolicy
    from pooled_runner.pool import ExpertPool
    from pooled_runner.telemetry import RouteTelemetry

    DEVICE, REPLAYS = sys.argv[1], int(sys.argv[2])  # "cpu": the same checks, eager, under the interpreter
    GRAPHS = DEVICE == "cuda"
    LAYERS, ROWS, K = [16, 12, 16, 10], 20, 4
    OPS = tuple(
        OperandSpec(f"{p}_{part}", shape, dtype)
        for p, n, k in (("w13", 64, 80), ("w2", 40, 8))
        for part, shape, dtype in (
            ("q", (n, k), torch.int32), ("s", (n, 5), torch.bfloat16), ("z", (n, 5), torch.uint8)
        )
    )

    def build(policy, one_launch):
        g = torch.Generator().manual_seed(0)
        bank = ExpertBank(OPS, LAYERS, pin=GRAPHS)
        for t in bank.tensors_host.values():
            src = torch.randn(t.shape, generator=g) * 40
            t.copy_(src.to(t.dtype) if t.dtype.is_floating_point else src.to(torch.int32).to(t.dtype))
        pool = ExpertPool(OPS, LAYERS, ROWS, torch.device(DEVICE), bank)
        pool.fill()
        planner = DevicePlanner(
            pool, policy(), max_routed=8 * K, debug_checks=False, fused=True, one_launch=one_launch
        )
        assert planner.one_launch is one_launch
        return planner, RouteTelemetry(LAYERS, pool.device, fused=True)

    def compare(a, b, where):
        sa, sb = a[0].state(), b[0].state()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{where}: {key} {sa[key]} vs {sb[key]}"
        assert a[0].counter_values() == b[0].counter_values(), where
        used = (sa["row_owner"] >= 0).to(DEVICE)
        for name, t in a[0].pool.rows_gpu.items():
            assert torch.equal(t[used], b[0].pool.rows_gpu[name][used]), f"{where}: rows of {name}"
        assert torch.equal(a[1].counts, b[1].counts) and torch.equal(a[1].flags, b[1].flags), where
        assert a[0]._sync32.tolist() == [0] * a[0]._sync32.numel(), f"{where}: sync words {a[0]._sync32.tolist()}"

    g = torch.Generator().manual_seed(1)
    for M in (1, 8):
        # the adaptive policies' one launch (`plan_adaptive_copy`); the router here without scores (counts only)
        adaptive = (partial(AdaptivePolicy, ROWS, floor_misses=0), partial(RouterAdaptivePolicy, ROWS))
        for policy in (LRUPolicy, CycleLRUPolicy, *adaptive):
            runs = [build(policy, True), build(policy, False)]
            ids = torch.zeros(len(LAYERS), M, K, dtype=torch.int32, device=DEVICE)

            def set_ids():
                new = torch.stack([torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(M)]) for n in LAYERS])
                noise = torch.rand(new.shape, generator=g)
                new[noise < 0.05] = -1
                new[noise > 0.98] = 99
                ids.copy_(new)

            def step(planner, tel):
                for layer in range(len(LAYERS)):
                    planner.plan(layer, ids[layer], tel)

            set_ids()
            for planner, tel in runs:
                step(planner, tel)  # eager (and compile) before capture
            name = getattr(policy, "func", policy).__name__
            compare(*runs, f"M={M} {name} eager")
            replays = []
            for planner, tel in runs:
                if GRAPHS:  # capture records, it does not run: the replays below run in lockstep
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step(planner, tel)
                    replays.append(graph.replay)
                else:
                    replays.append(lambda planner=planner, tel=tel: step(planner, tel))
            for rep in range(REPLAYS):
                set_ids()
                for replay in replays:
                    replay()
                if GRAPHS:
                    torch.cuda.synchronize()
                compare(*runs, f"M={M} {name} replay {rep}")
            c = runs[0][0].counter_values()
            assert c["admissions"] > 0 and c["evictions"] > 0 and c["hits"] > 0, c
            print(f"M={M} {name}: {c}", flush=True)
    if GRAPHS:  # the launch inventory of one planned layer step (eager): 1 kernel, against 1 + ceil(6 / 4)
        from torch.profiler import ProfilerActivity, profile

        for policy, one_launch, want in (
            (LRUPolicy, True, 1), (LRUPolicy, False, 3), (adaptive[0], True, 1), (adaptive[0], False, 3)
        ):
            planner, tel = build(policy, one_launch)
            set_ids()
            planner.plan(0, ids[0], tel)  # compiled
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                planner.plan(1, ids[1], tel)
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"{planner.policy.name} one_launch={one_launch}: {names}", flush=True)
            assert len(names) == want, f"{planner.policy.name} one_launch={one_launch}: {len(names)} events {names}"
    print("plan copy graphs ok")
    """
)


@pytest.mark.parametrize(
    ("cooperative", "pdl"),
    [("1", "1"), ("1", "0"), ("0", "0"), ("0", "1")],
    ids=["pdl-cooperative-overlap", "cooperative", "plain", "pdl-overlap"],
)
def test_one_launch_plan_copy_replays_like_two_launches(cooperative: str, pdl: str) -> None:
    if pdl == "1":
        import torch
        from pooled_runner.kernels.pdl import pdl_available

        if not (torch.cuda.is_available() and pdl_available(torch.empty(1, device="cuda"))):
            pytest.skip("PDL is not available on this device / Triton: the mode would run as a plain launch")
    env = dict(
        os.environ,
        POOLED_RUNNER_PLAN_COOPERATIVE=cooperative,
        POOLED_RUNNER_PLAN_PDL=pdl,
        POOLED_RUNNER_PLAN_OVERLAP=pdl,  # overlap with PDL (its default), neither without
    )
    env.pop("POOLED_RUNNER_PLAN_SPLIT_COPY", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, "cuda", "25"], env=env, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as e:  # the child is killed by subprocess.run
        pytest.fail(f"one-launch plan + copy did not finish in 240 s (deadlock?): {e.stdout!r} {e.stderr!r}")
    assert proc.returncode == 0 and "plan copy graphs ok" in proc.stdout, proc.stdout + proc.stderr
