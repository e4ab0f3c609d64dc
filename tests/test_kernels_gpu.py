"""GPU tests of the pooled MoE kernels at real sizes (run by scripts/gpu_check.sh; skipped without CUDA).

Shapes from DESIGN.md §4: DeepSeek-like (H 7168, I 2048, E 256, top-8) and Qwen3-30B-like (H 2048, I 768,
E 128, top-8). References are independent: fp32 matmuls per logical expert from the dense weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import assert_close

pytestmark = pytest.mark.gpu

SHAPES = {"deepseek": (7168, 2048, 256, 8), "qwen3": (2048, 768, 128, 8)}
MS = [1, 2, 4, 8, 16, 64, 512, 4096]


def _kernels():
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
    """Fill freed caching-allocator blocks with NaN so unwritten outputs show up."""
    free = torch.cuda.mem_get_info()[0]
    junk = torch.full((min(free // 4, 8 << 30) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


@pytest.fixture(scope="module")
def resident_layers():
    """bf16 layers of both shapes, every expert in a pool row (codes = a random permutation of rows)."""
    fused_moe, operands = _kernels()
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (H, I, E, _) in SHAPES.items():
        w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
        perm = torch.randperm(E, generator=g, device="cuda")
        pool = {"w13": w13[perm].contiguous(), "w2": w2[perm].contiguous()}  # row r holds expert perm[r]
        l2p = torch.empty(E, dtype=torch.int32, device="cuda")
        l2p[perm] = torch.arange(E, dtype=torch.int32, device="cuda")
        fmt = operands.KernelFormat(0)
        p13, p2 = fused_moe.make_projections(fmt, pool, None, H, I)
        out[name] = (w13, w2, l2p, fmt, p13, p2)
        del pool
    yield out
    out.clear()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_resident_real_shapes(resident_layers, shape, M):
    fused_moe, _ = _kernels()
    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = resident_layers[shape]
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"{shape} M={M}")


def test_graph_replay_with_new_routing_equals_eager(resident_layers):
    fused_moe, _ = _kernels()
    H, I, E, K = SHAPES["qwen3"]
    w13, w2, l2p, fmt, p13, p2 = resident_layers["qwen3"]
    g = torch.Generator(device="cuda").manual_seed(5)
    M = 8
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    # a pinned host view of the layer; 1/8 of the experts are read through it
    bank = {"w13": w13.cpu().pin_memory(), "w2": w2.cpu().pin_memory()}
    p13, p2 = fused_moe.make_projections(fmt, {"w13": p13.weight, "w2": p2.weight}, bank, H, I)
    l2p = l2p.clone()
    host = torch.arange(0, E, 8, device="cuda")
    l2p[host] = (E + host).int()
    fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)
    side = torch.cuda.Stream()
    for step in range(3):
        new_ids, new_w = routing(M, K, E, g)
        if step == 2:
            new_ids[0, 1] = -1  # padding inside the graph
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(M, H, generator=g, device="cuda").bfloat16())
        with torch.cuda.stream(side):  # unrelated work beside the replay
            busy = torch.randn(4096, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda")
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)
        assert torch.equal(out, eager), f"step {step}: replay differs from eager"
        del busy


QUANT_FORMATS = ["bf16", "int4-g128", "int4-g64-zp", "int4-g32", "fp8", "fp8-b128", "nvfp4"]


MIXED_CASES = [(n, M) for n in QUANT_FORMATS for M in ([1, 8, 64, 512] if n == "bf16" else [1, 64])]


@pytest.mark.parametrize(("name", "M"), MIXED_CASES)
def test_pooled_moe_kernel_path_mixed_rows(name, M):
    """PooledMoE on CUDA (the kernel path of moe.py) with a pinned bank: rows, host rows, every format."""
    from pooled_runner import PoolConfig, PooledMoE
    from pooled_runner.formats import make_format

    H, I, _, K = SHAPES["qwen3"]
    E, L, R = 16, 2, 12  # 32 experts, 12 rows: many host-view reads
    fmt = make_format(name, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(len(name) * 10 + M)
    rows = {}
    for layer in range(L):
        for e in range(E):
            w13 = torch.randn(2 * I, H, generator=g, device="cuda") / H**0.5
            w2 = torch.randn(H, I, generator=g, device="cuda") / I**0.5
            rows[(layer, e)] = {k: v.cpu() for k, v in fmt.quantize(w13, w2).items()}
    # Staging off: this test is about host-view reads (a staged 512-token step reads the staging buffer).
    cfg = PoolConfig.resolve(pool_rows=R, device="cuda", weight_format=name, prefill_staging=False)
    moe = PooledMoE(cfg, H, I, K)
    for _ in range(L):
        moe.register_layer(E)
    moe.install(lambda layer, e: rows[(layer, e)])
    assert moe.bank is not None and moe.bank.pinned
    for layer in range(L):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids, w = routing(M, K, E, g)
        out = moe.forward(layer, x, ids, w, admit_misses=(layer == 0))
        dense = {e: fmt.expert_weights({k: v.cuda() for k, v in rows[(layer, e)].items()}) for e in range(E)}
        ref = gpu_reference(x, ids, w, lambda e, d=dense: d[e][0], lambda e, d=dense: d[e][1])
        assert_close(out, ref, f"{name} M={M} layer={layer}")
    assert moe.stats().bytes_read_host_view > 0
    moe.bank.close()


def test_pageable_bank_refused():
    _, operands = _kernels()
    pool = {"w13": torch.empty(2, 64, 32, dtype=torch.bfloat16, device="cuda")}
    bank = {"w13": torch.empty(4, 64, 32, dtype=torch.bfloat16)}  # pageable
    with pytest.raises(ValueError, match="pageable"):
        operands.make_projection(operands.KernelFormat(0), "w13", pool, bank, 64, 32)


def test_bank_past_32_gib():
    """A host-view weight tensor > 32 GiB, read at experts placed past 2^31 x 16 B (the Marlin bound)."""
    fused_moe, operands = _kernels()
    H, I = 7168, 2048
    row13 = 2 * I * H * 2
    E = (2**35) // row13 + 8  # w13 bank > 32 GiB
    cudart = torch.cuda.cudart()
    bank = {
        "w13": torch.empty((E, 2 * I, H), dtype=torch.bfloat16),
        "w2": torch.empty((E, H, I), dtype=torch.bfloat16),
    }
    assert bank["w13"].numel() * 2 > 2**35
    for t in bank.values():
        assert int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0
    try:
        g = torch.Generator(device="cuda").manual_seed(9)
        far = [E - 1, E - 3, E - 6]  # byte offsets past 2^35 in w13
        assert all(e * row13 > 2**35 for e in far)
        dense = {}
        for e in far:
            w13 = (torch.randn(2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
            w2 = (torch.randn(H, I, generator=g, device="cuda") / I**0.5).bfloat16()
            bank["w13"][e].copy_(w13)
            bank["w2"][e].copy_(w2)
            dense[e] = (w13, w2)
        R = 1
        pool = {"w13": torch.zeros(R, 2 * I, H, dtype=torch.bfloat16, device="cuda")}
        pool["w2"] = torch.zeros(R, H, I, dtype=torch.bfloat16, device="cuda")
        l2p = (R + torch.arange(E, dtype=torch.int32)).cuda()
        fmt = operands.KernelFormat(0)
        p13, p2 = fused_moe.make_projections(fmt, pool, bank, H, I)
        ids = torch.tensor([far, far[::-1]], device="cuda")
        w = torch.rand(2, 3, generator=g, device="cuda")
        x = torch.randn(2, H, generator=g, device="cuda").bfloat16()
        out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)
        ref = gpu_reference(x, ids, w, lambda e: dense[e][0], lambda e: dense[e][1])
        assert_close(out, ref, "bank past 32 GiB")
    finally:
        torch.cuda.synchronize()
        for t in bank.values():
            cudart.cudaHostUnregister(t.data_ptr())


# ---- the GEMV decode path (kernels/gemv.py, variant="gemv") ---------------------------------------------------
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemv_bf16_resident_real_shapes(resident_layers, shape, M):
    fused_moe, _ = _kernels()
    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = resident_layers[shape]
    g = torch.Generator(device="cuda").manual_seed(100 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv")
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"gemv {shape} M={M}")


@pytest.mark.parametrize("variant", ["align-fc", "inline"])
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_combine_variants_real_shapes(resident_layers, shape, M, variant):
    """Combine fused into gemm2 (and the align inside the gemm programs): the align path's output."""
    fused_moe, _ = _kernels()
    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = resident_layers[shape]
    g = torch.Generator(device="cuda").manual_seed(200 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    if M > 1:
        ids[1] = -1  # a token with no pair here: its row is zeros
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant=variant)
    align = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align")
    assert_close(out, align, f"{variant} vs align {shape} M={M}", rel=1e-3)
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"{variant} {shape} M={M}")


@pytest.mark.parametrize(
    ("name", "M", "variant"),
    [(n, 1, "gemv") for n in QUANT_FORMATS]
    + [(n, 8, "gemv") for n in ("bf16", "int4-g128", "int4-g128-zp", "nvfp4")]
    + [(n, M, "inline") for n in ("bf16", "int4-g32", "nvfp4") for M in (1, 4)]
    + [(n, M, "gemv-split3") for n in ("int4-g128", "nvfp4") for M in (1, 8)]
    + [(n, 16, "gemv") for n in ("int4-g128", "nvfp4")],  # 128 pairs: the wide schedule
)
def test_decode_variants_formats_mixed_rows(name, M, variant):
    """Decode variants for every format at the Qwen3-like shape: pool rows, pinned host rows, an expert not
    here. gemv-split3: the GEMV path with K tiles of 256 at most (NVFP4's default takes 512) and gate_up's K
    split over 3 programs (8 K tiles of 256: 3, 3, 2) and down's over 3 (3 K tiles of 256: one each)."""
    import dataclasses

    from pooled_runner.kernels.gemv import gemv_configs

    from tests.kernel_helpers import build_layer

    fused_moe, operands = _kernels()
    H, I, _, K = SHAPES["qwen3"]
    E, R = 12, 8
    cpu = torch.Generator().manual_seed(len(name) + M)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, cpu, device="cuda")
    bank = {k: v.pin_memory() for k, v in bank.items()}
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, bank, H, I)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    if variant == "gemv-split3":
        base = gemv_configs(H, I, fmt.fmt, M * K, fmt.group)
        bk1, bk2 = min(base.block_k1, 256), min(base.block_k2, 256)
        cfg = dataclasses.replace(base, split_k1=3, split_k2=3, block_k1=bk1, block_k2=bk2)
        out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=cfg)
    else:
        out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant=variant)
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
    assert_close(out, ref, f"{variant} {name} M={M}")
    align = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align")
    assert_close(out, align, f"{variant} vs align {name} M={M}")


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("bf16", "two"),
        ("int4-g128", "two"),
        ("nvfp4", "one"),
        ("bf16", "one"),
        ("bf16", "one by id"),
        ("bf16", "inline"),
        ("int4-g128", "align-fc"),
        ("int4-g128", "split"),
        ("nvfp4", "wide"),
    ],
)
def test_gemv_graph_replay_equals_eager(name, mode):
    """Captured GEMV steps replayed with new routing (host rows, padding) equal eager two-launch calls bitwise:
    the arrival counters (and in one launch the tickets and per-pair waits) are back at zero after every
    replay, and no wait timed out. wide: 16 tokens (128 pairs, the 128-wide schedule), two launches."""
    import dataclasses

    from pooled_runner.kernels import gemv

    from tests.kernel_helpers import build_layer

    fused_moe, operands = _kernels()
    H, I, _, K = SHAPES["qwen3"]
    E, R, M = 16, 10, 16 if mode == "wide" else 4
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, torch.Generator().manual_seed(3), device="cuda")
    bank = {k: v.pin_memory() for k, v in bank.items()}
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, bank, H, I)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    base = gemv.gemv_configs(H, I, fmt.fmt, M * K, fmt.group)
    if mode == "split":  # gate_up's K over 3 programs, down's over 2: compared with eager split calls
        # (parts summed in split order, not arrival order: fp32 parts in another order can round differently)
        base = dataclasses.replace(base, split_k1=3, split_k2=2)
    cfg = (
        base
        if mode in ("two", "split", "wide")
        # one launch compiles both tiles alike: down's own register cap (NVFP4's Qwen3-like default) and peel reset
        else dataclasses.replace(
            base, one_launch=True, tickets=mode == "one", down_max_registers=-1, down_peel=False
        )
    )
    variant = mode if mode in ("inline", "align-fc") else "gemv"

    def run(c=cfg, v=variant):
        return fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant=v, gemv_config=c)

    run()  # compile and allocate the counters before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(4):
        new_ids, new_w = routing(M, K, E, g)
        if step == 2:
            new_ids[1, 3] = -1
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(M, H, generator=g, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(base) if variant == "gemv" else run()), f"step {step}: replay != eager"
    assert gemv.spin_timeouts(x.device) == 0
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("name", ["int4-g128", "int4-g64-zp", "int4-g32"])
def test_int4_half_math_equals_fp32_tiles(name, M, monkeypatch):
    """moe_gemm.HALF_INT4 (int4 MMA tiles in packed bf16 math, the default): bitwise the fp32-math tiles."""
    from pooled_runner.kernels import moe_gemm

    from tests.kernel_helpers import build_layer

    fused_moe, operands = _kernels()
    H, I, _, K = SHAPES["qwen3"]
    E, R = 12, 12
    fmt_obj, pool, _, l2p = build_layer(name, H, I, E, R, torch.Generator().manual_seed(M), device="cuda")
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, None, H, I)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    monkeypatch.setattr(moe_gemm, "HALF_INT4", False)  # the fp32-math tiles (HALF_INT4 is the default)
    base = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align")
    monkeypatch.setattr(moe_gemm, "HALF_INT4", True)
    assert torch.equal(fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align"), base)
