"""bench/kernel_variants.py on the CPU: its columns and the module switch it times them under."""

from __future__ import annotations

import pytest
from pooled_runner.kernels import prefetch
from pooled_runner.kernels.dequant import FMT_DENSE, FMT_INT4

from bench.kernel_variants import _with_switch, variant_specs


def test_variant_columns_unique_default_first():
    for fmt in (FMT_DENSE, FMT_INT4):
        specs = variant_specs(2048, 768, fmt, 8)
        names = [name for name, _, _ in specs]
        assert names[:2] == ["default", "default no-pf"] and len(set(names)) == len(names), names
        assert {switch for _, _, switch in specs} <= {"", "nopf"}


def test_switch_applies_while_running_and_restores():
    seen = []

    def probe():
        seen.append(prefetch.PREFETCH_L2_BYTES)
        if len(seen) == 3:
            raise RuntimeError("probe")
        return len(seen)

    budget0 = prefetch.PREFETCH_L2_BYTES
    assert budget0 > 0
    assert _with_switch(probe, "")() == 1 and seen[-1] == budget0
    assert _with_switch(probe, "nopf")() == 2 and seen[-1] == 0
    with pytest.raises(RuntimeError):
        _with_switch(probe, "nopf")()
    assert seen[-1] == 0 and prefetch.PREFETCH_L2_BYTES == budget0
