"""Swapped-operand decode GEMMs (`GemmConfig.swap_ab`) and the decode-tile defaults that pick them, on the CPU
under Triton's interpreter (the GPU runs test_kernels_swap_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe, pooled_fused_moe_ref
    from pooled_runner.kernels.moe_gemm import GemmConfig
    from pooled_runner.kernels.operands import kernel_format

from tests.kernel_helpers import assert_close, build_layer, random_routing, small_layer_args
from tests.test_kernels import FORMATS

pytestmark = pytest.mark.interpreter(gpu="tests/test_kernels_swap_gpu.py")


@pytest.mark.parametrize(("name", "H", "I", "dtype"), FORMATS)
@pytest.mark.parametrize(("T", "K", "E", "R"), [(1, 1, 1, 1), (3, 3, 7, 3), (5, 2, 6, 2)])
def test_swapped_operand_gemms_match_reference(name, H, I, dtype, T, K, E, R):
    """`GemmConfig.swap_ab` (weight tile as the left operand, `acc^T = W @ x^T`): every format, align and inline
    decode paths, host rows and experts not here: the reference's output, and the unswapped kernels' within
    rounding (fp32 sums in another order). Awkward sizes: K tiles past H/I, N tiles past I/H."""
    g = torch.Generator().manual_seed(T * 13 + E + H)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype, num_not_here=int(E > 3))
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank if R < E else None, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    plain = (GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1))
    swapped = tuple(dataclasses.replace(c, swap_ab=True) for c in plain)
    for variant in ("align", "inline"):
        out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, swapped, variant=variant)
        assert out.dtype == dtype
        assert_close(out, ref, f"swap_ab {variant} {name} T={T} K={K} E={E} R={R}")
        base = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, plain, variant=variant)
        assert_close(out, base, f"swap_ab vs plain {variant} {name} T={T}", rel=1e-2)


def test_swapped_tiles_and_default_variant_rules():
    """Which formats and shapes swap their decode tiles, and the default variant that follows (stated here, not
    recomputed): swapped tiles never take inline; int4 and NVFP4 up to 64 routed pairs take the GEMV
    path and dense weights on narrow experts up to 16 the split path, unless the caller gives MMA tiles;
    caller-given tiles decide over the format's rule."""
    from pooled_runner.kernels.dequant import FMT_DENSE, FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4, FMT_NVFP4
    from pooled_runner.kernels.fused_moe import default_variant, swapped_tiles

    expected = {FMT_DENSE: (False, False), FMT_INT4: (True, True), FMT_NVFP4: (True, True)}
    expected |= {FMT_FP8_CHANNEL: (False, True), FMT_FP8_BLOCK: (False, True)}
    for fmt, (small_i, large_i) in expected.items():
        assert (swapped_tiles(fmt, 768), swapped_tiles(fmt, 2048)) == (small_i, large_i), fmt
    # (format, routed pairs, I) -> default variant
    table = [
        (FMT_DENSE, 1, 768, "splitk"), (FMT_DENSE, 16, 1024, "splitk"), (FMT_DENSE, 17, 768, "align"),
        (FMT_DENSE, 1, 1025, "inline"), (FMT_DENSE, 8, 2048, "inline"), (FMT_DENSE, 9, 2048, "align"),
        (FMT_INT4, 1, 768, "gemv"), (FMT_INT4, 128, 2048, "gemv"), (FMT_INT4, 129, 2048, "align"),
        (FMT_NVFP4, 8, 768, "gemv"), (FMT_NVFP4, 128, 2048, "gemv"), (FMT_NVFP4, 129, 2048, "align"),
        (FMT_FP8_CHANNEL, 8, 768, "inline"), (FMT_FP8_CHANNEL, 8, 2048, "align"),
        (FMT_FP8_BLOCK, 9, 768, "align"),
    ]  # fmt: skip
    for fmt, pairs, I, variant in table:
        assert default_variant(fmt, pairs, I) == variant, (fmt, pairs, I)
    # with the step's tokens and experts: pairs sharing experts heavily stay on the MMA path
    from pooled_runner.kernels.fused_moe import GEMV_MIN_DISTINCT_SHARE, distinct_share

    assert (
        default_variant(FMT_INT4, 64, 2048, None, 8, 256) == "gemv"
    )  # DeepSeek-like: 0.90 distinct per pair
    assert default_variant(FMT_INT4, 64, 768, None, 8, 128) == "gemv"  # Qwen3-like: 0.81
    assert default_variant(FMT_INT4, 16, 14336, None, 8, 8) == "align"  # 8 experts, top-2, 8 tokens: 0.45
    assert default_variant(FMT_INT4, 2, 14336, None, 1, 8) == "gemv"  # one token: distinct pairs
    assert default_variant(FMT_NVFP4, 8, 768, None, 4, 8) == "gemv"  # 8 experts, top-2, 4 tokens: 0.68
    assert default_variant(FMT_NVFP4, 128, 768, None, 16, 128) == "gemv"  # Qwen3-like M=16: 0.64
    assert default_variant(FMT_NVFP4, 12, 768, None, 6, 8) == "align"  # 8 experts, top-2, 6 tokens: 0.55
    assert default_variant(FMT_DENSE, 8, 768, None, 4, 8) == "inline"  # 0.68: below the split path's 0.75
    assert distinct_share(8, 0, 0) == 1.0 and distinct_share(8, 1, 0) == 1.0  # unknown: no veto
    assert distinct_share(64, 64, 4) < GEMV_MIN_DISTINCT_SHARE  # 64 tokens of top-1 over 4 experts
    plain, swapped = GemmConfig(16, 32, 64), GemmConfig(16, 32, 64, swap_ab=True)
    assert default_variant(FMT_INT4, 8, 2048, (plain, plain)) == "inline"
    assert default_variant(FMT_DENSE, 8, 768, (swapped, swapped)) == "align"
    assert default_variant(FMT_DENSE, 9, 768, (plain, plain)) == "align"
    assert default_variant(FMT_DENSE, 8, 768, (plain, plain)) == "inline"  # caller's MMA tiles: no split path
    assert default_variant(FMT_DENSE, 16, 768, None, 8, 4) == "align"  # 8 tokens of top-2 over 4 experts
    assert default_variant(FMT_DENSE, 8, 768, None, 1, 128, 2048) == "splitk"  # Qwen3-like M=1
    assert default_variant(FMT_DENSE, 16, 768, None, 2, 128, 2048) == "splitk"  # Qwen3-like M=2: 4096 sums
    assert (
        default_variant(FMT_DENSE, 6, 768, None, 3, 128, 2048) == "inline"
    )  # 3 x 2048 sums: two tail blocks
    assert (
        default_variant(FMT_DENSE, 8, 2048, None, 1, 256, 7168) == "inline"
    )  # DeepSeek-like: two tail blocks
    assert default_variant(FMT_DENSE, 8, 1024, None, 1, 256, 7168) == "inline"  # its TP=2 shard
    # a long plan beside the step (the adaptive policies): inline up to INLINE_MAX_PAIRS, never where swapped
    from pooled_runner.kernels.moe_gemm import INLINE_MAX_PAIRS

    qwen3_m4 = (FMT_DENSE, 32, 768, None, 4, 128, 2048)
    assert default_variant(*qwen3_m4) == "align" and default_variant(*qwen3_m4, True) == "inline"
    assert default_variant(FMT_DENSE, INLINE_MAX_PAIRS + 1, 768, None, 0, 0, 0, True) == "align"
    assert default_variant(FMT_DENSE, 8, 768, None, 1, 128, 2048, True) == "splitk"  # split path first
    assert default_variant(FMT_FP8_CHANNEL, 16, 2048, None, 2, 128, 0, True) == "align"  # swapped tiles
    assert default_variant(FMT_INT4, 64, 768, None, 8, 128, 0, True) == "gemv"


def test_decode_path_refuses_swapped_tiles():
    """kernels/decode.py has no swapped-operand kernels: swapped tiles are refused, not silently unswapped."""
    args = small_layer_args(40, 24, 5, 3, 2, 2, seed=5)
    cfg = GemmConfig(16, 16, 32, num_stages=1, swap_ab=True)
    with pytest.raises(ValueError, match="swapped"):
        pooled_fused_moe(*args, (cfg, cfg), decode=True)
