"""PooledMoE boundary operations: `sync_tables`, `stats`, `evict_expert`, and the TP agreement digests built on
them, on the host-planned CPU path and on the GPU path's device planner (its torch ops run on CPU tensors here:
the planner's state, not the pool's host bookkeeping, is then the truth between boundaries)."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.gpu_path import GpuPath
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import LRUPolicy
from pooled_runner.tp import TablesDisagree, check_agreement, table_digests
from tests.reference import dense_reference, random_expert_weights

H, I, K = 12, 6, 2
LAYERS = (5, 6, 4)
ROWS = 6


def build(rows: int = ROWS, staging: bool = False, seed: int = 3) -> tuple[PooledMoE, dict]:
    weights = random_expert_weights(len(LAYERS), max(LAYERS), H, I, torch.float32, seed)
    cfg = PoolConfig(pool_rows=rows, device="cpu", prefill_staging=staging, staging_min_tokens=8)
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.float32)
    for n in LAYERS:
        moe.register_layer(n)
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe, weights


def device_planned(moe: PooledMoE) -> GpuPath:
    """Attach the GPU path (its device planner, on CPU tensors); steps are then planned by `planner.plan`.
    Its policy is plain LRU here, so the tables must equal the pool's own host LRU (`plan_step`)."""
    gpu = moe._gpu()
    assert gpu.planner is not None
    gpu.planner = DevicePlanner(gpu.pool, LRUPolicy(), max_routed=gpu.planner.max_routed)
    return gpu


def steps(n: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(n):
        layer = step % len(LAYERS)
        T = 1 + step % 3
        out.append((layer, torch.stack([torch.randperm(LAYERS[layer], generator=g)[:K] for _ in range(T)])))
    return out


def forward_checked(moe: PooledMoE, weights: dict, layer: int, ids: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ids.shape[0], H, generator=g)
    w = torch.rand(ids.shape, generator=g)
    expected = dense_reference(x, ids, w, {e: weights[(layer, e)] for e in range(LAYERS[layer])})
    assert torch.equal(moe.forward(layer, x, ids, w), expected)


def test_evict_expert_on_the_host_path() -> None:
    moe, weights = build()
    for i, (layer, ids) in enumerate(steps(12, seed=1)):
        forward_checked(moe, weights, layer, ids, seed=i)
    pool = moe.pool
    assert pool is not None
    layer, expert = pool.row_owner[pool.lru_rows()[-1]]  # type: ignore[misc]
    row = pool.lookup(layer, expert)
    before = moe.stats()
    assert moe.evict_expert(layer, expert) == row
    assert not pool.is_resident(layer, expert) and pool.row_owner[row] is None
    pool.check_invariants()
    assert moe.stats().evictions == before.evictions + 1
    assert moe.evict_expert(layer, expert) is None  # not in a row: nothing changes
    assert moe.stats().evictions == before.evictions + 1
    forward_checked(moe, weights, layer, torch.tensor([[expert, (expert + 1) % LAYERS[layer]]]), seed=99)
    assert pool.is_resident(layer, expert)  # readmitted by the next step that routes it
    with pytest.raises(ValueError, match="out of range"):
        moe.evict_expert(0, LAYERS[0])
    resident, _ = build(rows=sum(LAYERS))
    with pytest.raises(ValueError, match="without a bank"):
        resident.evict_expert(0, 0)


def test_evict_during_a_staged_step_stops_staging_and_stays_exact() -> None:
    moe, weights = build(staging=True)
    assert moe.stager is not None and moe.pool is not None
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(LAYERS[1], generator=g)[:K] for _ in range(10)])  # 10 >= 8: staged
    forward_checked(moe, weights, 0, ids % LAYERS[0], seed=0)
    assert moe.stager.active
    resident = [e for e in range(LAYERS[1]) if moe.pool.is_resident(1, e)]
    assert resident  # fill() is layer-major: layer 1 holds a row
    moe.evict_expert(1, resident[0])  # the staging buffers of layer 1 do not hold it
    assert not moe.stager.active
    forward_checked(moe, weights, 1, ids, seed=1)


def test_device_planned_tables_are_synced_for_stats_digests_and_evict() -> None:
    ranks = [build()[0] for _ in range(2)]
    gpus = [device_planned(moe) for moe in ranks]
    host, _ = build()  # the same steps planned on the host: the device planner must reach the same tables
    for layer, ids in steps(30, seed=2):
        for gpu in gpus:
            gpu.planner.plan(layer, ids)  # type: ignore[union-attr]
        host.pool.plan_step(layer, sorted(set(ids.flatten().tolist())))  # type: ignore[union-attr]
    moe0, moe1 = ranks
    assert moe0.pool.stats().hits == 0  # type: ignore[union-attr]  # the host bookkeeping is stale ...
    with pytest.raises(ValueError, match="planned on the device"):
        table_digests(moe0.pool)  # type: ignore[arg-type]  # ... so a bare pool is refused
    stats = moe0.stats()  # ... until a boundary syncs it and adds the device counters
    assert stats.hits > 0 and stats.misses > 0 and stats.evictions > 0
    assert (stats.hits, stats.misses, stats.admissions, stats.evictions) == (
        host.stats().hits,
        host.stats().misses,
        host.stats().admissions,
        host.stats().evictions,
    )
    assert torch.equal(moe0.pool.l2p_host, host.pool.l2p_host)  # type: ignore[union-attr]
    names, d0 = table_digests(moe0)
    assert torch.equal(d0, table_digests(moe1)[1]) and torch.equal(d0, table_digests(host)[1])

    # Rank 1 alone evicts an expert of layer 1 through the boundary path: the device planner sees it.
    pool1 = moe1.sync_tables()
    layer1 = [o for o in pool1.row_owner if o is not None and o[0] == 1]
    assert layer1
    _, expert = layer1[0]
    row = moe1.evict_expert(1, expert)
    assert row is not None
    planner1 = gpus[1].planner
    assert planner1 is not None
    assert int(planner1.row_owner[row]) == -1 and int(pool1.l2p_gpu[1, expert]) == pool1.num_rows + expert
    planner1.check_invariants()
    _, d1 = table_digests(moe1)  # the sync from the planner keeps the eviction
    with pytest.raises(TablesDisagree, match=r"step 31: location table of pooled layer 1 \(rank 0"):
        check_agreement(torch.stack([table_digests(moe0)[1], d1]), names, step=31)

    # The others do the same eviction: all agree again, and keep agreeing over further planned steps.
    assert moe0.evict_expert(1, expert) == row and host.evict_expert(1, expert) == row
    for layer, ids in steps(20, seed=5):
        for gpu in gpus:
            gpu.planner.plan(layer, ids)  # type: ignore[union-attr]
        host.pool.plan_step(layer, sorted(set(ids.flatten().tolist())))  # type: ignore[union-attr]
    digests = [table_digests(m)[1] for m in (moe0, moe1, host)]
    check_agreement(torch.stack(digests), names, step=51)
    for moe in ranks:
        moe.pool.check_invariants()  # type: ignore[union-attr]
        pool = moe.pool
        for r, owner in enumerate(pool.row_owner):  # type: ignore[union-attr]
            if owner is not None:  # the planner's admissions copied the owners' weights into the rows
                assert torch.equal(pool.rows_gpu["w2"][r], pool.bank.row(*owner)["w2"])  # type: ignore[union-attr]


def test_reset_stats_restarts_the_device_counters_too() -> None:
    """`PooledMoE.reset_stats` starts every counter of `stats()` again: the pool's host counters and the device
    planner's, so a benchmark's warm-up traffic is not counted in its measured window."""
    moe, _ = build()
    host, _ = build()
    gpu = device_planned(moe)
    assert gpu.planner is not None
    warm, measured = steps(9, seed=7), steps(15, seed=8)
    for layer, ids in warm:
        gpu.planner.plan(layer, ids)
        host.pool.plan_step(layer, sorted(set(ids.flatten().tolist())))  # type: ignore[union-attr]
    assert moe.stats().misses > 0
    moe.reset_stats()
    host.reset_stats()  # the host path: the pool's counters only
    after_reset = moe.stats()
    assert (after_reset.hits, after_reset.misses, after_reset.admissions, after_reset.evictions) == (
        0,
        0,
        0,
        0,
    )
    assert after_reset.bytes_copied_to_rows == after_reset.bytes_read_host_view == 0
    for layer, ids in measured:
        gpu.planner.plan(layer, ids)
        host.pool.plan_step(layer, sorted(set(ids.flatten().tolist())))  # type: ignore[union-attr]
    got, want = moe.stats(), host.stats()
    assert got.misses > 0 and (got.hits, got.misses, got.admissions, got.evictions) == (
        want.hits,
        want.misses,
        want.admissions,
        want.evictions,
    )
    assert got.bytes_copied_to_rows == want.bytes_copied_to_rows


def test_lanes_wider_than_the_built_planner_are_refused() -> None:
    moe, _ = build()
    moe.set_decode_lanes(3)
    gpu = device_planned(moe)  # built for steps of <= 3 tokens
    assert gpu.max_decode_tokens == 3
    moe.set_decode_lanes(2)  # narrower: fine
    moe.set_decode_lanes(3)
    with pytest.raises(
        RuntimeError, match=r"steps of <= 3 tokens; call set_decode_lanes\(4\) before the first"
    ):
        moe.set_decode_lanes(4)
    assert moe.decode_lanes == 3


def test_layers_registered_after_allocate_are_refused() -> None:
    cfg = PoolConfig(pool_rows=3, device="cpu")
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.float32)
    moe.register_layer(4)
    moe.register_layer(4)
    moe.allocate()
    with pytest.raises(RuntimeError, match=r"register_layer\(\) after allocate\(\)/install\(\)"):
        moe.register_layer(4)
    assert moe.num_experts_per_layer == [4, 4]
