"""Which launches of gemm2 are programmatic dependents of gemm1 (`kernels/pdl.py`), on the CPU: the gating rule
(device capability, format, switches, Triton support). The launches themselves run in tests/test_pdl_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels import pdl
    from pooled_runner.kernels.dequant import (
        FMT_DENSE,
        FMT_FP8_BLOCK,
        FMT_FP8_CHANNEL,
        FMT_INT4,
        FMT_NVFP4,
    )

FORMATS = (FMT_DENSE, FMT_INT4, FMT_FP8_CHANNEL, FMT_FP8_BLOCK, FMT_NVFP4)


def test_pdl_off_on_cpu_tensors():
    x = torch.randn(3, 5)
    assert not any(pdl.pdl_enabled(x, f) for f in FORMATS)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0)])
def test_pdl_gate(monkeypatch, capability):
    """A CUDA tensor (stand-in) on a device of `capability`, compiled kernels: PDL from sm_90 on, for every
    format but those in PDL_SKIP_FORMATS (NVFP4); never with the switch off, under the interpreter or without
    Triton's GDC intrinsics."""
    t = SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_HAVE_GDC", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    expected = {f: capability[0] >= 9 and f != FMT_NVFP4 for f in FORMATS}
    assert {f: pdl.pdl_enabled(t, f) for f in FORMATS} == expected
    monkeypatch.setattr(pdl, "PDL_SKIP_FORMATS", ())
    assert pdl.pdl_enabled(t, FMT_NVFP4) == (capability[0] >= 9)
    for name, value in (("PDL_GEMM2", False), ("_HAVE_GDC", False)):
        with monkeypatch.context() as m:
            m.setattr(pdl, name, value)
            assert not any(pdl.pdl_enabled(t, f) for f in FORMATS), name
    monkeypatch.setattr(pdl, "interpreting", lambda: True)
    assert not any(pdl.pdl_enabled(t, f) for f in FORMATS)


def test_moe_pdl_knob(monkeypatch):
    """POOLED_RUNNER_MOE_PDL: on unless set false; a value that is no boolean is refused, naming the knob."""
    from pooled_runner import envs

    monkeypatch.delenv("POOLED_RUNNER_MOE_PDL", raising=False)
    assert envs.moe_pdl()
    monkeypatch.setenv("POOLED_RUNNER_MOE_PDL", "0")
    assert not envs.moe_pdl()
    monkeypatch.setenv("POOLED_RUNNER_MOE_PDL", "1")
    assert envs.moe_pdl()
    monkeypatch.setenv("POOLED_RUNNER_MOE_PDL", "maybe")
    with pytest.raises(ValueError, match="POOLED_RUNNER_MOE_PDL"):
        envs.moe_pdl()
