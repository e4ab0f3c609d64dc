"""Chunked staging on the kernel path (Triton's interpreter on the CPU): the passes (resident experts, then each
chunk through its own location table into one per-pair output, one combine) equal the unstaged kernel step bit
for bit (steps wider than the GEMV path), for a dense and a packed format, with several consecutive layers and
prefetch."""

from __future__ import annotations

import pytest
import torch

from bench.prefill import build
from pooled_runner.kernel_path import KernelPath
from pooled_runner.staging import LayerStager


@pytest.mark.parametrize(
    "fmt, H, I, chunk, frac",
    [("bf16", 40, 24, 2, 0.3), ("int4-g32", 64, 32, 3, 0.4), ("bf16", 40, 24, 7, 0.05)],
)
def test_kernel_staged_passes_equal_the_unstaged_kernel_step(fmt, H, I, chunk, frac):
    # T*K = 66 routed pairs over 7 experts: they share experts heavily (`distinct_share`), so the unstaged
    # int4 step takes the align path too (int4 / NVFP4 steps over mostly distinct experts take the GEMV path up
    # to GEMV_MAX_PAIRS, which rounds differently: `KernelPath.forward_staged`)
    E, K, L, T = 7, 3, 3, 22
    g = torch.Generator().manual_seed(11)
    moe = build((H, I, E, K, L), fmt, frac, "stage", g, "cpu", staging_min_tokens=4)
    assert moe.bank is not None and moe.pool is not None
    moe.stager = LayerStager(moe.operands, moe.bank, moe.pool.num_rows, torch.device("cpu"), 4, chunk)
    kernels = KernelPath(moe.format, moe.pool, moe.bank, H, I)
    assert moe.stager.begin_step(T, moe.pool.l2p_gpu)
    for layer in range(L):
        x = (torch.randn(T, H, generator=g) * 0.5).bfloat16()
        logits = torch.randn(T, E, generator=g)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        ids[3, 1] = -1  # padding adds nothing
        experts = torch.unique(ids[ids >= 0]).tolist()
        passes = moe.stager.layer_passes(layer, experts, with_tables=True)
        out = kernels.forward_staged(layer, x, ids, w, passes)
        ref = kernels.forward(layer, x, ids, w)  # the bank's host view read in place
        assert torch.equal(out, ref), (
            f"{fmt} layer {layer}: max diff {(out.float() - ref.float()).abs().max()}"
        )
        assert out.abs().sum() > 0
    s = moe.stager.stats
    assert s.layers_staged == L and s.chunks_staged >= L and s.rows_staged > 0
