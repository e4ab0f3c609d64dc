"""The two-memory router policy (`pooled_runner/policy_duel.py`, `adaptive-router-duel`): against
`RouterAdaptivePolicy` step by step where its two memories are equal, against its host twin step by step (torch
ops and the fused plan under the interpreter), and on short drifting and skewed traces; its registration and bad
parameters."""

from __future__ import annotations

import pytest
import torch

from bench.traces import policy_hit_rate, synthetic_trace
from pooled_runner.config import PoolConfig
from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import LRUPolicy, policy_for_pool
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy
from tests.test_planner import assert_rows_hold_owners, assert_same_state, make_pool, plan_both


def test_equal_memories_decide_as_the_router_policy():
    """slow == fast: both orders are the same, nothing disagrees, the fast order is never chosen, and the
    tables and state equal `RouterAdaptivePolicy`'s after every step (fresh random scores, three layers, both
    modes reached)."""
    layers, rows = [9, 6, 11], 7
    pools = [make_pool(layers, rows, seed=5) for _ in range(2)]
    duel = MemoryDuelPolicy(rows, slow=3, fast=3, floor_misses=0, decay_shift=3)
    router = RouterAdaptivePolicy(rows, member_decay_shift=3, floor_misses=0, decay_shift=3)
    planners = [DevicePlanner(pool, p, max_routed=8) for pool, p in zip(pools, (duel, router))]
    g = torch.Generator().manual_seed(41)
    modes = set()
    for step in range(120):
        layer = step % 3
        E = layers[layer]
        T = int(torch.randint(1, 5, (1,), generator=g))
        scores = torch.randn(T, E, generator=g) * 2 + torch.linspace(2, -2, E)  # a skew the router sees
        ids = torch.topk(scores, 2, dim=1).indices
        for planner in planners:
            planner.plan(layer, ids, router_scores=scores)
        assert torch.equal(pools[0].l2p_gpu, pools[1].l2p_gpu), step
        modes.add(int(router.mode))
    assert modes == {0, 1}
    assert duel.fast_share == 0 and duel.order_misses is not None and int(duel.order_misses.sum()) == 0
    a, b = duel.state_tensors(), router.state_tensors()
    pairs = {
        "member_slow": "member",
        "member_fast": "member",
        "ranked_slow": "ranked",
        "ranked_fast": "ranked",
    }
    pairs.update({k: k for k in ("count", "last_use", "misses", "mode")})
    for mine, theirs in pairs.items():
        assert torch.equal(a[mine], b[theirs]), (mine, a[mine], b[theirs])


@pytest.mark.slow
def test_the_duel_follows_a_drift_and_keeps_the_skew_gain():
    """A drifting trace (the quality bench's mixed family, 8 layers of 64 experts) at 25% rows: the duel misses
    fewer than the slow-memory router policy and than LRU. A skewed one at 50% rows: no more than the
    slow-memory policy."""
    drift = synthetic_trace(
        240, 8, 64, 8, skew=(0.6, 1.2), reuse=0.5, drift_every=64, seed=3, with_scores=True
    )
    skew = synthetic_trace(240, 8, 64, 8, skew=(0.8, 1.4), reuse=0.3, seed=4, with_scores=True)
    for trace, frac in ((drift, 0.25), (skew, 0.5)):
        rows = int(frac * 8 * 64)
        lru = policy_hit_rate(trace, rows, LRUPolicy(), 60)
        router = policy_hit_rate(trace, rows, RouterAdaptivePolicy(rows), 60)
        duel = policy_hit_rate(trace, rows, MemoryDuelPolicy(rows), 60)
        print(f"rows {rows}: LRU {lru:.4f} router {router:.4f} duel {duel:.4f}")
        if trace is drift:
            assert duel > router and duel > lru, (lru, router, duel)
        else:
            assert duel >= router - 1e-9, (lru, router, duel)


def test_bad_parameters():
    for kw in (dict(fast=0), dict(slow=31), dict(order_floor=-1)):
        with pytest.raises(ValueError, match="slow="):
            MemoryDuelPolicy(4, **kw)
    policy = MemoryDuelPolicy(3)
    with pytest.raises(RuntimeError, match="before bind"):
        policy.observe_scores_fused(0, torch.zeros(1, 5), torch.zeros(1, 2, dtype=torch.int64), 5)
    assert DevicePlanner(make_pool([5, 4], 3), policy, max_routed=4, fused=True).fused

    class Custom(MemoryDuelPolicy):
        name = "custom-duel"

    with pytest.raises(ValueError, match="fused planner implements"):  # a subclass may change the rule
        DevicePlanner(make_pool([5, 4], 3), Custom(3), max_routed=4, fused=True)
    with pytest.raises(ValueError, match="planner_policy"):
        PoolConfig.resolve(pool_rows=4, planner_policy="adaptive-router-dual")
    assert PoolConfig.resolve(pool_rows=4, planner_policy="adaptive-router-duel").planner_policy == (
        "adaptive-router-duel"
    )
    assert isinstance(policy_for_pool("adaptive-router-duel", 4), MemoryDuelPolicy)


@pytest.mark.parametrize("launch", ["ops", "one-overlap", "two"])
@pytest.mark.parametrize(("layers", "rows", "K", "seed"), [([9, 6, 11], 7, 2, 1), ([13, 5], 6, 3, 2)])
def test_device_planner_equals_twin(launch: str, layers: list[int], rows: int, K: int, seed: int) -> None:
    """The planner with the duel against the host twin, step by step (tables, every state tensor: both
    memberships and ranked orders, the order duel's counters), on routing whose popular experts move every 25
    steps (fresh random scores; some steps without): both orders get chosen, and both LRU / frequency modes.
    `launch`: the torch ops, the fused plan + copy in one launch with the overlap, or the fused plan and the row
    gather (the interpreter)."""
    pool = make_pool(layers, rows, seed=seed)
    pool.fill([(len(layers) - 1, 0), (0, layers[0] - 1)])
    kw = dict(slow=8, fast=2, order_floor=0, floor_misses=0, decay_shift=3, duel_shift=2)
    dev_policy, host_policy = MemoryDuelPolicy(rows, **kw), MemoryDuelPolicy(rows, **kw)
    fused = launch != "ops"
    planner = DevicePlanner(
        pool,
        dev_policy,
        max_routed=4 * K,
        debug_checks=True,
        fused=fused,
        one_launch=launch.startswith("one") if fused else None,
        overlap=launch == "one-overlap",
    )
    assert planner.fused is fused
    twin = HostTwin(pool, host_policy)
    assert_same_state(planner, twin, "start")
    g = torch.Generator().manual_seed(seed)
    modes, orders = set(), set()
    for step in range(240):
        layer = step % len(layers)
        E = layers[layer]
        T = int(torch.randint(0, 4, (1,), generator=g))
        hot = torch.roll(torch.linspace(3, -3, E), (step // 25) * 3)  # the popular experts move
        scores = torch.cat([torch.randn(T, E, generator=g) + hot, torch.randn(T, 1, generator=g)], 1)
        ids = torch.topk(scores[:, :E], min(K, E), dim=1).indices
        with_scores = step % 7 != 6
        plan_both(planner, twin, layer, ids, f"step {step}", scores if with_scores else None)
        modes.add(int(dev_policy.mode))
        orders.add(dev_policy.uses_fast)
    assert modes == {0, 1} and orders == {0, 1}, (modes, orders)
    assert_rows_hold_owners(pool, planner)
    planner.store_to_pool()
    pool.check_invariants()
