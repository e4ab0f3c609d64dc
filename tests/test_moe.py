"""The pooled forward against the independent dense reference, over many random configurations."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from tests.reference import dense_reference, random_expert_weights, random_routing

H, I = 24, 10  # awkward on purpose: not powers of two


def build(num_layers: int, E: int, K: int, rows: int, dtype: torch.dtype, seed: int):
    weights = random_expert_weights(num_layers, E, H, I, dtype, seed)
    moe = PooledMoE(PoolConfig.resolve(pool_rows=rows, device="cpu"), H, I, top_k=K, dtype=dtype)
    for _ in range(num_layers):
        moe.register_layer(E)
    moe.install(lambda layer, expert: weights[(layer, expert)])
    return moe, weights


CASES = [
    (T, E, K, frac)
    for T, E, K, frac in itertools.product([0, 1, 7, 64], [1, 3, 16, 60], [1, 2, 8], ["topk", "half", "all"])
    if K <= E
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "E", "K", "frac"), CASES)
def test_forward_bit_identical_to_dense_reference(T, E, K, frac, dtype):
    num_layers = 2
    rows = {"topk": K, "half": max(K, (num_layers * E) // 2), "all": num_layers * E}[frac]
    seed = zlib.crc32(f"{T},{E},{K},{frac},{dtype}".encode()) % 10_000
    moe, weights = build(num_layers, E, K, rows, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(3):  # several steps so residency changes between them
        layer = step % num_layers
        hidden = torch.randn(T, H, generator=g).to(dtype)
        ids, topk_w = random_routing(T, K, E, g)
        out = moe.forward(layer, hidden, ids, topk_w)
        ref = dense_reference(hidden, ids, topk_w, {e: weights[(layer, e)] for e in range(E)})
        assert out.dtype == dtype and out.shape == (T, H)
        mismatch = (out != ref).nonzero()
        assert mismatch.numel() == 0, f"step {step}: first mismatches at {mismatch[:5].tolist()}"
        moe.pool.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_rows_equals_topk_rows(dtype):
    E, K, L = 17, 4, 3
    full, _ = build(L, E, K, L * E, dtype, seed=5)
    tight, _ = build(L, E, K, K, dtype, seed=5)
    assert full.bank is None and tight.bank is not None
    g = torch.Generator().manual_seed(6)
    for step in range(12):
        layer = step % L
        hidden = torch.randn(9, H, generator=g).to(dtype)
        ids, w = random_routing(9, K, E, g)
        assert torch.equal(full.forward(layer, hidden, ids, w), tight.forward(layer, hidden, ids, w))
    stats = tight.stats()
    assert stats.misses > 0 and stats.admissions > 0 and stats.evictions > 0
    assert full.stats().misses == 0


def test_host_view_reads_match_admission():
    """Reading misses in place (no admission) gives the same output and leaves the tables unchanged."""
    E, K = 12, 3
    moe, weights = build(2, E, K, K, torch.float32, seed=11)
    before = moe.pool.l2p_host.clone()
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(5, H, generator=g)
    ids, w = random_routing(5, K, E, g, pad_prob=0.0)
    out = moe.forward(1, hidden, ids, w, admit_misses=False)
    assert torch.equal(moe.pool.l2p_host, before)
    assert moe.stats().bytes_read_host_view > 0
    assert torch.equal(out, dense_reference(hidden, ids, w, {e: weights[(1, e)] for e in range(E)}))


def test_all_padding_gives_zeros_and_touches_nothing():
    moe, _ = build(1, 5, 2, 2, torch.float32, seed=3)
    hidden = torch.randn(4, H)
    ids = torch.full((4, 2), -1)
    out = moe.forward(0, hidden, ids, torch.rand(4, 2))
    assert torch.equal(out, torch.zeros(4, H))
    assert moe.stats().hits == 0 and moe.stats().misses == 0


def test_int32_ids_accepted():
    moe, weights = build(1, 6, 2, 3, torch.float32, seed=4)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, H, generator=g)
    ids, w = random_routing(3, 2, 6, g)
    out = moe.forward(0, hidden, ids.to(torch.int32), w)
    assert torch.equal(out, dense_reference(hidden, ids, w, {e: weights[(0, e)] for e in range(6)}))
