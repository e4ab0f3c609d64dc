"""Shared pieces of the kernel GPU tests (`test_kernels_gpu.py`, `test_decode_variants_gpu.py` and the other
`*_gpu.py` kernel files): the real shapes, independent fp32 references, routing and an allocator poison.

Shapes from DESIGN.md §4: DeepSeek-like (H 7168, I 2048, E 256, top-8) and Qwen3-30B-like (H 2048, I 768,
E 128, top-8). References are independent: fp32 matmuls per logical expert from the dense weights.
"""

from __future__ import annotations

import os

import torch

# (H, I, E, top-k) of the two real shapes
SHAPES = {"deepseek": (7168, 2048, 256, 8), "qwen3": (2048, 768, 128, 8)}
QUANT_FORMATS = ["bf16", "int4-g128", "int4-g64-zp", "int4-g32", "fp8", "fp8-b128", "nvfp4"]


def kernel_modules():
    from pooled_runner.kernels import fused_moe, operands

    return fused_moe, operands


def gpu_reference(x, ids, weights, dense_w13, dense_w2, routed_here=None):
    """`sum_k w * mlp_e(x)`: fp32 matmuls (no TF32), gate/up and activation rounded to x's dtype."""
    T, K = ids.shape
    H = x.shape[1]
    y = torch.zeros(T, K, H, dtype=x.dtype, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        if routed_here is not None and not routed_here[e]:
            continue
        t, k = (ids == e).nonzero(as_tuple=True)
        w13, w2 = dense_w13(e).float(), dense_w2(e).float()
        I = w13.shape[0] // 2
        gu = (x[t].float() @ w13.T).to(x.dtype).float()
        act = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype)
        y[t, k] = (act.float() @ w2.T).to(x.dtype)
    ok = ids >= 0
    if routed_here is not None:
        ok &= routed_here[ids.clamp(min=0)]
    return (y.float() * torch.where(ok, weights.float(), 0.0)[..., None]).sum(1).to(x.dtype)


def pooled_reference(x, ids, weights, l2p, E, p13, p2, fmt, routed_only=True):
    """`gpu_reference` of a pooled layer: each expert's dense weights read back from its row (pool or host view,
    `fused_moe.dense_row`); `routed_only`: experts without a location (code -1) contribute nothing."""
    from pooled_runner.kernels.fused_moe import dense_row

    codes = l2p.cpu()
    return gpu_reference(
        x,
        ids,
        weights,
        lambda e: dense_row(p13, fmt, int(codes[e]), torch.bfloat16).cuda(),
        lambda e: dense_row(p2, fmt, int(codes[e]), torch.bfloat16).cuda(),
        routed_here=l2p[:E] >= 0 if routed_only else None,
    )


def routing(T, K, E, g, device="cuda"):
    logits = torch.randn(T, E, generator=g, device=device)
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return ids, w


def poison_allocator():
    """Fill freed caching-allocator blocks with NaN so unwritten outputs show up. The block stays reserved by this
    process's caching allocator, so under pytest-xdist (scripts/gpu_check.sh) each of the workers sharing the GPU
    poisons its share of 8 GB: six workers of 8 GB each left too little for the one holding the resident layers."""
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    free = torch.cuda.mem_get_info()[0]
    size = min(free // (4 * num_workers), (8 << 30) // num_workers)
    junk = torch.full((size // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def resident_layer_set() -> dict:
    """bf16 layers of both shapes (the `resident_layers` fixture of test_kernels_gpu.py), every expert in a pool
    row (codes = a random permutation of rows)."""
    fused_moe, operands = kernel_modules()
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (H, I, E, _) in SHAPES.items():
        # drawn in bf16 and scaled in place (fp32 draws peak at ~60 GB for the DeepSeek-like layer)
        w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16).div_(H**0.5)
        w2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16).div_(I**0.5)
        perm = torch.randperm(E, generator=g, device="cuda")
        pool = {"w13": w13[perm].contiguous(), "w2": w2[perm].contiguous()}  # row r holds expert perm[r]
        l2p = torch.empty(E, dtype=torch.int32, device="cuda")
        l2p[perm] = torch.arange(E, dtype=torch.int32, device="cuda")
        fmt = operands.KernelFormat(0)
        p13, p2 = fused_moe.make_projections(fmt, pool, None, H, I)
        out[name] = (w13, w2, l2p, fmt, p13, p2)
        del pool
    return out
