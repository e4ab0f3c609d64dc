"""bench/spec_pool_misses.py on the CPU at a small shape: the twin's miss counts against the pool's own host
LRU (`ExpertPool.plan_step`, a separate implementation), the schedule and the after-probe bookkeeping against
hand counts, and one cell end to end."""

from __future__ import annotations

import argparse

import pytest

from bench import spec_pool_misses as spm
from bench.decode_steps import Shape
from bench.spec_steps import request_lanes
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import make_policy

SHAPE = Shape(H=16, I=8, E=13, K=3, L=3)


@pytest.mark.parametrize(("rows", "bs"), [(7, 1), (19, 3), (30, 2)])
def test_twin_misses_match_the_pools_host_lru(rows: int, bs: int) -> None:
    depths = [0, 0, 1, 1, 0, 3, 0, 0, 1, 0, 3, 3, 0]
    lanes = request_lanes(SHAPE, bs, len(depths) * 4 + 1)
    twin_pool = spm.filled_pool(SHAPE, rows)
    twin = HostTwin(twin_pool, make_policy("lru"))
    got = spm.replay(twin.plan, lambda: twin.misses, lanes, depths, 0.6, seed=bs)

    pool = spm.filled_pool(SHAPE, rows)

    def plan(layer: int, topk_ids: list[list[int]]) -> None:
        pool.plan_step(layer, sorted({e for token in topk_ids for e in token}))

    want = spm.replay(plan, lambda: pool.stats().misses, lanes, depths, 0.6, seed=bs)
    assert got == want
    assert sum(want) > 0 and len(want) == len(depths)


def test_replay_refuses_a_trace_too_short() -> None:
    lanes = request_lanes(SHAPE, 2, 5)
    twin = HostTwin(spm.filled_pool(SHAPE, 9), make_policy("lru-cycle"))
    with pytest.raises(ValueError, match="too few"):
        spm.replay(twin.plan, lambda: twin.misses, lanes, [3, 3, 3], 0.6, seed=1)


def test_probe_schedule_and_steps_after_a_probe() -> None:
    depths = spm.probe_schedule(17, 2, 3, 2, 5)
    assert depths == [0, 0] + [3, 3, 0, 0, 0] * 3
    misses = list(range(17))
    # depth-0 steps after warm 2 and after a probe: index 4, 5, 6 (since 0, 1, 2), 9, 10, 11, 14, 15, 16
    assert spm.after_probe(depths, misses, 2) == {0: [4, 9, 14], 1: [5, 10, 15], 2: [6, 11, 16]}
    # MAX_AFTER (3) pools the later steps; depth-0 steps before the first probe are left out
    depths = [0, 0, 1, 0, 0, 0, 0, 0, 1, 0]
    assert spm.after_probe(depths, list(range(10)), 0) == {0: [3, 9], 1: [4], 2: [5], 3: [6, 7]}


def test_one_cell_end_to_end() -> None:
    args = argparse.Namespace(steps=60, warm=4, accept=0.6, probe_depth=3, probe_steps=3, interval=9)
    row = spm.cell(SHAPE, 0.5, 3, "lru-cycle", args)
    assert row[:2] == ["50%", 3] and len(row) == len(spm.COLUMNS)
    base, probe = row[2], row[3]
    assert 0 < base < probe <= SHAPE.L * SHAPE.E, (base, probe)  # depth 3 reads more distinct experts
    assert all(v > 0 for v in row[4:]), row
