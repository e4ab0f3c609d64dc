"""GPU tests of the decode variants at real sizes (run by scripts/gpu_check.sh; skipped without CUDA): the GEMV
path (kernels/gemv.py, variant="gemv"), inline and combine-fused tiles, every format over pool and pinned host
rows, and captured GEMV steps replayed with new routing. Shapes and references in `kernel_gpu_helpers.py`.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernel_gpu_helpers import (
    QUANT_FORMATS,
    SHAPES,
    kernel_modules,
    poison_allocator,
    pooled_reference,
    routing,
)
from tests.kernel_helpers import assert_close

pytestmark = pytest.mark.gpu


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

    fused_moe, operands = kernel_modules()
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

    fused_moe, operands = kernel_modules()
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


WIDE_SHAPES = {"deepseek": SHAPES["deepseek"], "mixtral": (4096, 14336, 8, 2)}
WIDE_CASES = [(n, "deepseek") for n in ("fp8-b128", "fp8-b16", "fp8", "int4-g128", "int4-g32", "nvfp4")]
WIDE_CASES += [("fp8-b128", "mixtral")]


@pytest.fixture(scope="module", autouse=True)
def _release_wide_layer():
    """The last cached layer is freed with the module (later modules build layers of tens of GB)."""
    yield
    _wide_layer.cache_clear()
    torch.cuda.empty_cache()


@functools.lru_cache(maxsize=1)  # one layer at a time: the cases of a layer are consecutive
def _wide_layer(name: str, shape: str):
    from tests.kernel_helpers import build_layer

    fused_moe, operands = kernel_modules()
    H, I, _, _ = WIDE_SHAPES[shape]
    fmt_obj, pool, bank, l2p = build_layer(
        name, H, I, 6, 4, torch.Generator().manual_seed(len(name)), device="cuda"
    )
    bank = {k: v.pin_memory() for k, v in bank.items()}
    fmt = operands.kernel_format(fmt_obj)
    return fmt, l2p, *fused_moe.make_projections(fmt, pool, bank, H, I)


@pytest.mark.parametrize(("name", "shape", "M"), [(n, s, M) for n, s in WIDE_CASES for M in (1, 8, 64, 512)])
def test_default_tiles_at_wide_shapes(name, shape, M):
    """Each quantized format's default kernels at the DeepSeek-like expert size (and fp8 blocks at the
    Mixtral-like one), 6 experts (their tiles are the real layer's), 4 in pool rows, M from decode to prefill,
    against the reference over pool and pinned host rows. The fp8 block formats' swapped decode tiles at these
    sizes once needed more shared memory than sm_90 gives (Triton raises at launch), and int4 groups of 32 in 64-row
    tiles failed to compile for sm_90 (Triton 3.6); no other GPU test ran them."""
    fused_moe, _ = kernel_modules()
    H, _, _, K = WIDE_SHAPES[shape]
    fmt, l2p, p13, p2 = _wide_layer(name, shape)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, min(K, 4), 6, g)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, 6, p13, p2, fmt)
    assert_close(out, pooled_reference(x, ids, w, l2p, 6, p13, p2, fmt), f"{name} {shape} M={M}")
