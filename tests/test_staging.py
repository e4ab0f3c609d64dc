"""Prefill staging on the CPU: runs are exact and minimal; a staged step equals the host-view step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.staging import nonresident_runs
from tests.reference import dense_reference, random_expert_weights, random_routing

H, I = 20, 12


@settings(max_examples=200, deadline=None)
@given(codes=st.lists(st.integers(-1, 30), max_size=40), rows=st.integers(1, 12))
def test_runs_are_exact_and_minimal(codes, rows):
    runs = nonresident_runs(codes, rows)
    covered = [e for r in runs for e in range(r.start, r.start + r.length)]
    assert covered == [e for e, c in enumerate(codes) if c >= rows]  # exact, in order, no duplicates
    assert all(r.length >= 1 for r in runs)
    for a, b in itertools.pairwise(runs):
        assert a.start + a.length < b.start, f"runs {a} and {b} touch: not minimal"


def test_runs_examples():
    assert nonresident_runs([], 4) == []
    assert [(r.start, r.length) for r in nonresident_runs([5, 6, 0, 7, -1, 9, 10], 4)] == [
        (0, 2),
        (3, 1),
        (5, 2),
    ]


def _build(
    rows: int, staging: bool, min_tokens: int, seed: int = 3, layers: int = 3, E: int = 11, K: int = 3
):
    weights = random_expert_weights(layers, E, H, I, torch.float32, seed)
    cfg = PoolConfig(pool_rows=rows, device="cpu", prefill_staging=staging, staging_min_tokens=min_tokens)
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.float32)
    for _ in range(layers):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe, weights


def test_staged_steps_equal_host_view_and_leave_rows_alone():
    staged, weights = _build(rows=7, staging=True, min_tokens=16)
    plain, _ = _build(rows=7, staging=False, min_tokens=16)
    assert staged.stager is not None and plain.stager is None
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        T = 40 if step != 1 else 5  # step 1 is decode-sized: not staged
        hiddens = [torch.randn(T, H, generator=g) for _ in range(3)]
        routes = [random_routing(T, 3, 11, g) for _ in range(3)]
        tables_before = staged.pool.l2p_host.clone()
        for layer in range(3):
            ids, w = routes[layer]
            out = staged.forward(layer, hiddens[layer], ids, w, admit_misses=False)
            ref = plain.forward(layer, hiddens[layer], ids, w, admit_misses=False)
            assert torch.equal(out, ref), f"step {step} layer {layer}"
            dense = dense_reference(hiddens[layer], ids, w, {e: weights[(layer, e)] for e in range(11)})
            assert torch.equal(out, dense)
        assert torch.equal(staged.pool.l2p_host, tables_before), "a staged step changed residency"
    s = staged.stager.stats
    assert s.steps_staged == 2 and s.layers_staged == 6
    assert s.rows_staged == 2 * (3 * 11 - 7) and s.bytes_staged == s.rows_staged * staged.pool.row_bytes
    assert staged.stats().rows_staged == s.rows_staged and plain.stats().rows_staged == 0
    # The staged steps read nothing through the host view; the decode-sized step did.
    assert staged.stats().bytes_read_host_view < plain.stats().bytes_read_host_view


def test_staged_step_admits_nothing_but_decode_steps_do():
    moe, _ = _build(rows=4, staging=True, min_tokens=8)
    g = torch.Generator().manual_seed(1)
    ids, w = random_routing(10, 3, 11, g, pad_prob=0.0)
    moe.forward(0, torch.randn(10, H, generator=g), ids, w)
    assert moe.stats().admissions == 0
    ids, w = random_routing(1, 3, 11, g, pad_prob=0.0)
    moe.forward(0, torch.randn(1, H, generator=g), ids, w)  # new step (layer 0 again), decode-sized
    assert not moe.stager.active and moe.stats().admissions > 0


def test_source_outside_a_step_refused():
    moe, _ = _build(rows=4, staging=True, min_tokens=8)
    with pytest.raises(RuntimeError, match="outside a staged step"):
        moe.stager.source(0)


def test_no_stager_when_everything_is_resident():
    moe, _ = _build(rows=33, staging=True, min_tokens=8)
    assert moe.bank is None and moe.stager is None


def test_buffers_that_do_not_fit_are_refused_with_numbers():
    from pooled_runner.staging import LayerStager, check_fits

    moe = PooledMoE(PoolConfig(pool_rows=8, device="cpu"), 4096, 2048, top_k=8, dtype=torch.bfloat16)
    needed = LayerStager.buffer_bytes(moe.operands, 256)
    assert needed == 2 * 256 * (2 * 2048 * 4096 + 4096 * 2048) * 2
    with pytest.raises(
        ValueError, match=rf"needs {needed} bytes .* but {needed - 1} bytes are free.*--no-moe"
    ):
        check_fits(needed, needed - 1)
    check_fits(needed, needed)


def test_staging_without_prefetch_stages_each_layer_when_needed():
    from pooled_runner.staging import LayerStager

    moe, _ = _build(rows=6, staging=True, min_tokens=8)
    plain, _ = _build(rows=6, staging=False, min_tokens=8)
    moe.stager = LayerStager(
        moe.operands, moe.bank, moe.pool.num_rows, torch.device("cpu"), 8, prefetch=False
    )
    g = torch.Generator().manual_seed(2)
    for layer in range(3):
        hidden = torch.randn(12, H, generator=g)
        ids, w = random_routing(12, 3, 11, g)
        assert torch.equal(
            moe.forward(layer, hidden, ids, w), plain.forward(layer, hidden, ids, w, admit_misses=False)
        )
        assert moe.stager._buffer_layer[(layer + 1) % 2] != layer + 1  # nothing copied ahead
    assert moe.stager.stats.layers_staged == 3
