"""Device planner checks at construction and at the edges (CPU): launch parameters and workspace bounds
refused before any step, the warps reaching the two-launch plan, policy names and parameters refused with the
fix, and the table check's messages (`test_planner.py` has the planner against its twin)."""

from __future__ import annotations

import pytest
import torch

from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import table_problems
from pooled_runner.policies import AgingFreqPolicy, FreqDecayPolicy, LRUPolicy, make_policy
from tests.test_planner import make_pool


@pytest.mark.parametrize("fused", [False, True])
def test_workspace_bound_fails_loudly_and_changes_nothing(fused):
    pool = make_pool([6], rows=3)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=4, fused=fused)
    before = planner.state()
    with pytest.raises(ValueError, match=r"routes 6 > max_routed=4"):
        planner.plan(0, torch.zeros(3, 2, dtype=torch.int64))
    after = planner.state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match=r"layer 1 out of range"):
        planner.plan(1, torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.parametrize(
    "kwargs", [{"copy_programs": 0}, {"gather_chunks": 0}, {"plan_warps": 3}, {"plan_warps": 64}]
)
def test_bad_launch_shapes_refused_at_construction(kwargs):
    """Launch parameters are checked when the planner is built, not at its first (maybe captured) step."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DevicePlanner(make_pool([6], rows=3), LRUPolicy(), **kwargs)


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_one_launch_warps_refused_at_construction(policy):
    """16 and 32 warps are valid for the single-program plans, not for the one-launch plan + copy: refused when
    the planner is built with the one launch, accepted without it."""
    pool = make_pool([6], rows=3)
    make = (lambda: LRUPolicy()) if policy == "lru" else (lambda: make_policy("adaptive", num_rows=3))
    with pytest.raises(ValueError, match="plan_warps=16: the one-launch"):
        DevicePlanner(pool, make(), fused=True, one_launch=True, plan_warps=16)
    assert not DevicePlanner(pool, make(), fused=True, one_launch=False, plan_warps=16).one_launch


@pytest.mark.parametrize(("policy", "plan_warps", "want"), [("lru", None, 4), ("lru", 16, 16),
                                                          ("adaptive-router-duel", None, 8), ("adaptive", 2, 2)])  # fmt: skip
def test_the_two_launch_plan_runs_the_planner_warps(policy, plan_warps, want, monkeypatch):
    """`plan_warps` (None: 8 for the duel, else 4) reaches the single-program plan of the two-launch form too."""
    import pooled_runner.planner_fused as planner_fused

    name = "plan_lru" if policy == "lru" else "plan_adaptive"
    real, seen = getattr(planner_fused, name), []

    def spy(*args, num_warps=4):
        seen.append(num_warps)
        real(*args, num_warps=num_warps)

    monkeypatch.setattr(planner_fused, name, spy)
    pool = make_pool([6, 5], rows=3)
    chosen = LRUPolicy() if policy == "lru" else make_policy(policy, num_rows=3)
    planner = DevicePlanner(pool, chosen, max_routed=4, fused=True, one_launch=False, plan_warps=plan_warps)
    planner.plan(1, torch.tensor([[4, 2]]))
    assert seen == [want], seen
    counters = planner.counter_values()
    assert counters["misses"] + counters["hits"] == 2, counters  # the real plan ran


def test_make_policy_names_what_is_missing():
    """Every registered name builds its policy; unknown names and an adaptive policy without its pool size are
    refused with a message naming the fix."""
    from pooled_runner.config import PLANNER_POLICIES
    from pooled_runner.policies import POLICIES, policy_for_pool

    assert sorted(PLANNER_POLICIES) == sorted(POLICIES)  # every policy is a PoolConfig choice
    for name in POLICIES:
        kwargs = {"num_rows": 5} if name.startswith("adaptive") else {}
        assert type(make_policy(name, **kwargs)) is POLICIES[name]
        policy = policy_for_pool(name, 5)
        assert type(policy) is POLICIES[name] and getattr(policy, "num_rows", 5) == 5
    with pytest.raises(ValueError, match="not one of"):
        make_policy("mru")
    for name in ("adaptive", "adaptive-router"):
        with pytest.raises(ValueError, match="num_rows="):
            make_policy(name)


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (AgingFreqPolicy, {"decay_steps": 0}, "decay_steps=0 must be >= 1"),
        (AgingFreqPolicy, {"correlated_steps": -1}, "correlated_steps=-1"),
        (AgingFreqPolicy, {"recent_bonus": -2}, "recent_bonus=-2"),
        (FreqDecayPolicy, {"decay_steps": 0}, "decay_steps=0, cap="),
    ],
)
def test_frequency_policies_refuse_bad_parameters(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_table_check_names_a_negative_code():
    """A negative location code of a real expert is reported, not read as a row from the end of the list."""
    l2p = torch.tensor(
        [[0, -1, 4, -1], [-9, 1, 4, 5]]
    )  # R = 2 (host codes R + e), E = (3, 4): layer 0's expert 3 is padding
    owner, stamp = [0, 5], [3, 4]  # row 0: (0, 0), row 1: (1, 1)
    problems = table_problems(l2p, owner, stamp, [3, 4], 2)
    assert problems == ["layer 0 expert 1 has code -1", "layer 1 expert 0 has code -9"], problems
