"""int64 router ids whose low 32 bits name an expert (2^32 + e) are not routed here in any GEMM variant: each
kernel checks an id's range at the width it was loaded with, before the int32 cast that indexes `l2p`
(kernels/ids.py). On the CPU, under Triton's interpreter; the align paths' own case is in test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels.fused_moe import (
        VARIANTS,
        make_projections,
        pooled_fused_moe,
        pooled_fused_moe_ref,
    )
    from pooled_runner.kernels.moe_gemm import GemmConfig
    from pooled_runner.kernels.operands import kernel_format
    from pooled_runner.kernels.splitk import splitk_supported

from tests.kernel_helpers import assert_close, build_layer, random_routing

pytestmark = pytest.mark.interpreter(gpu="tests/test_kernels_gpu.py")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "H", "I"), [("bf16", 40, 24), ("int4-g32", 64, 32)])
def test_ids_past_2_32_are_not_routed(variant, name, H, I):
    """3 tokens, top-3, 7 experts (3 in pool rows, one not here, the rest host rows): ids 2^32 + e and e - 2^32
    (e a valid expert, located here; both wrap to e in 32 bits) at two pairs give the output of the same step with
    -1 there, bitwise, and the reference's; ids stay int64 (the router's dtype). bf16's inline variant also beside
    the plan (after_plan: blocks in an order that does not read the location table; the GEMV's such order adds
    ~50 s of interpreter compiles here and passed a review's run on 2026-12-07)."""
    if variant == "splitk" and name != "bf16":
        pytest.skip("the split path takes dense weights only")
    g = torch.Generator().manual_seed(len(variant) * 7 + H)
    T, K, E, R = 3, 3, 7, 3
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, torch.bfloat16, num_not_here=1)
    fmt = kernel_format(fmt_obj)
    assert variant != "splitk" or splitk_supported(fmt)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = random_routing(T, K, E, g, pad_prob=0.0)
    here = (l2p[:E] >= 0).nonzero().flatten()
    ids[0, 0], ids[2, 1] = here[0], here[-1]  # experts located here: routed at the low 32 bits' value
    wide, cut = ids.clone(), ids.clone()
    wide[0, 0] += 2**32
    wide[2, 1] -= 2**32
    cut[0, 0] = cut[2, 1] = -1
    assert wide.dtype == torch.int64
    cfgs = (GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1))
    ref = pooled_fused_moe_ref(x, wide, w, l2p, E, w13, w2, fmt)
    for after_plan in (False, True) if name == "bf16" and variant == "inline" else (False,):
        got = pooled_fused_moe(x, wide, w, l2p, E, w13, w2, fmt, cfgs, variant=variant, after_plan=after_plan)
        want = pooled_fused_moe(x, cut, w, l2p, E, w13, w2, fmt, cfgs, variant=variant, after_plan=after_plan)
        what = f"{name} {variant} after_plan={after_plan}"
        assert torch.equal(got, want), f"{what}: max diff {(got.float() - want.float()).abs().max()}"
        assert_close(got, ref, what)
