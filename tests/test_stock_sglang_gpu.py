"""The copy of stock SGLang's fused MoE (bench/stock_sglang/) on the GPU, bf16, at the Qwen3-like shape and an odd
expert count, against the plain torch reference: what bench/stock_compare.py times is the MoE."""

from __future__ import annotations

import pytest
import torch
import triton

from bench.stock_sglang import align, moe

pytestmark = pytest.mark.gpu


# the last four: stock's CUDA align (its torch stand-in): 128 pairs; 40 tokens (the CUDA top-k sum's stand-in);
# 8 experts, top-2 (Mixtral-like, smaller); top-1
@pytest.mark.parametrize(("M", "K", "E", "H", "I"), [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768), (8, 8, 128, 2048, 768), (7, 3, 257, 520, 72), (16, 8, 128, 2048, 768), (40, 8, 128, 2048, 768), (5, 2, 8, 1024, 3584), (3, 1, 8, 520, 72)])  # fmt: skip
def test_stock_matches_reference_on_gpu(M, K, E, H, I):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(M * 7919 + E)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
    weights, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
    ids = ids.int()
    configs = moe.pick_configs(M, E, I, torch.cuda.get_device_name(), triton.__version__)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    aligned = None
    if moe.uses_cuda_align(ids.numel(), E):
        aligned = align.align_stand_in(ids, configs[0]["BLOCK_SIZE_M"], E)
    out.copy_(moe.stock_fused_experts(x, w13, w2, weights, ids, configs, pdl=pdl, aligned=aligned))
    want = moe.reference_fused_experts(x, w13, w2, weights, ids).float()
    diff = (out.float() - want).abs()
    tol = 2e-2 * want.abs().max().item()
    assert not out.isnan().any(), "stock left output entries unwritten"
    assert diff.max().item() <= tol, (
        f"max |diff| {diff.max().item():.3g} > {tol:.3g} at {divmod(int(diff.argmax()), H)}"
    )
