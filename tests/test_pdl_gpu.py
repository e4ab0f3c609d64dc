"""GPU tests of gemm2 as a programmatic dependent of gemm1, and of the GEMV path's down after its gate_up
(`kernels/pdl.py`; run by scripts/gpu_check.sh, skipped without CUDA): the outputs are bitwise those of the launches without PDL, eager and under graph replay
with new routing each step, with host rows, experts not here (programs that leave early) and padding."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_gpu_helpers import (
    SHAPES,
    kernel_modules,
    poison_allocator,
    pooled_reference,
    routing,
)
from tests.kernel_helpers import assert_close, build_layer

pytestmark = pytest.mark.gpu

PDL_CASES = [
    ("bf16", 1, "inline"),
    ("bf16", 8, "align"),
    ("bf16", 8, "align-fc"),
    ("bf16", 16, "align"),
    ("bf16", 64, None),
    ("int4-g128", 1, "align"),
    ("int4-g64-zp", 4, "inline"),
    ("nvfp4", 8, "align"),
    ("fp8", 2, "align"),
    ("int4-g128", 1, "gemv"),
    ("int4-g64-zp", 8, "gemv"),
    ("nvfp4", 4, "gemv"),
    ("bf16", 2, "gemv"),
]


def _layer(name: str):
    fused_moe, operands = kernel_modules()
    H, I, E, K = SHAPES["qwen3"]
    E = 24  # a few experts at the real H and I: each is quantized in its own launches
    cpu = torch.Generator().manual_seed(len(name) + 11)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, 16, cpu, device="cuda", num_not_here=3)
    fmt = operands.kernel_format(fmt_obj)
    bank = {k: v.pin_memory() for k, v in bank.items()}
    p13, p2 = fused_moe.make_projections(fmt, pool, bank, H, I)
    return fmt, p13, p2, l2p, H, E, K


@pytest.mark.parametrize(("name", "M", "variant"), PDL_CASES)
def test_pdl_gemm2_equals_plain_launches(monkeypatch, name, M, variant):
    """PDL on: eager and graph replay (routing, weights and tokens changed before every replay, one padded
    route) give bitwise the output of the launches without PDL, which match the fp32 reference."""
    from pooled_runner.kernels import pdl

    fused_moe, _ = kernel_modules()
    fmt, p13, p2, l2p, H, E, K = _layer(name)
    g = torch.Generator(device="cuda").manual_seed(M + 3)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    monkeypatch.setattr(
        pdl, "PDL_SKIP_FORMATS", ()
    )  # every format's PDL path is checked, the skipped ones too
    monkeypatch.setattr(pdl, "PDL_GEMM2", True)
    assert pdl.pdl_enabled(x, fmt.fmt), "PDL is off on this GPU: the test would compare a path with itself"

    def run(on: bool) -> torch.Tensor:
        monkeypatch.setattr(pdl, "PDL_GEMM2", on)
        return fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant=variant)

    # the path each case names: (align tables, combine fused into gemm2) of its gemm2 call
    paths = []
    gemm2 = fused_moe.gemm2

    def spy(act, align, *args, **kwargs):
        paths.append((align is not None, bool(kwargs.get("fuse_combine", False))))
        return gemm2(act, align, *args, **kwargs)

    monkeypatch.setattr(fused_moe, "gemm2", spy)
    gemv_calls = []
    gemv_moe = fused_moe.gemv_moe

    def gemv_spy(*args, **kwargs):
        gemv_calls.append(variant)
        return gemv_moe(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "gemv_moe", gemv_spy)
    expected = {
        "inline": (False, True),
        "align-fc": (True, True),
        "align": (True, False),
        None: (True, False),
    }
    poison_allocator()
    plain = run(False)
    if variant == "gemv":  # gate_up, then down + combine: no gemm2
        assert (paths, gemv_calls) == ([], ["gemv"]), (variant, paths, gemv_calls)
    else:
        assert paths == [expected[variant]], (variant, paths)
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
    assert_close(plain, ref, f"no PDL {name} M={M} {variant}")
    # other tokens first, so that the blocks the PDL run gets back from the caching allocator (its `act`) do not
    # already hold this step's values: a gemm2 reading act before gemm1 wrote it would show
    saved = x.clone()
    x.copy_(torch.randn(M, H, generator=g, device="cuda").bfloat16())
    run(False)
    x.copy_(saved)
    eager = run(True)
    assert_close(eager, ref, f"PDL {name} M={M} {variant}")
    assert torch.equal(eager, plain), f"PDL eager differs {name} M={M} {variant}"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    monkeypatch.setattr(pdl, "PDL_GEMM2", True)
    with torch.cuda.graph(graph):
        out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant=variant)
    for step in range(3):
        new_ids, new_w = routing(M, K, E, g)
        new_ids[0, step % K] = -1  # a padded route
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(M, H, generator=g, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(False)), f"step {step}: PDL replay differs {name} M={M} {variant}"
