"""bench/kernel_variants.py on the CPU: its columns and the module switches it times them under."""

from __future__ import annotations

from pooled_runner.kernels import align, moe_gemm
from pooled_runner.kernels.dequant import FMT_DENSE, FMT_INT4

from bench.kernel_variants import _with_switch, variant_specs


def test_variant_columns_unique_align_first():
    for fmt in (FMT_DENSE, FMT_INT4):
        specs = variant_specs(2048, 768, fmt, 8)
        names = [name for name, _, _ in specs]
        assert names[0] == "align" and len(set(names)) == len(names), names
        assert {switch for _, _, switch in specs} <= {"", "phased", "fp32"}


def test_switches_apply_while_running_and_restore():
    seen = []

    def probe():
        seen.append((moe_gemm.HALF_INT4, align.TINY_MAX_PAIRS))
        return len(seen)

    half0, tiny0 = moe_gemm.HALF_INT4, align.TINY_MAX_PAIRS
    assert _with_switch(probe, "")() == 1 and seen[-1] == (half0, tiny0)
    assert _with_switch(probe, "fp32")() == 2 and seen[-1] == (False, tiny0)
    assert _with_switch(probe, "phased")() == 3 and seen[-1] == (half0, -1)
    assert (moe_gemm.HALF_INT4, align.TINY_MAX_PAIRS) == (half0, tiny0)
