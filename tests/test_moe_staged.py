"""Staged installation (allocate -> expert_rows -> finalize), the path SGLang's weight loader uses."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE


def build(rows: int, staged: bool, E: tuple[int, ...] = (5, 7, 3), seed: int = 0) -> PooledMoE:
    H, I, K = 12, 6, 3
    moe = PooledMoE(PoolConfig.resolve(pool_rows=rows, device="cpu"), H, I, K, torch.float32)
    for n in E:
        moe.register_layer(n)
    g = torch.Generator().manual_seed(seed)
    weights = {
        (layer, e): {"w13": torch.randn(2 * I, H, generator=g), "w2": torch.randn(H, I, generator=g)}
        for layer, n in enumerate(E)
        for e in range(n)
    }
    if staged:
        moe.allocate()
        for (layer, e), w in reversed(list(weights.items())):  # any order, in place
            rows_ = moe.expert_rows(layer, e)
            rows_["w13"][:I].copy_(w["w13"][:I])  # gate and up written separately, as SGLang does
            rows_["w13"][I:].copy_(w["w13"][I:])
            rows_["w2"].copy_(w["w2"])
        moe.finalize()
    else:
        moe.install(lambda layer, e: weights[(layer, e)])
    return moe


@pytest.mark.parametrize("rows", [3, 4, 14, 15, 40])
def test_staged_equals_install(rows: int) -> None:
    staged, installed = build(rows, True), build(rows, False)
    assert staged.pool is not None and installed.pool is not None
    staged.pool.check_invariants()
    assert torch.equal(staged.pool.l2p_host, installed.pool.l2p_host)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        layer = step % 3
        T = [0, 1, 7, 4, 2, 5][step]
        x = torch.randn(T, 12, generator=g)
        ids = torch.randint(-1, staged.num_experts_per_layer[layer], (T, 3), generator=g)
        w = torch.rand(T, 3, generator=g)
        assert torch.equal(staged.forward(layer, x, ids, w), installed.forward(layer, x, ids, w))
    assert staged.stats() == installed.stats()


def test_staged_order_is_enforced() -> None:
    moe = PooledMoE(PoolConfig.resolve(pool_rows=4, device="cpu"), 8, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="no registered layer"):
        moe.allocate()
    moe.register_layer(3)
    with pytest.raises(RuntimeError, match="between allocate"):
        moe.expert_rows(0, 0)
    with pytest.raises(RuntimeError, match="before allocate"):
        moe.finalize()
    moe.allocate()
    with pytest.raises(ValueError, match=r"expert 3 out of range \[0, 3\)"):
        moe.expert_rows(0, 3)
    with pytest.raises(RuntimeError, match="twice"):
        moe.allocate()
    moe.finalize()
    with pytest.raises(RuntimeError, match="between allocate"):
        moe.expert_rows(0, 0)


def test_staged_rows_below_top_k_refused() -> None:
    moe = PooledMoE(PoolConfig.resolve(pool_rows=1, device="cpu"), 8, 4, 2, torch.float32)
    moe.register_layer(3)
    with pytest.raises(ValueError, match="below top_k=2"):
        moe.allocate()
