"""GPU tests of the pooled MoE kernels at real sizes (run by scripts/gpu_check.sh; skipped without CUDA): every
expert resident at both real shapes (align path, GEMV, combine fused into gemm2), graph replay, every format over
pool and pinned host rows, the bank's limits. The decode variants of every format and the GEMV graph replay are
in `test_decode_variants_gpu.py`; shapes and references in `kernel_gpu_helpers.py`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.kernel_gpu_helpers import (
    QUANT_FORMATS,
    SHAPES,
    gpu_reference,
    kernel_modules,
    poison_allocator,
    resident_layer_set,
    routing,
)
from tests.kernel_helpers import assert_close

pytestmark = pytest.mark.gpu

MS = [1, 2, 4, 8, 16, 64, 512, 4096]
# the tests of the real-shape bf16 layers (about 45 GB with their permuted pool copies; this module's and
# test_splitk_gpu.py's) run in one process, apart from the pytest-xdist workers of the other GPU tests
# (scripts/gpu_pytest.sh): two processes holding such layers would not fit an H100's 80 GB
RESIDENT_GROUP = pytest.mark.real_shape_layers


@pytest.fixture(scope="module")
def resident_layers():
    """bf16 layers of both real shapes, every expert in a pool row (`kernel_gpu_helpers.resident_layer_set`). Every
    test that reads them is in this module, so they are built once per run (tens of GiB at the DeepSeek-like
    shape: a second module building them while the first one's were still held ran out of memory on an H100)."""
    out = resident_layer_set()
    yield out
    out.clear()
    gc.collect()  # graphs and closures of the tests may sit in reference cycles that hold the weights
    torch.cuda.empty_cache()


@RESIDENT_GROUP
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_resident_real_shapes(resident_layers, shape, M):
    fused_moe, _ = kernel_modules()
    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = resident_layers[shape]
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt)
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"{shape} M={M}")


@RESIDENT_GROUP
def test_graph_replay_with_new_routing_equals_eager(resident_layers):
    fused_moe, _ = kernel_modules()
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


@RESIDENT_GROUP
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemv_bf16_resident_real_shapes(resident_layers, shape, M):
    fused_moe, _ = kernel_modules()
    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = resident_layers[shape]
    g = torch.Generator(device="cuda").manual_seed(100 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv")
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"gemv {shape} M={M}")


@RESIDENT_GROUP
@pytest.mark.parametrize("variant", ["align-fc", "inline"])
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_combine_variants_real_shapes(resident_layers, shape, M, variant):
    """Combine fused into gemm2 (and the align inside the gemm programs): the align path's output."""
    fused_moe, _ = kernel_modules()
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
    _, operands = kernel_modules()
    pool = {"w13": torch.empty(2, 64, 32, dtype=torch.bfloat16, device="cuda")}
    bank = {"w13": torch.empty(4, 64, 32, dtype=torch.bfloat16)}  # pageable
    with pytest.raises(ValueError, match="pageable"):
        operands.make_projection(operands.KernelFormat(0), "w13", pool, bank, 64, 32)


def test_bank_past_32_gib():
    """A host-view weight tensor > 32 GiB, read at experts placed past 2^31 x 16 B (the Marlin bound)."""
    fused_moe, operands = kernel_modules()
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


@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("name", ["int4-g128", "int4-g64-zp", "int4-g32"])
def test_int4_half_math_equals_fp32_tiles(name, M, monkeypatch):
    """moe_gemm.HALF_INT4 (int4 MMA tiles in packed bf16 math, the default): bitwise the fp32-math tiles."""
    from pooled_runner.kernels import moe_gemm

    from tests.kernel_helpers import build_layer

    fused_moe, operands = kernel_modules()
    H, I, _, K = SHAPES["qwen3"]
    E, R = 12, 12
    fmt_obj, pool, _, l2p = build_layer(
        name, H, I, E, R, torch.Generator().manual_seed(M), device="cuda", host_rows=False
    )
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, None, H, I)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    monkeypatch.setattr(moe_gemm, "HALF_INT4", False)  # the fp32-math tiles (HALF_INT4 is the default)
    base = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align")
    monkeypatch.setattr(moe_gemm, "HALF_INT4", True)
    assert torch.equal(fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="align"), base)


@pytest.mark.parametrize("path", [None, "tiny", "sort", "wide"])
@pytest.mark.parametrize(("T", "K", "E", "block_m"), [(7, 3, 5, 16), (9, 8, 128, 16), (30, 8, 128, 16), (64, 8, 128, 32), (128, 8, 256, 32), (130, 7, 600, 16), (1024, 1, 61, 64), (1030, 8, 128, 64)])  # fmt: skip
def test_align_paths_exact(T, K, E, block_m, path):
    """Each align path where it reaches, on the card, exact against the reference: the interpreter runs no
    barrier, so only a GPU shows whether a padding fill lands before the scatter (ids of -1 and >= E, codes
    of pool rows, host rows and absent experts, fresh random routing)."""
    from pooled_runner.kernels.align import TINY_FORCED_MAX_PAIRS, align_blocks, align_blocks_ref
    from pooled_runner.kernels.align_sort import SORT_COMPILED_MAX_PAIRS

    limit = {"tiny": TINY_FORCED_MAX_PAIRS, "sort": SORT_COMPILED_MAX_PAIRS}.get(path or "", T * K)
    if T * K > limit:
        pytest.skip(f"the {path} path takes at most {limit} pairs, not {T * K}")

    g = torch.Generator().manual_seed(T * 7 + E)
    R = E // 2
    ids = torch.randint(-1, E + 2, (T, K), generator=g)
    l2p = torch.randint(-1, R + E, (E + 2,), generator=g).int()
    got = align_blocks(ids.cuda().int(), l2p.cuda(), E, R, block_m, path=path)
    want = align_blocks_ref(ids, l2p, E, R, block_m)
    for field in ("sorted_pairs", "block_experts", "block_codes", "block_order", "num_post_padded"):
        have, ref = getattr(got, field).cpu(), getattr(want, field)
        bad = (have != ref).nonzero()
        assert bad.numel() == 0, f"{field}: {bad.numel()} entries differ, first at {bad[0].tolist()}"
