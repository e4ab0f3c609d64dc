"""Prefill staging on the CPU: chunked streaming through the ring equals the unstaged step bit for bit.

The torch path runs the stager's passes (resident experts from rows, then each chunk from its ring buffer) and
must equal the unstaged pool and a dense per-token reference exactly, at awkward sizes: odd E, C not dividing
the non-resident count, one chunk per layer, C = 1, a layer with every expert resident, steps routing few
experts, skipped layers (prefetched chunks dropped), no prefetch. The copies are synchronous on the CPU; the
bookkeeping (ring, prefetch into the next layer, stats) is the one CUDA uses.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.staging import LayerStager, check_fits, consecutive_runs
from tests.reference import dense_reference, random_expert_weights, random_routing

H, I = 20, 12


@settings(max_examples=200, deadline=None)
@given(experts=st.sets(st.integers(0, 40)))
def test_runs_are_exact_and_minimal(experts):
    ordered = sorted(experts)
    runs = consecutive_runs(ordered)
    assert [e for r in runs for e in range(r.start, r.start + r.length)] == ordered
    for a, b in itertools.pairwise(runs):
        assert a.start + a.length < b.start, f"runs {a} and {b} touch: not minimal"


def _build(
    rows: int,
    staging: bool,
    min_tokens: int = 8,
    chunk: int = 4,
    layers: int = 3,
    E: int = 11,
    K: int = 3,
    priority: list[tuple[int, int]] | None = None,
    seed: int = 3,
):
    weights = random_expert_weights(layers, E, H, I, torch.float32, seed)
    cfg = PoolConfig(
        pool_rows=rows,
        device="cpu",
        prefill_staging=staging,
        staging_min_tokens=min_tokens,
        staging_chunk_experts=chunk,
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.float32)
    for _ in range(layers):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)], priority)
    return moe, weights


def _routed_nonresident(moe: PooledMoE, layer: int, ids: torch.Tensor) -> int:
    assert moe.pool is not None
    routed = torch.unique(ids[ids >= 0]).tolist()
    return sum(moe.pool.lookup(layer, e) >= moe.pool.num_rows for e in routed)


def _check_step(staged: PooledMoE, plain: PooledMoE, weights, T: int, g, num_experts: int | None = None):
    """One step through every layer: staged == unstaged == dense; returns routed non-resident experts."""
    E, K = staged.num_experts_per_layer[0], staged.top_k
    num_routed = 0
    for layer in range(len(staged.num_experts_per_layer)):
        hidden = torch.randn(T, H, generator=g)
        ids, w = random_routing(T, K, E, g)
        if num_experts is not None:  # route only a few experts: map ids onto them
            ids = torch.where(ids >= 0, ids % num_experts, ids)
        num_routed += _routed_nonresident(staged, layer, ids)
        out = staged.forward(layer, hidden, ids, w, admit_misses=False)
        ref = plain.forward(layer, hidden, ids, w, admit_misses=False)
        assert torch.equal(out, ref), f"layer {layer}: staged differs from the unstaged step"
        dense = dense_reference(hidden, ids, w, {e: weights[(layer, e)] for e in range(E)})
        assert torch.equal(out, dense), f"layer {layer}: staged differs from the dense reference"
    return num_routed


@pytest.mark.parametrize(
    "rows, chunk, E",
    [
        (7, 4, 11),  # odd E; 26 non-resident, C=4 does not divide the per-layer counts
        (7, 11, 11),  # C = E: one chunk per layer
        (5, 1, 9),  # C = 1: every expert its own chunk
        (12, 3, 13),
    ],
)
def test_chunked_staging_equals_unstaged_and_dense(rows, chunk, E):
    staged, weights = _build(rows, True, chunk=chunk, E=E)
    plain, _ = _build(rows, False, chunk=chunk, E=E)
    assert staged.stager is not None and plain.stager is None
    assert staged.stager.chunk_experts == chunk and staged.stager.num_buffers == LayerStager.NUM_BUFFERS
    g = torch.Generator().manual_seed(9)
    tables_before = staged.pool.l2p_host.clone()
    total = 0
    for T in (40, 5, 17):  # 5 < min_tokens: not staged
        routed = _check_step(staged, plain, weights, T, g)
        total += routed if T >= 8 else 0
    assert torch.equal(staged.pool.l2p_host, tables_before), "a staged step changed residency"
    s = staged.stager.stats
    assert s.steps_staged == 2 and s.layers_staged == 6 and s.chunks_staged > 0
    # Every routed non-resident expert staged exactly once per layer step; extra rows only from prefetch.
    assert s.rows_staged - s.rows_unused == total, s
    assert s.bytes_staged == s.rows_staged * staged.pool.row_bytes
    assert staged.stats().rows_staged == s.rows_staged and plain.stats().rows_staged == 0
    assert staged.stats().bytes_staged == s.bytes_staged > 0 and plain.stats().bytes_staged == 0
    # The staged steps read nothing through the host view; the decode-sized step did (both read it).
    assert staged.stats().bytes_read_host_view < plain.stats().bytes_read_host_view
    assert staged.stager.nbytes == LayerStager.buffer_bytes(staged.operands, chunk)


def test_layer_with_every_expert_resident_and_steps_routing_few_experts():
    E, L = 9, 3
    priority = [(0, e) for e in range(E)] + [(2, 0), (2, 4)]  # layer 0 fully resident, layer 1 none
    staged, weights = _build(11, True, chunk=2, E=E, layers=L, priority=priority)
    plain, _ = _build(11, False, chunk=2, E=E, layers=L, priority=priority)
    g = torch.Generator().manual_seed(4)
    total = _check_step(staged, plain, weights, 30, g)
    total += _check_step(staged, plain, weights, 12, g, num_experts=3)  # few experts routed per layer
    s = staged.stager.stats
    assert s.rows_staged - s.rows_unused == total and s.layers_staged == 2 * L


def test_prefetch_fills_the_ring_with_the_next_layers_chunks():
    staged, _ = _build(6, True, chunk=2, E=11, layers=3)
    stager = staged.stager
    g = torch.Generator().manual_seed(6)
    for layer in range(3):
        ids, w = random_routing(20, 3, 11, g)
        staged.forward(layer, torch.randn(20, H, generator=g), ids, w, admit_misses=False)
        inflight = list(stager._inflight)
        if (
            layer < 2
        ):  # the ring is full of the next layer's first chunks, in its ascending non-resident order
            assert len(inflight) == stager.num_buffers and {c.layer for c in inflight} == {layer + 1}
            nonres = stager._plan.nonresident[layer + 1]
            assert [e for c in inflight for e in c.experts] == nonres[: 2 * stager.num_buffers]
        else:
            assert inflight == []


def test_skipped_layer_drops_its_prefetched_chunks_and_no_prefetch_copies_nothing_ahead():
    staged, _ = _build(6, True, chunk=3)
    plain, _ = _build(6, False, chunk=3)
    g = torch.Generator().manual_seed(2)
    for layer in (0, 2):  # layer 1's prefetched chunks are dropped when layer 2 comes
        hidden = torch.randn(25, H, generator=g)
        ids, w = random_routing(25, 3, 11, g)
        out = staged.forward(layer, hidden, ids, w, admit_misses=False)
        assert torch.equal(out, plain.forward(layer, hidden, ids, w, admit_misses=False))
    assert staged.stager.stats.rows_unused > 0
    staged.stager = LayerStager(
        staged.operands, staged.bank, staged.pool.num_rows, torch.device("cpu"), 8, 3, prefetch=False
    )
    for layer in range(3):
        hidden = torch.randn(12, H, generator=g)
        ids, w = random_routing(12, 3, 11, g)
        out = staged.forward(layer, hidden, ids, w)
        assert torch.equal(out, plain.forward(layer, hidden, ids, w, admit_misses=False))
        assert not staged.stager._inflight  # nothing copied ahead
    assert staged.stager.stats.layers_staged == 3 and staged.stager.stats.rows_unused == 0


def test_staged_step_admits_nothing_but_decode_steps_do():
    moe, _ = _build(rows=4, staging=True, min_tokens=8)
    g = torch.Generator().manual_seed(1)
    ids, w = random_routing(10, 3, 11, g, pad_prob=0.0)
    moe.forward(0, torch.randn(10, H, generator=g), ids, w)
    assert moe.stats().admissions == 0
    ids, w = random_routing(1, 3, 11, g, pad_prob=0.0)
    moe.forward(0, torch.randn(1, H, generator=g), ids, w)  # new step (layer 0 again), decode-sized
    assert not moe.stager.active and moe.stats().admissions > 0


def test_passes_outside_a_step_refused():
    moe, _ = _build(rows=4, staging=True)
    with pytest.raises(RuntimeError, match="outside a staged step"):
        next(moe.stager.layer_passes(0, [1], with_tables=False))


def test_no_stager_when_everything_is_resident():
    moe, _ = _build(rows=33, staging=True)
    assert moe.bank is None and moe.stager is None


def test_bad_chunk_sizes_are_refused_naming_the_flag():
    with pytest.raises(
        ValueError, match=r"staging_chunk_experts=0 .*--moe-expert-pool-staging-chunk-experts"
    ):
        PoolConfig(pool_rows=4, device="cpu", staging_chunk_experts=0)
    with pytest.raises(ValueError, match=r"staging_chunk_experts=True must be an integer"):
        PoolConfig(pool_rows=4, device="cpu", staging_chunk_experts=True)
    moe, _ = _build(rows=4, staging=True)
    for bad in (0, 12):
        with pytest.raises(
            ValueError, match=r"must be in \[1, 11\].*--moe-expert-pool-staging-chunk-experts"
        ):
            LayerStager(moe.operands, moe.bank, 4, torch.device("cpu"), 8, chunk_experts=bad)
    # The PoolConfig default (16) is cut to the largest layer (11 experts) at installation.
    moe16, _ = _build(rows=4, staging=True, chunk=16)
    assert moe16.stager.chunk_experts == 11


def test_buffers_that_do_not_fit_are_refused_with_numbers():
    moe = PooledMoE(PoolConfig(pool_rows=8, device="cpu"), 4096, 2048, top_k=8, dtype=torch.bfloat16)
    needed = LayerStager.buffer_bytes(moe.operands, 16)
    assert needed == LayerStager.NUM_BUFFERS * 16 * (2 * 2048 * 4096 + 4096 * 2048) * 2
    with pytest.raises(
        ValueError, match=rf"needs {needed} bytes .* but {needed - 1} bytes are free.*--no-moe"
    ):
        check_fits(needed, needed - 1)
    check_fits(needed, needed)
