"""The adaptive policies' fused plan (`kernels/plan_adaptive.py`, under the Triton interpreter on the CPU):
against its torch reference on random states at awkward sizes, and in the planner against the host twin."""

from __future__ import annotations

import pytest
import torch
from pooled_runner.kernels.plan_adaptive import NEVER, AdaptiveRule, AdaptiveState, plan_adaptive
from pooled_runner.kernels.plan_adaptive_ref import plan_adaptive_reference

from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import make_policy
from pooled_runner.policy_adaptive import ONE, SCORE, AdaptivePolicy
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy
from pooled_runner.telemetry import RouteTelemetry
from tests.test_planner import assert_rows_hold_owners, assert_same_state, make_pool, random_ids
from tests.test_policy_adaptive import skewed_ids


def _random_tables(L: int, EM: int, R: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A consistent pool: some rows free, the others each owned by a distinct expert, stamps below the clock."""
    flat = torch.randperm(L * EM, generator=g)[:R]
    free = torch.rand(R, generator=g) < 0.3
    owner = torch.where(free, -1, flat)
    stamp = torch.where(free, -1, torch.randint(1, 40, (R,), generator=g))
    l2p = R + torch.arange(L * EM) % EM
    for row, f in enumerate(owner.tolist()):
        if f >= 0:
            l2p[f] = row
    pad = torch.tensor([-1])
    return {
        "l2p": l2p.to(torch.int32),
        "row_owner": torch.cat([owner, pad]),
        "row_stamp": torch.cat([stamp, pad]),
        "clock": torch.tensor([45]),
        "counters": torch.randint(0, 100, (5,), generator=g),
    }


# the duel's starting order misses [slow only, fast only] x SCORE: on the edge (a few slow-only misses of the step
# flip it), clearly for the fast order, clearly for the slow one; the last choice is random, so a step may flip
DUEL_MISSES = {"duel": [60, 50], "duel-fast": [300, 10], "duel-slow": [10, 300]}


def _random_state(L: int, EM: int, router: bool | str, freq_mode: bool, g: torch.Generator) -> AdaptiveState:
    """router: False (adaptive), True (one membership order) or a key of DUEL_MISSES (two orders: slow, fast)."""
    n = L * EM
    count = torch.cat(
        [torch.randint(0, 6 * ONE, (n,), generator=g) // 7 * 7, torch.zeros(1, dtype=torch.int64)]
    )
    last = torch.where(torch.rand(n, generator=g) < 0.25, NEVER, torch.randint(20, 46, (n,), generator=g))
    misses = torch.tensor([900, 40]) if freq_mode else torch.tensor([40, 900])
    orders = 2 if router in DUEL_MISSES else int(bool(router))
    member = ranked = order_misses = order_state = None
    if orders:
        member = torch.randint(0, 4 * ONE, (orders * n,), generator=g) // 3 * 3
        curves = [count[:n].flip(0), count[:n].roll(3)][:orders]
        zero = torch.zeros(1, dtype=torch.int64)
        ranked = torch.cat([x for c in curves for x in (c, zero)])
    if orders == 2:
        order_misses = torch.tensor(DUEL_MISSES[str(router)]) * SCORE
        order_state = torch.tensor([int(torch.randint(0, 2, (1,), generator=g)), 7, 20])
    return AdaptiveState(count, last, misses * SCORE, torch.zeros(1, dtype=torch.int64), member, ranked,
                         torch.zeros(EM, dtype=torch.int64), order_misses, order_state)  # fmt: skip


@pytest.mark.parametrize(
    ("L", "EM", "E", "R", "T", "K", "layer"),
    [
        (3, 7, 7, 5, 1, 2, 0),
        (3, 7, 5, 5, 2, 3, 2),
        (2, 9, 9, 17, 3, 8, 1),  # K > E: every expert routed, duplicates
        (1, 1, 1, 1, 1, 1, 0),
        (4, 13, 11, 9, 0, 4, 3),  # an empty step
        (2, 64, 61, 23, 25, 8, 0),  # 200 ids x 64 experts: counted by atomics
        (5, 64, 60, 300, 4, 8, 0),  # N = 320 and R = 300: several passes of the shadow and row searches
        (5, 64, 64, 259, 2, 6, 3),
    ],
)
@pytest.mark.parametrize(
    ("router", "freq_mode"),
    [(False, True), (False, False), (True, True), (True, False)]
    + [(duel, mode) for duel in DUEL_MISSES for mode in (True, False)],
)
def test_kernel_equals_reference(L, EM, E, R, T, K, layer, router, freq_mode):
    g = torch.Generator().manual_seed(L * 1000 + EM * 10 + R + T + len(str(router)))
    tables = _random_tables(L, EM, R, g)
    state = _random_state(L, EM, router, freq_mode, g)
    # the router's members decay apart from the counts (the duel's fast ones at another shift again)
    rule = AdaptiveRule(L, decay_shift=3, duel_shift=2, margin_shift=2, floor=SCORE, bonus=2 * ONE, score=SCORE,
                        one=ONE, member_decay_shift=1, fast_decay_shift=2, order_floor=SCORE)  # fmt: skip
    ids = torch.randint(-1, E + 2, (T * K,), generator=g)
    P = min(E, R, max(T * K, 1))
    got = {
        **{k: v.clone() for k, v in tables.items()},
        **{k: v.clone() for k, v in _state_dict(state).items()},
    }
    want = {k: v.clone() for k, v in got.items()}
    outs_got = [torch.zeros(P, dtype=torch.int32) for _ in range(3)]
    outs_want = [torch.zeros(P, dtype=torch.int32) for _ in range(3)]
    for d, outs, fn in ((got, outs_got, plan_adaptive), (want, outs_want, plan_adaptive_reference)):
        fn(ids, d["l2p"], d["row_owner"], d["row_stamp"], d["clock"], d["counters"],
           torch.zeros(EM, dtype=torch.int32), *outs, layer, E, EM, R, 4, 1, _state_from(d, EM), rule)  # fmt: skip
    for key in want:
        diff = (got[key] != want[key]).nonzero().flatten()
        assert diff.numel() == 0, (
            f"{key} differs at {diff[:6].tolist()}: {got[key][diff[:6]]} vs {want[key][diff[:6]]}"
        )
    for name, a, b in zip(("victims", "codes", "valid"), outs_got, outs_want):
        assert torch.equal(a, b), f"{name}: {a.tolist()} vs {b.tolist()}"
    present = {e for e in ids.tolist() if 0 <= e < E}
    seen = got["counters"][:2].sum() - tables["counters"][:2].sum()
    assert int(seen) == len(present), (int(seen), sorted(present))  # every routed expert is a hit or a miss


def _state_dict(state: AdaptiveState) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state._asdict().items() if v is not None and k != "scratch"}


def _state_from(d: dict[str, torch.Tensor], EM: int) -> AdaptiveState:
    return AdaptiveState(d["count"], d["last_use"], d["misses"], d["mode"], d.get("member"), d.get("ranked"),
                         torch.zeros(EM, dtype=torch.int64), d.get("order_misses"),
                         d.get("order_state"))  # fmt: skip


@pytest.mark.parametrize("launch", ["one", "one-overlap", "two"])
@pytest.mark.parametrize("router", [False, True])
@pytest.mark.parametrize(
    ("layers", "rows", "K", "max_T", "kw"),
    [
        ([5, 7, 3], 6, 2, 3, dict(floor_misses=0)),
        ([13, 4, 6, 11], 9, 3, 5, dict(decay_shift=2, recent_bonus=1, duel_shift=2, floor_misses=1)),
    ],
)
def test_fused_planner_equals_twin(launch, router, layers, rows, K, max_T, kw):
    """The planner with the fused plan (`fused=True`: the interpreter) against the host twin, step by step,
    through both modes; with the router, some steps without scores. `launch`: the plan and the admission copy
    in one launch (`plan_adaptive_copy`; with the deferred commit of the overlap) or two."""
    pool = make_pool(layers, rows, seed=rows + 3)
    pool.fill([(len(layers) - 1, 0), (0, layers[0] - 1)])
    cls = RouterAdaptivePolicy if router else AdaptivePolicy
    dev_policy, host_policy = cls(rows, **kw), cls(rows, **kw)
    one, overlap = launch.startswith("one"), launch == "one-overlap"
    planner = DevicePlanner(
        pool, dev_policy, max_routed=max_T * K, fused=True, one_launch=one, overlap=overlap
    )
    assert planner.fused and planner.one_launch is one and planner.overlap is overlap
    assert planner.long_plan is overlap, (
        "an adaptive plan beside the MoE is a long one (inline path preferred)"
    )
    twin = HostTwin(pool, host_policy)
    # telemetry recorded inside the plan kernel, against the torch form's; a low cap so that it saturates
    tel, tel_ref = (RouteTelemetry(layers, torch.device("cpu"), max_count=20, fused=False) for _ in range(2))
    g = torch.Generator().manual_seed(sum(layers) + rows + int(router))
    modes = set()
    for step in range(90):
        layer = step % len(layers)
        E = layers[layer]
        T = int(torch.randint(0, max_T + 1, (1,), generator=g))
        ids = (skewed_ids if (step // 30) % 2 == 0 else random_ids)(T, min(K, E), E, g)
        scores = None
        if router and step % 5 != 4:  # every third step a column-major view: stride along the experts T
            scores = torch.randn(T, E + 1, generator=g) * 3
            scores = scores.t().contiguous().t() if step % 3 == 0 else scores
        planner.plan(layer, ids, telemetry=tel, router_scores=scores)
        tel_ref.record(layer, ids)
        codes = twin.plan(layer, ids, router_scores=scores)
        assert_same_state(planner, twin, f"step {step}")
        present = sorted({e for e in ids.flatten().tolist() if 0 <= e < E})
        assert [int(pool.l2p_gpu[layer, e]) for e in present] == codes
        modes.add(int(dev_policy.mode))
    assert_rows_hold_owners(pool, planner)
    planner.store_to_pool()
    pool.check_invariants()
    if kw.get("floor_misses") == 0:
        assert modes == {0, 1}
    for got, want in (
        (tel.counts[:-1], tel_ref.counts[:-1]),
        (tel.routed[:-1], tel_ref.routed[:-1]),
        (tel.flags, tel_ref.flags),
    ):  # the last slot is the torch form's dummy
        assert torch.equal(got, want), (got, want)
    assert tel.flags.tolist() == [1, 1], "random_ids poison the window and the cap of 20 is reached"


def test_bad_configuration_and_state():
    pool = make_pool([5, 7], 4)
    with pytest.raises(ValueError, match="not policy 'freq'"):
        DevicePlanner(pool, make_policy("freq"), max_routed=8, fused=True)
    with pytest.raises(ValueError, match="one_launch needs the fused planner"):
        DevicePlanner(pool, AdaptivePolicy(4), max_routed=8, fused=False, one_launch=True)
    planner = DevicePlanner(pool, AdaptivePolicy(4), max_routed=8, fused=True)
    state = planner.policy.kernel_state()  # type: ignore[attr-defined]
    rule = planner.policy.kernel_rule()  # type: ignore[attr-defined]
    args = (torch.zeros(2, dtype=torch.int64), pool.l2p_gpu.view(-1), planner.row_owner, planner.row_stamp,
            planner.clock, planner.counters, planner._counts32, *(torch.zeros(2, dtype=torch.int32),) * 3,
            0, 5, 7, 4, 1, 1)  # fmt: skip
    before = {k: v.clone() for k, v in planner.state().items()}
    with pytest.raises(ValueError, match=r"last_use: shape \(13,\)"):
        plan_adaptive(*args, state._replace(last_use=state.last_use[:13]), rule)
    with pytest.raises(ValueError, match="member and ranked come together"):
        plan_adaptive(*args, state._replace(member=state.last_use), rule)
    with pytest.raises(ValueError, match=r"l2p holds 14 entries, expected L \* E_max = 21"):
        plan_adaptive(*args, state, rule._replace(num_layers=3))
    with pytest.raises(ValueError, match=r"shifts out of \[1, 30\]"):
        plan_adaptive(*args, state, rule._replace(decay_shift=0))
    with pytest.raises(ValueError, match=r"shifts out of \[1, 30\]"):
        plan_adaptive(*args, state, rule._replace(member_decay_shift=31))
    with pytest.raises(ValueError, match="num_pairs=6 > min"):
        plan_adaptive(*args[:7], *(torch.zeros(6, dtype=torch.int32),) * 3, *args[10:], state, rule)
    after = planner.state()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("seed", range(6))
def test_fused_equals_torch_ops_on_random_configurations(seed):
    """The fused planner against the torch-ops planner (`fused=False`), all state after every step, on seeded
    random pools: layer sizes, rows, top-k (above E too), block_m and min_reads, the three policies."""
    g = torch.Generator().manual_seed(seed)
    layers = torch.randint(1, 12, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
    rows = int(torch.randint(1, 15, (1,), generator=g))
    K, max_T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    block_m, min_reads = (
        int(torch.randint(1, 4, (1,), generator=g)),
        int(torch.randint(1, 3, (1,), generator=g)),
    )
    cls = (AdaptivePolicy, RouterAdaptivePolicy, MemoryDuelPolicy)[seed % 3]
    kw = dict(floor_misses=0, decay_shift=2, duel_shift=1)
    if cls is MemoryDuelPolicy:  # orders that differ much, no floor: the order flips in a few steps
        kw.update(slow=6, fast=1, order_floor=0)
        rows = max(1, min(rows, sum(layers) // 2))  # a pool that holds every expert never misses: no duel
    pools = [make_pool(layers, rows, seed=seed) for _ in range(2)]
    fused, ops = (
        DevicePlanner(
            pool,
            cls(rows, **kw),
            max_routed=max_T * K,
            block_m=block_m,
            min_reads_to_admit=min_reads,
            fused=f,
        )
        for pool, f in zip(pools, (True, False))
    )
    orders = set()
    for step in range(40):
        layer = int(torch.randint(0, len(layers), (1,), generator=g))
        E = layers[layer]
        T = int(torch.randint(0, max_T + 1, (1,), generator=g))
        ids = (
            (skewed_ids if step % 2 else random_ids)(T, K, E, g)
            if K <= E
            else torch.randint(-1, E, (T, K), generator=g)
        )
        scores = torch.randn(T, E, generator=g) * 2 if cls is not AdaptivePolicy else None
        fused.plan(layer, ids, router_scores=scores)
        ops.plan(layer, ids, router_scores=scores)
        a, b = fused.state(), ops.state()
        for key in a:
            assert torch.equal(a[key], b[key]), f"seed {seed} step {step}: {key} {a[key]} vs {b[key]}"
        assert torch.equal(pools[0].l2p_gpu, pools[1].l2p_gpu), f"seed {seed} step {step}: l2p"
        if isinstance(fused.policy, MemoryDuelPolicy):
            orders.add(fused.policy.uses_fast)
    assert_rows_hold_owners(pools[0], fused)
    assert cls is not MemoryDuelPolicy or orders == {0, 1}, f"seed {seed}: the duel chose only {orders}"


def test_a_subclass_is_not_fused_with_the_base_rule():
    class Custom(AdaptivePolicy):
        name = "custom-adaptive"

    with pytest.raises(ValueError, match="not policy 'custom-adaptive'"):
        DevicePlanner(make_pool([5], 3), Custom(3), max_routed=4, fused=True)
