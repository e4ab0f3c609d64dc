"""GPU test of the GEMV pair schedule's width (`GemvConfig.schedule_width`, kernels/gemv_schedule.py `_slot_pair`)
and of the first tile loaded ahead of the PDL wait (`GemvConfig.down_peel`), as compiled for CUDA, where programs run
side by side, down's programs start while gate_up's run, and the fused combine's last arrival depends on the
order (the interpreter runs programs one at a time: tests/test_kernels_gemv.py). Run by scripts/gpu_check.sh."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_gpu_helpers import SHAPES, poison_allocator, pooled_reference, routing
from tests.kernel_helpers import assert_close
from tests.test_gemv_half_gpu import _layer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["int4-g128", "nvfp4"])
def test_schedule_width_and_peel_change_only_the_order(name):
    """DeepSeek-like layer with pool rows, pinned host rows and an expert not here, at M = 1, 3 and 8 (the
    default tiles of each; NVFP4's and int4's one-token defaults peel down and sort 8 keys): without the sort
    (width 0) and at widths 8, 16 and 64 the output is bitwise the default's (the combine sums in k order),
    beside the plan (PDL) too, and every output is written; the default matches the dense reference. down's peel
    toggled: bitwise with the half dot; with the fp32 dot (int4 at M > 1) within bf16 rounding (rel 1e-2), since the
    peeled tile's sum compiles apart from the loop's and may round differently (one bf16 ulp at M=3, H100,
    2026-12-05)."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.gemv import gemv_configs

    H, I, _, K = SHAPES["deepseek"]
    E, R = 13, 9
    fmt, p13, p2, l2p = _layer(name, "deepseek", E, R, seed=5)
    for M in (1, 3, 8):
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids, w = routing(M, K, E, g)
        base = gemv_configs(H, I, fmt.fmt, M * K, fmt.group)
        poison_allocator()
        want = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=base)
        assert_close(want, pooled_reference(x, ids, w, l2p, E, p13, p2, fmt), f"{name} M={M} default")
        peel = not base.down_peel
        variants = [dict(schedule_width=w) for w in (0, 8, 16, 64)]
        variants += [dict(down_peel=peel), dict(down_peel=peel, schedule_width=0)]
        for fields in variants:
            cfg = dataclasses.replace(base, **fields)
            for after_plan in (False, True):
                got = fused_moe.gemv_moe(x, ids, w, l2p, E, p13, p2, fmt, cfg, after_plan=after_plan)
                what = f"{name} M={M} {fields} after_plan={after_plan}"
                if "down_peel" in fields and not base.half_dot:
                    assert_close(got, want, what, rel=1e-2)
                else:
                    assert torch.equal(got, want), f"{what}: {(got.float() - want.float()).abs().max()}"
