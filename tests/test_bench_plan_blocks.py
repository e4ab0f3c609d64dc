"""bench/plan_blocks.py's check on the CPU (Triton interpreter, tiny sizes): every block-size variant of the
adaptive plan equals the reference from the same random state, and a kernel that differs is reported."""

from __future__ import annotations

import pytest

from bench import plan_blocks


@pytest.mark.parametrize("policy", ["adaptive", "adaptive-router", "adaptive-router-duel"])
@pytest.mark.parametrize("variant", [(16, 256, 16), (64, 512, 32), (1, 1, 1), (32, 256, 8, 8)])
def test_variants_equal_the_reference(policy, variant):
    assert plan_blocks.check_variant(variant, 2, 9, 5, 2, 3, policy, "cpu", seed=4) is None


def test_a_kernel_that_differs_is_reported(monkeypatch):
    real = plan_blocks.plan_adaptive

    def off_by_one(*args, **kwargs):  # the plan, then one hit too many in the counters
        real(*args, **kwargs)
        args[5][0] += 1

    monkeypatch.setattr(plan_blocks, "plan_adaptive", off_by_one)
    found = plan_blocks.check_variant((16, 256, 16), 2, 9, 5, 1, 3, "adaptive-router", "cpu", seed=4)
    assert found is not None and "counters" in found, found
