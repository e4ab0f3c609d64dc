"""AdaptivePolicy (LRU / frequency set dueling): device planner against its host twin, and quality on CPU."""

from __future__ import annotations

import pytest
import torch

from bench.traces import policy_hit_rate, synthetic_trace
from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import LRUPolicy, make_policy
from pooled_runner.policy_adaptive import AdaptivePolicy
from tests.test_planner import assert_rows_hold_owners, assert_same_state, make_pool, plan_both, random_ids


def skewed_ids(T: int, K: int, E: int, g: torch.Generator) -> torch.Tensor:
    """Random ids with a few popular experts (so the frequency mode is entered), padding and out-of-range ids."""
    ids = random_ids(T, K, E, g)
    hot = torch.rand(T, K, generator=g) < 0.5
    ids[hot] = torch.randint(0, min(2, E), (int(hot.sum()),), generator=g)
    return ids


@pytest.mark.parametrize(
    ("layers", "rows", "K", "max_T", "kw", "both_modes"),
    [
        ([5, 7, 3], 6, 2, 3, dict(floor_misses=0), True),
        ([5, 7, 3], 6, 2, 3, {}, None),  # the default floor: whichever modes these few steps reach
        ([1], 1, 1, 2, {}, False),
        ([9, 9], 17, 3, 4, dict(decay_shift=1, duel_shift=1, margin_shift=30, floor_misses=0), True),
        (
            [13, 4, 6, 11],
            9,
            3,
            5,
            dict(decay_shift=2, recent_bonus=1, duel_shift=2, margin_shift=1, floor_misses=1),
            True,
        ),
        ([8, 5, 7], 7, 3, 1, dict(recent_bonus=0, duel_shift=1, floor_misses=0), True),
    ],
)
def test_device_planner_equals_twin(layers, rows, K, max_T, kw, both_modes):
    pool = make_pool(layers, rows, seed=rows)
    pool.fill([(len(layers) - 1, 0), (0, layers[0] - 1)])
    dev_policy, host_policy = AdaptivePolicy(rows, **kw), AdaptivePolicy(rows, **kw)
    planner = DevicePlanner(pool, dev_policy, max_routed=max_T * K, debug_checks=True)
    twin = HostTwin(pool, host_policy)
    assert_same_state(planner, twin, "start")
    g = torch.Generator().manual_seed(sum(layers) + rows)
    modes = set()
    for step in range(150):
        layer = step % len(layers)
        T = int(torch.randint(0, max_T + 1, (1,), generator=g))
        make = skewed_ids if (step // 40) % 2 == 0 else random_ids  # phases: skewed, then uniform
        plan_both(planner, twin, layer, make(T, min(K, layers[layer]), layers[layer], g), f"step {step}")
        modes.add(int(dev_policy.mode))
    assert_rows_hold_owners(pool, planner)
    c = planner.counter_values()
    assert (c["hits"], c["misses"], c["admissions"]) == (twin.hits, twin.misses, twin.admissions)
    planner.store_to_pool()
    pool.check_invariants()
    if both_modes is not None:
        assert modes == ({0, 1} if both_modes else {0})  # LRU first (a tie), frequency once it misses less


def test_bad_parameters_and_pool_size():
    bad = (dict(num_rows=0), dict(num_rows=4, decay_shift=0), dict(num_rows=4, recent_bonus=-1))
    for kw in (*bad, dict(num_rows=4, floor_misses=-1)):
        with pytest.raises(ValueError):
            AdaptivePolicy(**kw)
    assert isinstance(make_policy("adaptive", num_rows=3), AdaptivePolicy)
    pool = make_pool([4, 4], 5)
    for build in (lambda p: DevicePlanner(pool, p, max_routed=4), lambda p: HostTwin(pool, p)):
        with pytest.raises(ValueError, match="num_rows=6; the pool has 5 rows"):
            build(AdaptivePolicy(num_rows=6))
    with pytest.raises(RuntimeError, match="bind"):
        AdaptivePolicy(3).observe(0, torch.zeros(2, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))


def test_quality_beats_lru_on_skew_and_matches_it_on_recency():
    """Short traces (8 layers of 64 experts, top-4, 25% rows): fewer misses than LRU where popularity is
    stationary, no more than LRU where it drifts and routings repeat."""
    kw = dict(num_layers=8, num_experts=64, top_k=4)
    rows = 8 * 64 // 4
    skew = synthetic_trace(160, skew=(1.0, 1.4), reuse=0.3, seed=3, **kw)
    lru, ada = (policy_hit_rate(skew, rows, p, 40) for p in (LRUPolicy(), AdaptivePolicy(rows)))
    assert (1 - ada) < 0.9 * (1 - lru), (lru, ada)
    recency = synthetic_trace(160, skew=(0.0, 0.3), reuse=0.8, drift_every=16, seed=4, **kw)
    lru, ada = (policy_hit_rate(recency, rows, p, 40) for p in (LRUPolicy(), AdaptivePolicy(rows)))
    assert ada >= lru, (lru, ada)


def test_ages_survive_the_clock_renumbering_of_a_boundary():
    """A host-planned step renumbers the planner's clock (`load_from_pool`); the policy's last-use ticks move
    with it, so every expert's age (clock - last use) and the never-routed marks are unchanged."""
    pool = make_pool([7, 5, 6], 6, seed=2)
    policy = AdaptivePolicy(6)
    planner = DevicePlanner(pool, policy, max_routed=6)
    g = torch.Generator().manual_seed(11)
    for step in range(40):
        layer = step % 3
        planner.plan(layer, skewed_ids(2, 3, pool.num_experts_per_layer[layer], g))
    assert policy.last_use is not None and policy.count is not None
    before_clock, before_last = int(planner.clock), policy.last_use.clone()
    counts = policy.count.clone()
    planner.store_to_pool()
    planner.load_from_pool()
    shift = int(planner.clock) - before_clock
    assert shift != 0  # 40 ticks of clock renumbered to the pool's <= 6 stamps
    never = before_last == -(1 << 40)
    assert bool(never.any()) and bool((~never).any())
    assert torch.equal(policy.last_use[never], before_last[never])
    assert torch.equal(policy.last_use[~never] - int(planner.clock), before_last[~never] - before_clock)
    assert torch.equal(policy.count, counts)


def test_duel_counts_only_the_misses_where_the_shadows_disagree():
    """Cold misses (both shadows miss) add nothing to the duel; the old rule summed them into both sides. Then
    a rule-by-rule check of one tick against a hand count of the two shadows over the host state."""
    pool = make_pool([6, 6], 4, seed=5)
    policy = AdaptivePolicy(4, margin_shift=2)
    planner = DevicePlanner(pool, policy, max_routed=6)
    planner.plan(0, torch.tensor([[0, 1, 2]]))
    planner.plan(1, torch.tensor([[3, 4, 5]]))
    assert policy.misses is not None and policy.misses.tolist() == [0, 0]  # six cold misses, shared
    twin_policy = AdaptivePolicy(4, margin_shift=2)
    twin = HostTwin(make_pool([6, 6], 4, seed=5), twin_policy)
    g = torch.Generator().manual_seed(9)
    for step in range(30):
        layer = step % 2
        ids = skewed_ids(2, 3, 6, g)
        state = twin_policy.host_state()
        present = sorted({int(e) for e in ids.reshape(-1).tolist() if 0 <= e < 6})
        lo, L, now = layer * 6, 2, twin.clock + 1
        last, count = state["last_use"], state["count"]
        value = [c + 32 * (1 << 16) * (now - 1 - t < L) for c, t in zip(count, last)]
        lru_only = freq_only = 0
        for e in present:
            t, v = last[lo + e], value[lo + e]
            lru_out = t < 0 or sum(x > t for x in last) >= 4
            freq_out = t < 0 or sum(w > v or (w == v and x > t) for w, x in zip(value, last)) >= 4
            lru_only += lru_out and not freq_out
            freq_only += freq_out and not lru_out
        before = list(state["misses"])
        if layer == 0:
            before = [m - (m >> 5) for m in before]
        twin.plan(layer, ids)
        assert twin_policy.host_state()["misses"] == [
            before[0] + 256 * lru_only,
            before[1] + 256 * freq_only,
        ], step


@pytest.mark.parametrize(
    ("lru_only", "freq_only"),
    [(11 * 256, 2 * 256), (900, 100), (40 * 256, 30 * 256), (2688, 512)],  # the last: a tie at floor 8 (LRU)
)
def test_frequency_mode_needs_the_floor_beyond_the_margin(lru_only: int, freq_only: int) -> None:
    """Mode = frequency iff freq + (freq >> margin_shift) + floor_misses * 256 < lru, in both forms, for floors
    around the lead (a tick that routes nothing adds no shadow miss and, off layer 0, decays nothing)."""
    for floor in (0, 1, 2, 8, 9):
        expected = int(freq_only + (freq_only >> 2) + floor * 256 < lru_only)
        policy = AdaptivePolicy(4, margin_shift=2, floor_misses=floor)
        policy.bind(2, 3, torch.device("cpu"))
        assert policy.misses is not None and policy.mode is not None
        policy.misses.copy_(torch.tensor([lru_only, freq_only]))
        policy.observe(1, torch.zeros(3, dtype=torch.bool), torch.tensor([5]))
        host = AdaptivePolicy(4, margin_shift=2, floor_misses=floor)
        host.host_reset(2, 3)
        host._h_misses = [lru_only, freq_only]
        host.host_observe(1, [], 5)
        assert (int(policy.mode), host.host_state()["mode"][0]) == (expected, expected), (
            floor,
            lru_only,
            freq_only,
        )
