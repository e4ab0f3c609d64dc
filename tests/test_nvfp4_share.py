"""`formats.nvfp4.share_gate_up_global`: an expert's gate and up halves quantized with two NVFP4 global scales
(ModelOpt checkpoints whose `weight_scale_2` differ) put onto one, against a plain fp32 dequantization of the
two halves with their own globals."""

from __future__ import annotations

import pytest
import torch

from pooled_runner.formats.nvfp4 import share_gate_up_global


def _scales(rows: int, groups: int, seed: int, low: float = 1.0, high: float = 448.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(rows, groups, generator=g)).to(torch.float8_e4m3fn)


def _effective(s: torch.Tensor, gate: float, up: float) -> torch.Tensor:
    """Each block's scale times its half's global, fp32 (what dequantization multiplies the e2m1 values by)."""
    half = s.shape[0] // 2
    return torch.cat([s[:half].float() * gate, s[half:].float() * up])


@pytest.mark.parametrize(("rows", "groups"), [(2, 1), (14, 3), (34, 7)])
def test_equal_globals_change_nothing(rows: int, groups: int) -> None:
    s = _scales(rows, groups, seed=rows)
    before = s.clone()
    assert share_gate_up_global(s, 0.0123, 0.0123) == (0.0123, 0.0)
    assert torch.equal(s.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(("gate", "up"), [(0.5, 0.125), (0.003, 0.012), (2.0**-20, 2.0**-19)])
def test_power_of_two_ratios_are_exact(gate: float, up: float) -> None:
    """Scales in [1, 448] divided by 2 or 4 stay normal e4m3: the effective scales are the checkpoint's exactly,
    and only the half with the smaller global changed."""
    s = _scales(18, 5, seed=7)
    want = _effective(s, gate, up)
    larger_half = slice(0, 9) if gate > up else slice(9, 18)
    untouched = s[larger_half].clone()
    g, change = share_gate_up_global(s, gate, up)
    assert g == max(gate, up) and change == 0.0
    assert torch.equal(_effective(s, g, g), want)
    assert torch.equal(s[larger_half].view(torch.uint8), untouched.view(torch.uint8))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_other_ratios_round_each_block_within_half_an_e4m3_step(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate, up = (float(v) for v in 0.001 + torch.rand(2, generator=gen) * 0.01)
    s = _scales(22, 9, seed=seed, low=16.0)  # rescaled by >= 0.1: still normal e4m3
    want = _effective(s, gate, up)
    g, change = share_gate_up_global(s, gate, up)
    got = _effective(s, g, g)
    relative = ((got - want).abs() / want).max()
    assert relative <= 1 / 16 and change == pytest.approx(float(relative), rel=1e-6), (relative, change)
    assert change > 0  # these ratios do round: the check above is not vacuous


def test_a_block_scale_rounded_to_zero_is_reported() -> None:
    """A tiny block scale of the smaller half underflows e4m3: the change says 1.0 (a block lost)."""
    s = torch.full((4, 2), 2.0**-9).to(torch.float8_e4m3fn)
    g, change = share_gate_up_global(s, 1.0, 1000.0)
    assert g == 1000.0 and change == 1.0
    assert torch.count_nonzero(s[:2].float()) == 0 and torch.all(s[2:].float() == 2.0**-9)


@pytest.mark.parametrize(
    ("s", "gate", "up", "message"),
    [
        (torch.ones(3, 2).to(torch.float8_e4m3fn), 1.0, 1.0, r"expected \[2I, K/16\]"),
        (torch.ones(4, 2), 1.0, 1.0, r"float8_e4m3fn, got \(4, 2\) torch.float32"),
        (torch.ones(4, 2).to(torch.float8_e4m3fn), 0.0, 1.0, "gate global scale 0.0"),
        (torch.ones(4, 2).to(torch.float8_e4m3fn), 1.0, float("nan"), "up global scale nan"),
    ],
)
def test_bad_input_is_refused(s: torch.Tensor, gate: float, up: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        share_gate_up_global(s, gate, up)
