"""Prefill staging on a CUDA device: staged == host view, side-stream prefetch, no sync for decode steps."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from tests.reference import random_expert_weights, random_routing

pytestmark = pytest.mark.gpu

H, I, E, K, L = 256, 128, 24, 4, 4


def _build(staging: bool, rows: int = 20) -> PooledMoE:
    weights = random_expert_weights(L, E, H, I, torch.bfloat16, seed=21)
    cfg = PoolConfig(pool_rows=rows, device="cuda", prefill_staging=staging, staging_min_tokens=64)
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe


def test_staged_prefill_equals_host_view_and_prefetches_on_a_side_stream():
    staged, plain = _build(True), _build(False)
    assert staged.bank is not None and staged.bank.pinned
    g = torch.Generator().manual_seed(5)
    T = 300
    rows_before = {n: t.clone() for n, t in staged.pool.rows_gpu.items()}
    for layer in range(L):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        ids, w = random_routing(T, K, E, g)
        out = staged.forward(layer, x, ids.cuda(), w.cuda(), admit_misses=False)
        if layer + 1 < L:  # the next layer's copy was issued on the side stream before this layer computed
            nxt = (layer + 1) % 2
            assert staged.stager._buffer_layer[nxt] == layer + 1 and staged.stager._copied[nxt] is not None
        ref = plain.forward(layer, x, ids.cuda(), w.cuda(), admit_misses=False)
        assert torch.equal(out, ref), f"layer {layer}: staged output differs from the host-view output"
    torch.cuda.synchronize()
    s = staged.stager.stats
    assert s.steps_staged == 1 and s.layers_staged == L and s.rows_staged == L * E - 20
    for n, t in staged.pool.rows_gpu.items():
        assert torch.equal(t, rows_before[n]), f"staging touched resident rows of {n}"


def test_decode_sized_step_does_not_sync():
    moe = _build(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert moe.stager.begin_step(8, moe.pool.l2p_gpu) is False
    finally:
        torch.cuda.set_sync_debug_mode(0)
