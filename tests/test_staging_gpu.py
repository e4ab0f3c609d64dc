"""Prefill staging on a CUDA device: chunked staging == the unstaged (host view) step bit for bit, the next
layer's chunks prefetched on a side stream, resident rows untouched, no sync for decode steps."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from tests.reference import random_expert_weights, random_routing

pytestmark = pytest.mark.gpu

H, I, E, K, L = 256, 128, 24, 4, 4


def _build(staging: bool, rows: int = 20, chunk: int = 5) -> PooledMoE:
    weights = random_expert_weights(L, E, H, I, torch.bfloat16, seed=21)
    cfg = PoolConfig(
        pool_rows=rows,
        device="cuda",
        prefill_staging=staging,
        staging_min_tokens=64,
        staging_chunk_experts=chunk,
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe


def _routed_nonresident(moe: PooledMoE, layer: int, ids: torch.Tensor) -> int:
    assert moe.pool is not None
    routed = torch.unique(ids[ids >= 0]).tolist()
    return sum(moe.pool.lookup(layer, e) >= moe.pool.num_rows for e in routed)


def test_staged_prefill_equals_host_view_and_prefetches_on_a_side_stream():
    staged, plain = _build(True), _build(False)
    assert staged.bank is not None and staged.bank.pinned and staged.stager is not None
    assert staged.stager.copy_stream is not None
    g = torch.Generator().manual_seed(5)
    T = 300
    rows_before = {n: t.clone() for n, t in staged.pool.rows_gpu.items()}
    routed = 0
    for layer in range(L):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        ids, w = random_routing(T, K, E, g)
        routed += _routed_nonresident(staged, layer, ids)
        out = staged.forward(layer, x, ids.cuda(), w.cuda(), admit_misses=False)
        if layer + 1 < L:  # the next layer's first chunks were issued on the side stream behind events
            inflight = list(staged.stager._inflight)
            assert inflight and all(c.layer == layer + 1 and c.copied is not None for c in inflight)
        ref = plain.forward(layer, x, ids.cuda(), w.cuda(), admit_misses=False)
        assert torch.equal(out, ref), f"layer {layer}: staged output differs from the host-view output"
    torch.cuda.synchronize()
    s = staged.stager.stats
    assert s.steps_staged == 1 and s.layers_staged == L and s.rows_staged - s.rows_unused == routed
    for n, t in staged.pool.rows_gpu.items():
        assert torch.equal(t, rows_before[n]), f"staging touched resident rows of {n}"


def _real_shape_stack(
    staging: bool, rows: int, chunk: int, dims: tuple[int, int, int, int, int]
) -> PooledMoE:
    h, i, e_num, k, layers = dims
    cfg = PoolConfig(
        pool_rows=rows,
        device="cuda",
        prefill_staging=staging,
        staging_min_tokens=512,
        staging_chunk_experts=chunk,
    )
    moe = PooledMoE(cfg, h, i, top_k=k, dtype=torch.bfloat16)
    for _ in range(layers):
        moe.register_layer(e_num)

    def loader(layer: int, expert: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(1000 * layer + expert)
        w13 = torch.randn(2 * i, h, generator=gen, device="cuda").mul_(0.02).bfloat16()
        w2 = torch.randn(h, i, generator=gen, device="cuda").mul_(0.02).bfloat16()
        return {"w13": w13, "w2": w2}

    moe.install(loader)
    return moe


def test_chunked_staging_at_a_qwen3_like_shape_equals_the_unstaged_step():
    dims = (2048, 768, 128, 8, 3)  # H, I, E, top-k, layers
    rows = 96  # 25% of the experts, layer-major: layer 0 holds 96, layers 1-2 none
    staged = _real_shape_stack(True, rows, 16, dims)
    assert staged.stager is not None and staged.stager.chunk_experts == 16
    plain = _real_shape_stack(False, rows, 16, dims)
    g = torch.Generator(device="cuda").manual_seed(7)
    for T in (2048, 600):  # two steps: the ring carries on from one step to the next
        for layer in range(dims[4]):
            x = torch.randn(T, dims[0], generator=g, device="cuda").bfloat16()
            logits = torch.randn(T, dims[2], generator=g, device="cuda")
            w, ids = torch.softmax(logits, -1).topk(dims[3], dim=-1)
            out = staged.forward(layer, x, ids, w, admit_misses=False)
            ref = plain.forward(layer, x, ids, w, admit_misses=False)
            assert torch.equal(out, ref), f"T={T} layer {layer}: max diff {(out - ref).abs().max()}"
    s = staged.stager.stats
    assert s.steps_staged == 2 and s.layers_staged == 6 and s.chunks_staged >= 2 * (2 * 128 + 32) // 16


def test_decode_sized_step_does_not_sync():
    moe = _build(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert moe.stager.begin_step(8, moe.pool.l2p_gpu) is False
    finally:
        torch.cuda.set_sync_debug_mode(0)
