"""Device planner (torch ops, run on CPU tensors) against its plain-Python host twin and the pool's own LRU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pooled_runner import envs
from pooled_runner.bank import ExpertBank
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.formats.base import OperandSpec
from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import NEVER, AgingFreqPolicy, FreqDecayPolicy, LRUPolicy, make_policy
from pooled_runner.pool import ExpertPool
from pooled_runner.telemetry import RouteTelemetry

OPERANDS = (OperandSpec("w13", (3, 2), torch.float32), OperandSpec("w2", (5,), torch.float32))


def make_pool(layers: list[int], rows: int, seed: int = 0) -> ExpertPool:
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(OPERANDS, layers, pin=False)
    for t in bank.tensors_host.values():
        t.copy_(torch.randn(t.shape, generator=g))
    return ExpertPool(OPERANDS, layers, rows, torch.device("cpu"), bank)


def policy_pair(name: str) -> tuple:
    if name in ("lru", "lru-fused"):
        return LRUPolicy(), LRUPolicy()
    if name in ("lru-cycle", "lru-cycle-fused", "lru-cycle-split"):
        return CycleLRUPolicy(), CycleLRUPolicy()
    if name == "aging":
        kw = dict(decay_steps=3, correlated_steps=1, recent_steps=1, recent_bonus=2)
        return AgingFreqPolicy(**kw), AgingFreqPolicy(**kw)
    kw = dict(decay_steps=2, recent_steps=1, recent_bonus=3, correlated_steps=1, cap=4)
    return FreqDecayPolicy(**kw), FreqDecayPolicy(**kw)


def assert_same_state(planner: DevicePlanner, twin: HostTwin, where: str) -> None:
    a, b = planner.state(), twin.state()
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] != b[key]).nonzero()
        assert diff.numel() == 0, f"{where}: {key} differs at {diff[:5].tolist()}: {a[key]} vs {b[key]}"


def assert_rows_hold_owners(pool: ExpertPool, planner: DevicePlanner) -> None:
    EM = pool.max_experts
    for row, flat in enumerate(planner.row_owner[: pool.num_rows].tolist()):
        if flat >= 0:
            for name, t in pool.rows_gpu.items():
                expect = pool.bank.row(flat // EM, flat % EM)[name]
                assert torch.equal(t[row], expect), f"row {row} does not hold expert {divmod(flat, EM)}"


def random_ids(T: int, K: int, E: int, g: torch.Generator) -> torch.Tensor:
    """Router-like distinct ids per token, with padding and some out-of-range ids."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.long().reshape(T, K)
    noise = torch.rand(T, K, generator=g)
    ids[noise < 0.1] = -1
    ids[noise > 0.95] = E + 3
    return ids


def plan_both(
    planner: DevicePlanner,
    twin: HostTwin,
    layer: int,
    ids: torch.Tensor,
    where: str,
    router_scores: torch.Tensor | None = None,
) -> None:
    """One step through the device planner and its host twin: identical state, and the twin's codes of the
    routed experts equal the device table's."""
    planner.plan(layer, ids, router_scores=router_scores)
    codes = twin.plan(layer, ids, router_scores=router_scores)
    assert_same_state(planner, twin, where)
    E = planner.pool.num_experts_per_layer[layer]
    present = sorted({e for e in ids.flatten().tolist() if 0 <= e < E})
    assert [int(planner.pool.l2p_gpu[layer, e]) for e in present] == codes


@pytest.mark.parametrize(
    "policy", ["lru", "lru-fused", "lru-cycle", "lru-cycle-fused", "lru-cycle-split", "freq", "aging"]
)
@pytest.mark.parametrize(
    ("layers", "rows", "K", "max_T"),
    [([5, 7, 3], 6, 2, 3), ([1], 1, 1, 2), ([9, 9], 17, 3, 4), ([13, 4, 6, 11], 9, 4, 5), ([8], 3, 3, 1)],
)
def test_device_planner_equals_twin(policy, layers, rows, K, max_T):
    pool = make_pool(layers, rows, seed=rows)
    pool.fill([(len(layers) - 1, 0), (0, layers[0] - 1)])
    dev_policy, host_policy = policy_pair(policy)
    # the fused kernels under the Triton interpreter on the CPU: plan + copy in one launch, or split in two
    fused = policy.endswith(("-fused", "-split"))
    one_launch = False if policy.endswith("-split") else None
    planner = DevicePlanner(
        pool, dev_policy, max_routed=max_T * K, debug_checks=True, fused=fused, one_launch=one_launch
    )
    assert planner.one_launch == (fused and one_launch is None and not envs.plan_split_copy())
    twin = HostTwin(pool, host_policy)
    assert_same_state(planner, twin, "start")
    g = torch.Generator().manual_seed(sum(layers) + rows)
    for step in range(120):
        layer = step % len(layers)
        T = int(torch.randint(0, max_T + 1, (1,), generator=g))
        plan_both(
            planner, twin, layer, random_ids(T, min(K, layers[layer]), layers[layer], g), f"step {step}"
        )
    assert_rows_hold_owners(pool, planner)
    c = planner.counter_values()
    assert (c["hits"], c["misses"], c["admissions"]) == (twin.hits, twin.misses, twin.admissions)
    assert c["misses"] == c["admissions"] + c["host_reads"]
    planner.store_to_pool()
    pool.check_invariants()


@pytest.mark.parametrize("fused", [False, True])
def test_single_expert_steps_match_pool_lru(fused):
    """With one expert per step, per-step stamps order rows exactly like the pool's touch-order LRU."""
    layers, rows = [6, 4, 5], 5
    pool_a, pool_b = make_pool(layers, rows), make_pool(layers, rows)
    planner = DevicePlanner(pool_a, LRUPolicy(), max_routed=1, fused=fused)
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        layer = int(torch.randint(0, 3, (1,), generator=g))
        e = int(torch.randint(0, layers[layer], (1,), generator=g))
        planner.plan(layer, torch.tensor([[e]]))
        pool_b.plan_step(layer, [e])
        assert torch.equal(pool_a.l2p_gpu, pool_b.l2p_host)
    planner.store_to_pool()
    assert pool_a.lru_rows() == pool_b.lru_rows()
    assert planner.counter_values()["evictions"] == pool_b.stats().evictions > 0
    pool_a.check_invariants()


@pytest.mark.parametrize("fused", [False, True])
def test_more_distinct_experts_than_rows_read_the_rest_in_place(fused):
    pool = make_pool([10], rows=3)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=fused)
    planner.plan(0, torch.tensor([[7, 2, 9, 4], [0, 2, 5, 1]]))
    codes = pool.l2p_gpu[0].tolist()
    assert [codes[e] for e in (0, 1, 2)] == [0, 1, 2]  # lowest expert ids take the free rows, by row
    assert all(codes[e] == 3 + e for e in (4, 5, 7, 9))  # the rest through the host view
    assert planner.counter_values() == {
        "hits": 0,
        "misses": 7,
        "admissions": 3,
        "host_reads": 4,
        "evictions": 0,
    }
    planner.plan(0, torch.tensor([[0, 1, 2, 9]]))  # every row used by this step: 9 stays on the host
    assert int(pool.l2p_gpu[0, 9]) == 3 + 9
    assert_rows_hold_owners(pool, planner)


@pytest.mark.parametrize("fused", [False, True])
def test_step_never_evicts_its_own_hits(fused):
    pool = make_pool([6, 6], rows=4)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=4, fused=fused)
    planner.plan(0, torch.tensor([[0, 1, 2, 3]]))
    planner.plan(1, torch.tensor([[0, 1]]))  # evicts layer-0 experts 0, 1 (least recent, lowest rows)
    assert pool.l2p_gpu[0, :4].tolist() == [4 + 0, 4 + 1, 2, 3]
    planner.plan(0, torch.tensor([[2, 3, 4, 5]]))  # hits 2, 3; only rows of layer 1 may go
    assert pool.l2p_gpu[0, 2:6].tolist() == [2, 3, 0, 1]
    assert pool.l2p_gpu[1, :2].tolist() == [4 + 0, 4 + 1]


@pytest.mark.parametrize("fused", [False, True])
def test_byte_rule_reads_single_token_misses_in_place(fused):
    pool = make_pool([8], rows=4)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=8, block_m=2, min_reads_to_admit=2, fused=fused)
    twin = HostTwin(pool, LRUPolicy(), block_m=2, min_reads_to_admit=2)
    ids = torch.tensor([[1, 2], [1, 3], [1, 2], [5, 6]])  # expert 1: 3 tokens -> 2 reads; others 1 read
    planner.plan(0, ids)
    twin.plan(0, ids)
    assert pool.l2p_gpu[0].tolist() == [4, 0, 6, 7, 8, 9, 10, 11]
    assert_same_state(planner, twin, "byte rule")


def test_frequency_policy_keeps_a_hot_expert_through_a_scan():
    """LRU loses the hot expert to a scan of one-off experts; the frequency policy keeps it."""
    results = {}
    for name in ("lru", "freq", "aging"):
        pool = make_pool([40], rows=4)
        policy = {
            "lru": make_policy("lru"),
            "freq": FreqDecayPolicy(decay_steps=1000, recent_bonus=1),
            "aging": AgingFreqPolicy(),
        }[name]
        planner = DevicePlanner(pool, policy, max_routed=2)
        for _ in range(5):
            planner.plan(0, torch.tensor([[0, 1]]))
        for e in range(2, 10, 2):  # a short scan: four one-off pairs (aging would forget the hot one later)
            planner.plan(0, torch.tensor([[e, e + 1]]))
        results[name] = int(pool.l2p_gpu[0, 0]) < 4
    assert results == {"lru": False, "freq": True, "aging": True}


class _TableWritingPolicy(LRUPolicy):
    """A buggy policy: its observe() writes a location code (two experts then claim row 0)."""

    def __init__(self, l2p: torch.Tensor):
        self.l2p = l2p

    def observe(self, layer, present, now):
        self.l2p[0, 3] = 0


def test_debug_checks_catch_an_inconsistent_table():
    pool = make_pool([6], rows=3)
    pool.fill()
    planner = DevicePlanner(pool, _TableWritingPolicy(pool.l2p_gpu), max_routed=4, debug_checks=True)
    with pytest.raises(
        RuntimeError, match=r"planner tables inconsistent.*layer 0 expert 3 -> row 0 owned by 0"
    ):
        planner.plan(0, torch.tensor([[1]]))


def test_policy_keys_cannot_break_the_tables():
    """Whatever keys and accept masks a policy returns, the planner's pairing keeps the tables consistent."""

    class Arbitrary(LRUPolicy):
        def victim_key(self, row_owner, row_stamp, now):
            return torch.zeros_like(row_owner)

        def accept(self, cand_flat, victim_key):
            return cand_flat % 2 == 0

        def candidate_key(self, layer, num_experts):
            return torch.full((num_experts,), 5, dtype=torch.int64)

    pool = make_pool([7, 5], rows=4)
    planner = DevicePlanner(pool, Arbitrary(), max_routed=6, debug_checks=True)
    g = torch.Generator().manual_seed(3)
    for step in range(40):
        planner.plan(step % 2, random_ids(3, 2, [7, 5][step % 2], g))
    assert_rows_hold_owners(pool, planner)


def test_state_tensors_keep_their_addresses():
    pool = make_pool([5, 5], rows=3)
    planner = DevicePlanner(pool, FreqDecayPolicy(), max_routed=4)
    tensors = [
        planner.row_owner,
        planner.row_stamp,
        planner.clock,
        pool.l2p_gpu,
        *planner.policy.state_tensors().values(),
    ]
    ptrs = [t.data_ptr() for t in tensors]
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        planner.plan(step % 2, random_ids(2, 2, 5, g))
    assert ptrs == [t.data_ptr() for t in tensors]


@settings(max_examples=30, deadline=None)
@given(
    layers=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    rows=st.integers(1, 12),
    policy=st.sampled_from(["lru", "lru-fused", "lru-cycle", "lru-cycle-fused", "freq", "aging"]),
    steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10**6)), min_size=1, max_size=40),
)
def test_planner_twin_and_invariants_property(layers, rows, policy, steps):
    pool = make_pool(layers, rows)
    pool.fill()
    dev_policy, host_policy = policy_pair(policy)
    planner = DevicePlanner(pool, dev_policy, max_routed=6, fused=policy.endswith("-fused"))
    twin = HostTwin(pool, host_policy)
    for layer_pick, seed in steps:
        layer = layer_pick % len(layers)
        g = torch.Generator().manual_seed(seed)
        T = seed % 4
        ids = random_ids(T, min(2, layers[layer]), layers[layer], g)
        planner.plan(layer, ids)
        twin.plan(layer, ids)
    assert_same_state(planner, twin, "end")
    assert_rows_hold_owners(pool, planner)
    planner.store_to_pool()
    pool.check_invariants()


@pytest.mark.parametrize("fused", [False, True])
def test_cycle_protection_keeps_hits_where_lru_thrashes(fused):
    """Every layer routes the same 3 experts each step; 4 layers need 12 rows but there are 8. Global LRU
    evicts exactly the rows the next layers need (hit rate 0); cycle-protected LRU lets each layer recycle
    only its own rows or idle ones, so the layers that kept rows keep hitting. The twin agrees throughout."""
    layers, rows = [5, 5, 5, 5], 8
    results = {}
    for name in ("lru", "lru-cycle"):
        pool = make_pool(layers, rows)
        dev_policy, host_policy = policy_pair(name)
        planner = DevicePlanner(pool, dev_policy, max_routed=3, fused=fused)
        twin = HostTwin(pool, host_policy)
        for step in range(12):
            if step == 4:
                start = planner.counter_values()
            for layer in range(len(layers)):
                ids = torch.tensor([[0, 1, 2]])
                planner.plan(layer, ids)
                twin.plan(layer, ids)
        assert_same_state(planner, twin, name)
        assert_rows_hold_owners(pool, planner)
        end = planner.counter_values()
        results[name] = (end["hits"] - start["hits"]) / (
            end["hits"] + end["misses"] - start["hits"] - start["misses"]
        )
    assert results["lru"] == 0.0
    assert results["lru-cycle"] >= 0.5, results


@pytest.mark.parametrize("fused", [False, True])
def test_planner_records_telemetry_like_record(fused):
    """`plan(layer, ids, telemetry)` (inside the fused kernel, or by `record` on the ops path) leaves the
    telemetry exactly as `RouteTelemetry.record` on its own: counts, bitmap, poison from out-of-range ids."""
    layers = [5, 7, 3]
    pool = make_pool(layers, rows=4)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=12, fused=fused)
    recorded = RouteTelemetry(layers, torch.device("cpu"), fused=False)
    planned = RouteTelemetry(layers, torch.device("cpu"), fused=False)
    g = torch.Generator().manual_seed(3)
    for step in range(30):
        layer = step % len(layers)
        ids = random_ids(step % 4, min(3, layers[layer]), layers[layer], g)
        recorded.record(layer, ids)
        planner.plan(layer, ids, planned)
    a, b = recorded.snapshot(), planned.snapshot()
    assert torch.equal(a.counts, b.counts) and torch.equal(a.routed, b.routed)
    assert (a.poisoned, a.overflowed) == (b.poisoned, b.overflowed) == (True, False)
    with pytest.raises(ValueError, match="telemetry counts"):
        planner.plan(0, torch.tensor([[1]]), RouteTelemetry([9], torch.device("cpu")))


@pytest.mark.parametrize("make", [FreqDecayPolicy, AgingFreqPolicy], ids=["freq", "aging"])
def test_last_use_ticks_follow_the_clock_renumbering(make):
    """A host-planned step renumbers the planner's clock (`load_from_pool`); the policy's last-use ticks move
    with it (`clock_reset(shift)`), so every expert's age is unchanged and never-routed ones stay never."""
    pool = make_pool([7, 5, 6], 6, seed=3)
    policy = make(decay_steps=1000)
    planner = DevicePlanner(pool, policy, max_routed=6)
    g = torch.Generator().manual_seed(12)
    for step in range(40):
        layer = step % 3
        planner.plan(layer, random_ids(2, 3, pool.num_experts_per_layer[layer], g))
    last = policy.state_tensors()["last_use"].clone()
    clock = int(planner.clock)
    planner.store_to_pool()
    planner.load_from_pool()
    assert int(planner.clock) != clock  # 40 ticks renumbered to the pool's <= 6 stamps
    never = last == NEVER
    assert bool(never.any()) and bool((~never).any())
    now = policy.state_tensors()["last_use"]
    assert torch.equal(now[never], last[never])
    assert torch.equal(now[~never] - int(planner.clock), last[~never] - clock)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_operands_are_copied_as_bytes(fused):
    """fp8 weights and e4m3 scales (fp8 formats, NVFP4) reach the row-copy kernels as bytes (Triton refuses
    fp8e4nv before sm_89; a copy needs no values): every admitted row equals its bank row bit for bit."""
    operands = (OperandSpec("w", (6,), torch.float8_e4m3fn), OperandSpec("s", (2,), torch.float32))
    g = torch.Generator().manual_seed(3)
    bank = ExpertBank(operands, [7], pin=False)
    bank.tensors_host["w"].view(torch.uint8).copy_(
        torch.randint(0, 255, bank.tensors_host["w"].shape, generator=g)
    )
    bank.tensors_host["s"].copy_(torch.randn(bank.tensors_host["s"].shape, generator=g))
    pool = ExpertPool(operands, [7], 3, torch.device("cpu"), bank)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=2, fused=fused)
    assert planner._rows_flat["w"].dtype == torch.uint8 and planner._rows_flat["s"].dtype == torch.float32
    for e in (0, 4, 6, 2, 4, 5):
        planner.plan(0, torch.tensor([[e]]))
    assert planner.counter_values()["admissions"] >= 4
    assert_rows_hold_owners(pool, planner)
