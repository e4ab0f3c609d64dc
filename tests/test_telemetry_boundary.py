"""PooledMoE with route telemetry: the coarse boundary pins the window's hottest experts, then a new window."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from tests.reference import dense_reference, random_expert_weights

H, I, E, K, L = 16, 8, 9, 2, 2


def _build(telemetry: bool) -> tuple[PooledMoE, dict]:
    weights = random_expert_weights(L, E, H, I, torch.float32, seed=5)
    moe = PooledMoE(
        PoolConfig(pool_rows=6, device="cpu", telemetry=telemetry), H, I, top_k=K, dtype=torch.float32
    )
    for _ in range(L):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe, weights


def test_boundary_pins_the_hottest_experts_and_starts_a_new_window():
    moe, weights = _build(telemetry=True)
    g = torch.Generator().manual_seed(6)
    hot = {(1, 7): 9, (0, 8): 6, (1, 5): 4}  # (layer, expert): steps that route it, 4 tokens each
    T = 4
    for step in range(9):
        for layer in range(L):
            chosen = [e for (lyr, e), n in hot.items() if lyr == layer and step < n][:K]
            rows = []
            for t in range(T):  # the rest of each token's slots rotate over the other experts
                others = [e for e in range(E) if e not in chosen]
                rows.append(
                    chosen + [others[(step * T + t + j) % len(others)] for j in range(K - len(chosen))]
                )
            ids = torch.tensor(rows)  # [T, K]
            x = torch.randn(T, H, generator=g)
            w = torch.rand(T, K, generator=g)
            out = moe.forward(layer, x, ids, w)
            assert torch.equal(out, dense_reference(x, ids, w, {e: weights[(layer, e)] for e in range(E)}))
    # Evict the hot experts so the plan has work to do, then close the window.
    for layer, e in hot:
        if moe.pool.is_resident(layer, e):
            moe.pool.evict(moe.pool.lookup(layer, e))
    copied = moe.telemetry_boundary(max_pinned=3)
    assert copied == 3
    assert all(moe.pool.is_resident(layer, e) for layer, e in hot)
    assert [moe.pool.row_owner[r] for r in moe.pool.lru_rows()[-3:]] == [
        (1, 5),
        (0, 8),
        (1, 7),
    ]  # hottest last
    moe.pool.check_invariants()
    assert moe.telemetry.epoch == 1 and int(moe.telemetry.counts.sum()) == 0


def test_no_telemetry_means_no_plan():
    moe, _ = _build(telemetry=False)
    assert moe.telemetry is None and moe.telemetry_boundary() is None


def test_boundary_inside_a_graph_region_is_refused():
    moe, _ = _build(telemetry=True)
    with moe.telemetry.graph_region(), pytest.raises(RuntimeError, match="refused"):
        moe.telemetry_boundary()
