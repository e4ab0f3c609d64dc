"""Coarse-boundary residency plans: built from telemetry, applied all or nothing (fault injected midway)."""

from __future__ import annotations

import pytest
import torch

from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import FreqDecayPolicy
from pooled_runner.residency_plan import PlanApplyError, ResidencyPlan, apply_plan, plan_from_snapshot
from pooled_runner.telemetry import RouteTelemetry
from tests.test_planner import assert_rows_hold_owners, make_pool


def full_state(pool, planner):
    return {
        "rows": {k: v.clone() for k, v in pool.rows_gpu.items()},
        "l2p_host": pool.l2p_host.clone(),
        "l2p_gpu": pool.l2p_gpu.clone(),
        "owner": list(pool.row_owner),
        "lru": pool.lru_rows(),
        "planner": planner.state(),
    }


def assert_same(a, b):
    for name in a["rows"]:
        # bitwise: free rows hold uninitialized memory, possibly NaN patterns
        assert torch.equal(a["rows"][name].view(torch.int32), b["rows"][name].view(torch.int32)), (
            f"rows of {name} changed"
        )
    assert torch.equal(a["l2p_host"], b["l2p_host"]) and torch.equal(a["l2p_gpu"], b["l2p_gpu"])
    assert a["owner"] == b["owner"] and a["lru"] == b["lru"]
    for k in a["planner"]:
        assert torch.equal(a["planner"][k], b["planner"][k]), f"planner {k} changed"


def window(layers):
    tel = RouteTelemetry(layers, torch.device("cpu"))
    tel.record(0, torch.tensor([[3, 1], [3, 4], [3, 1]]))
    tel.record(1, torch.tensor([[2, 0], [2, 5]]))
    return tel


def test_plan_from_snapshot_takes_the_hottest_and_refuses_bad_windows():
    tel = window([6, 7])
    plan = plan_from_snapshot(tel.snapshot(), max_pinned=3)
    assert plan == ResidencyPlan(0, ((0, 3), (0, 1), (1, 2)))
    assert plan_from_snapshot(tel.snapshot(), max_pinned=50).pinned[-1] == (1, 5)  # count > 0 only: 6 pairs
    assert len(plan_from_snapshot(tel.snapshot(), max_pinned=50).pinned) == 6
    tel.record(1, torch.tensor([[7]]))  # out of range: poison
    assert plan_from_snapshot(tel.snapshot(), max_pinned=3) is None
    with pytest.raises(ValueError, match="max_pinned=-1"):  # a bad argument, whatever the window
        plan_from_snapshot(tel.snapshot(), max_pinned=-1)


def test_apply_plan_into_free_rows_counts_admissions_only():
    pool = make_pool([6, 7], rows=5, seed=2)
    pool.fill([(0, 0), (1, 1)])  # rows 2..4 free
    before = pool.stats()
    copied = apply_plan(pool, ResidencyPlan(3, ((1, 4), (0, 5), (1, 1))), None)
    assert copied == 2  # (1, 1) was resident
    after = pool.stats()
    assert (after.admissions - before.admissions, after.evictions - before.evictions) == (2, 0)
    assert after.bytes_copied_to_rows - before.bytes_copied_to_rows == 2 * pool.row_bytes
    pool.check_invariants()


def test_apply_plan_pins_experts_as_most_recent():
    pool = make_pool([6, 7], rows=4)
    pool.fill()  # layer 0 experts 0..3
    planner = DevicePlanner(pool, FreqDecayPolicy(), max_routed=4)
    plan = plan_from_snapshot(window([6, 7]).snapshot(), max_pinned=3)
    before = pool.stats()
    copied = apply_plan(pool, plan, planner)
    assert copied == 1  # (0, 3) and (0, 1) were resident; (1, 2) takes the LRU row not pinned: row 0
    after = pool.stats()  # one copy into a row that (0, 0) gave up: an admission and an eviction
    assert (after.admissions - before.admissions, after.evictions - before.evictions) == (1, 1)
    assert after.bytes_copied_to_rows - before.bytes_copied_to_rows == pool.row_bytes
    assert pool.row_owner == [(1, 2), (0, 1), (0, 2), (0, 3)]
    assert pool.lru_rows() == [2, 0, 1, 3]  # unpinned first, then pinned coldest..hottest
    pool.check_invariants()
    assert_rows_hold_owners(pool, planner)
    assert planner.state()["row_owner"].tolist() == [1 * 7 + 2, 1, 2, 3]


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_fault_midway_restores_everything(fail_at):
    pool = make_pool([6, 7], rows=5, seed=4)
    pool.fill([(1, 6), (0, 0), (0, 5)])  # rows 3, 4 free
    planner = DevicePlanner(pool, FreqDecayPolicy(), max_routed=4)
    planner.plan(0, torch.tensor([[0, 2]]))  # some device state (stamps, counters) to protect
    planner.store_to_pool()
    before = full_state(pool, planner)
    plan = ResidencyPlan(7, ((1, 0), (0, 4), (1, 3), (0, 1)))
    calls = []

    def faulty_copy(i, row, weights):
        calls.append(row)
        pool.write_row(row, weights)  # the row really is overwritten before the fault
        if i == fail_at:
            raise OSError(f"injected fault in copy {i}")

    stats_before = pool.stats()
    with pytest.raises(PlanApplyError, match=rf"epoch 7 failed at copy {fail_at + 1}/4 .*restored"):
        apply_plan(pool, plan, planner, copy_row=faulty_copy)
    assert len(calls) == fail_at + 1
    assert pool.stats() == stats_before
    assert_same(before, full_state(pool, planner))
    pool.check_invariants()
    planner.check_invariants()


def test_bad_plans_change_nothing():
    pool = make_pool([3], rows=2)
    planner = DevicePlanner(pool, FreqDecayPolicy(), max_routed=2)
    before = full_state(pool, planner)
    with pytest.raises(ValueError, match="twice"):
        apply_plan(pool, ResidencyPlan(0, ((0, 1), (0, 1))), planner)
    with pytest.raises(ValueError, match="pins 3 experts but the pool has 2 rows"):
        apply_plan(pool, ResidencyPlan(0, ((0, 0), (0, 1), (0, 2))), planner)
    with pytest.raises(ValueError, match=r"expert 3 out of range"):
        apply_plan(pool, ResidencyPlan(0, ((0, 3),)), planner)
    assert_same(before, full_state(pool, planner))
