"""GPU tests of the swapped-operand decode GEMMs (`GemmConfig.swap_ab`) at the real shapes (run by
scripts/gpu_check.sh; skipped without CUDA). Helpers and shapes from kernel_gpu_helpers.py."""

from __future__ import annotations

import dataclasses

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

SWAP_CASES = [
    ("bf16", "deepseek", 1, "inline"),
    ("int4-g128", "deepseek", 1, "inline"),
    ("nvfp4", "deepseek", 1, "align"),
    ("bf16", "qwen3", 8, "align"),
    ("int4-g128", "qwen3", 8, "inline"),
    ("int4-g128", "qwen3", 8, "align"),
    ("fp8", "qwen3", 4, "align"),
]


@pytest.mark.parametrize(("name", "shape", "M", "variant"), SWAP_CASES)
def test_swapped_operand_gemms_real_shapes(name, shape, M, variant):
    """`GemmConfig.swap_ab` decode tiles at the real shapes, every expert resident: the independent fp32
    reference's output, and the unswapped tiles' within rounding."""
    from pooled_runner.kernels.fused_moe import pick_configs

    fused_moe, operands = kernel_modules()
    H, I, E, K = SHAPES[shape]
    E = 8 if M == 1 else 16  # few experts, at the real H and I: each is quantized in its own launches
    cpu = torch.Generator().manual_seed(len(name) + M + H)
    fmt_obj, pool, _, l2p = build_layer(name, H, I, E, E, cpu, device="cuda", num_not_here=0, host_rows=False)
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, None, H, I)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    tiles = pick_configs(M, K, E, H, I, fmt.fmt)  # (swapped by default for some formats)
    plain = tuple(dataclasses.replace(c, swap_ab=False) for c in tiles)
    swapped = tuple(dataclasses.replace(c, swap_ab=True) for c in tiles)
    poison_allocator()
    out = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, swapped, variant=variant)
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt, routed_only=False)
    assert_close(out, ref, f"swap_ab {variant} {name} {shape} M={M}")
    base = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, plain, variant=variant)
    assert_close(out, base, f"swap_ab vs plain {variant} {name} {shape} M={M}", rel=1e-2)
