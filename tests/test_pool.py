"""ExpertPool: LRU order, location tables and their consistency under long random operation sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pooled_runner.bank import ExpertBank
from pooled_runner.formats import Bf16Format
from pooled_runner.pool import NOT_ROUTED, ExpertPool

H, I = 6, 4
OPERANDS = Bf16Format(torch.float32).operands(H, I)


def make_pool(experts_per_layer: list[int], rows: int, seed: int = 0) -> ExpertPool:
    bank = ExpertBank(OPERANDS, experts_per_layer, pin=False)
    g = torch.Generator().manual_seed(seed)
    for layer, n in enumerate(experts_per_layer):
        for e in range(n):
            bank.write_expert(layer, e, {s.name: torch.randn(s.row_shape, generator=g) for s in OPERANDS})
    return ExpertPool(OPERANDS, experts_per_layer, rows, torch.device("cpu"), bank)


def test_initial_tables_are_host_codes_and_padding():
    pool = make_pool([3, 5], rows=4)
    assert pool.l2p_host.tolist() == [[4, 5, 6, -1, -1], [4, 5, 6, 7, 8]]
    assert pool.l2p_gpu.dtype == torch.int32
    pool.check_invariants()


def test_fill_layer_major_then_by_priority():
    pool = make_pool([3, 5], rows=4)
    assert pool.fill() == 4
    assert [pool.row_owner[r] for r in range(4)] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    other = make_pool([3, 5], rows=2)
    assert other.fill([(1, 4), (0, 2), (1, 1)]) == 2
    assert other.lookup(1, 4) == 0 and other.lookup(0, 2) == 1 and not other.is_resident(1, 1)


def test_admitted_rows_hold_the_bank_rows():
    pool = make_pool([4, 4], rows=3, seed=3)
    row = pool.admit(1, 2)
    assert row is not None
    for name, t in pool.rows_gpu.items():
        assert torch.equal(t[row], pool.bank.row(1, 2)[name])


def test_lru_evicts_least_recently_used_first():
    pool = make_pool([6], rows=3)
    for e in (0, 1, 2):
        pool.admit(0, e)
    pool.touch(pool.lookup(0, 0))  # order now 1, 2, 0
    pool.admit(0, 3)  # evicts expert 1
    assert not pool.is_resident(0, 1) and pool.lookup(0, 1) == 3 + 1
    assert [pool.row_owner[r] for r in pool.lru_rows()] == [(0, 2), (0, 0), (0, 3)]
    pool.check_invariants()


def test_admit_skips_protected_rows_wherever_they_sit():
    """`admit` evicts the least recently used row outside `protected`, also when protected rows were not touched
    first (plan_step touches them; a direct caller need not)."""
    pool = make_pool([7], rows=3, seed=5)
    pool.fill([(0, 4), (0, 1), (0, 6)])  # LRU order: rows 0, 1, 2
    assert pool.admit(0, 2, protected={0}) == 1  # row 0 is protected, row 1 is the next least recent
    assert pool.row_owner[1] == (0, 2) and not pool.is_resident(0, 1)
    assert (
        pool.admit(0, 3, protected={0, 2}) == 1
    )  # row 1 is now the most recent, but the only one not protected
    assert pool.row_owner[1] == (0, 3)
    assert pool.admit(0, 5, protected={0, 1, 2}) is None  # every row protected: the host view
    assert pool.lookup(0, 5) == 3 + 5 and [pool.row_owner[r] for r in range(3)] == [(0, 4), (0, 3), (0, 6)]
    pool.check_invariants()


def test_fill_keeps_earlier_traffic_and_counts_none_of_its_own():
    pool = make_pool([5, 3], rows=4, seed=6)
    pool.fill([(0, 0)])
    pool.plan_step(0, [1, 3])  # two admissions: traffic
    traffic = pool.stats().bytes_copied_to_rows
    assert traffic == 2 * pool.row_bytes
    assert pool.fill([(1, 2)]) == 1  # installation: not traffic, and the traffic before it stays
    assert pool.stats().bytes_copied_to_rows == traffic


def test_a_pool_without_layers_or_experts_is_refused():
    with pytest.raises(ValueError, match="register at least one pooled layer"):
        ExpertPool(OPERANDS, [], 2, torch.device("cpu"), bank=None)
    with pytest.raises(ValueError, match="layer 1 has num_experts=0"):
        ExpertPool(OPERANDS, [3, 0], 2, torch.device("cpu"), bank=None)


def test_global_lru_lets_a_hot_layer_take_rows():
    pool = make_pool([4, 4], rows=4)
    pool.fill()  # layer 0 holds all rows
    for e in range(3):
        pool.plan_step(1, [e])
    assert pool.rows_in_use_per_layer() == [1, 3]


def test_plan_step_never_evicts_rows_of_the_same_step():
    pool = make_pool([8], rows=3)
    codes = pool.plan_step(0, [0, 1, 2, 3, 4])
    resident = [c for c in codes if c < 3]
    assert sorted(resident) == [0, 1, 2]  # three admitted, two read in place
    assert codes[3:] == [3 + 3, 3 + 4]
    stats = pool.stats()
    assert (stats.misses, stats.admissions, stats.bytes_read_host_view) == (5, 3, 2 * pool.row_bytes)


def test_bad_indices_raise_with_values():
    pool = make_pool([3], rows=2)
    with pytest.raises(ValueError, match=r"expert 3 out of range \[0, 3\)"):
        pool.lookup(0, 3)
    with pytest.raises(ValueError, match=r"layer 1 out of range"):
        pool.admit(1, 0)
    with pytest.raises(ValueError, match=r"row 2 out of range \[0, 2\)"):
        pool.evict(2)
    with pytest.raises(ValueError, match="row 0 is free"):
        pool.evict(0)
    pool.place(0, 1, 1)
    with pytest.raises(ValueError, match=r"row 1 is held by"):
        pool.place(0, 2, 1)
    with pytest.raises(ValueError, match="already in row 1"):
        pool.place(0, 1, 0)


def test_write_row_rejects_wrong_shape_dtype_and_non_contiguous():
    pool = make_pool([2], rows=1)
    good = {s.name: torch.randn(s.row_shape) for s in OPERANDS}
    with pytest.raises(ValueError, match=r"w13 has shape \(4, 6\), expected \(8, 6\)"):
        pool.write_row(0, {**good, "w13": torch.randn(4, 6)})
    with pytest.raises(ValueError, match="w2 has dtype torch.float16"):
        pool.write_row(0, {**good, "w2": good["w2"].half()})
    with pytest.raises(ValueError, match="not contiguous"):
        pool.write_row(0, {**good, "w13": torch.randn(6, 8).t()})
    with pytest.raises(ValueError, match=r"operands \['w13'\] given"):
        pool.write_row(0, {"w13": good["w13"]})


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "evict", "touch", "step"]), st.integers(0, 10**6), st.integers(0, 10**6)
    ),
    min_size=1,
    max_size=400,
)


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(st.integers(1, 9), min_size=1, max_size=4), rows_frac=st.floats(0.05, 0.95), ops=OPS)
def test_tables_stay_consistent_under_random_operations(layers, rows_frac, ops):
    total = sum(layers)
    rows = max(1, int(total * rows_frac))
    pool = make_pool(layers, rows)
    model: dict[tuple[int, int], int] = {}  # independent record: resident pair -> row
    for op, a, b in ops:
        layer = a % len(layers)
        expert = b % layers[layer]
        if op == "admit":
            row = pool.admit(layer, expert)
            assert row is not None
            model = {k: v for k, v in model.items() if v != row}
            model[(layer, expert)] = row
        elif op == "evict" and pool.lru_rows():
            row = pool.lru_rows()[b % len(pool.lru_rows())]
            owner = pool.evict(row)
            assert model.pop(owner) == row
        elif op == "touch" and pool.lru_rows():
            row = pool.lru_rows()[0]
            pool.touch(row)
            assert pool.lru_rows()[-1] == row
        elif op == "step":
            experts = sorted({(b + i * a) % layers[layer] for i in range(1 + a % 4)})
            codes = pool.plan_step(layer, experts)
            for e, c in zip(experts, codes):
                if c < rows:
                    model = {k: v for k, v in model.items() if v != c or k == (layer, e)}
                    model[(layer, e)] = c
                else:
                    assert c == rows + e
    pool.check_invariants()
    for layer, n in enumerate(layers):
        for e in range(n):
            expected = model.get((layer, e), rows + e)
            assert pool.lookup(layer, e) == expected
        assert (pool.l2p_host[layer, n:] == NOT_ROUTED).all()
    for (layer, e), row in model.items():
        for name, t in pool.rows_gpu.items():
            assert torch.equal(t[row], pool.bank.row(layer, e)[name]), f"row {row} holds wrong weights"
