"""Which launches are programmatic dependents (`kernels/pdl.py`), on the CPU: the gating rule (device capability,
format, switches, Triton support) and the launchers' wiring (gemm1 after the kernel before it, gemm2 after gemm1,
the one-launch plan + copy when asked). The launches themselves run in tests/test_pdl_gpu.py."""

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
    monkeypatch.setattr(pdl, "PDL_GEMM2", True)  # (the knob may be set in this environment)
    monkeypatch.setattr(pdl, "PDL_SKIP_FORMATS", (FMT_NVFP4,))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_HAVE_GDC", True)
    monkeypatch.setattr(pdl, "_capability_major", lambda device: capability[0])
    expected = {f: capability[0] >= 9 and f != FMT_NVFP4 for f in FORMATS}
    assert {f: pdl.pdl_enabled(t, f) for f in FORMATS} == expected
    monkeypatch.setattr(pdl, "PDL_SKIP_FORMATS", ())
    assert pdl.pdl_enabled(t, FMT_NVFP4) == (capability[0] >= 9)
    for name, value in (("PDL_GEMM2", False), ("_HAVE_GDC", False)):
        with monkeypatch.context() as m:
            m.setattr(pdl, name, value)
            assert not any(pdl.pdl_enabled(t, f) for f in FORMATS), name
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: griddepcontrol is PTX
    assert not any(pdl.pdl_enabled(t, f) for f in FORMATS)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "interpreting", lambda: True)
    assert not any(pdl.pdl_enabled(t, f) for f in FORMATS)


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("variant", ["align", "align-fc", "inline"])
def test_launchers_pass_pdl_to_both_gemms(monkeypatch, on, variant):
    """The launchers' wiring: with the gate open, both GEMMs are compiled with PDL (gemm1 waits for the kernel
    before it, then triggers; gemm2 waits for gemm1) and launched with `launch_pdl`; with it shut, neither, and
    no `launch_pdl` at all (the interpreter's launcher would not take it). Kernels replaced by recorders; the
    align and combine kernels run."""
    from pooled_runner.kernels import moe_gemm
    from pooled_runner.kernels.fused_moe import pooled_fused_moe

    from tests.kernel_helpers import small_layer_args

    args = small_layer_args(32, 16, 5, 3, 2, 2, seed=3)
    k1, k2 = _Recorder(), _Recorder()
    monkeypatch.setattr(moe_gemm, "_gemm1_kernel", k1)
    monkeypatch.setattr(moe_gemm, "_gemm2_kernel", k2)
    monkeypatch.setattr(pdl, "pdl_enabled", lambda t, fmt: on)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pooled_fused_moe(*args, variant=variant)
    assert len(k1.calls) == 1 and len(k2.calls) == 1, (k1.calls, k2.calls)
    assert k1.calls[0]["PDL"] is on and k2.calls[0]["PDL"] is on
    for k in (k1, k2):
        assert k.calls[0].get("launch_pdl", False) is on and ("launch_pdl" in k.calls[0]) == on


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


@pytest.mark.parametrize("plan", ["lru", "adaptive"])
@pytest.mark.parametrize("available", [False, True])
@pytest.mark.parametrize("asked", [False, True])
def test_plan_copy_is_a_programmatic_dependent_where_asked_and_available(monkeypatch, available, asked, plan):
    """The one-launch plan + copy (LRU's and the adaptive policies') is compiled to wait (PDL) and launched with
    `launch_pdl` exactly when asked and `pdl_available` on its tensors' device; otherwise neither (no
    `launch_pdl` for the interpreter's launcher). Kernel replaced by a recorder."""
    from pooled_runner.kernels import admit_copy, plan_adaptive_copy, plan_copy

    from pooled_runner.policy_adaptive import AdaptivePolicy
    from tests.test_plan_copy import random_rows
    from tests.test_plan_lru import random_state

    state = random_state(1, 4, 4, 3, 0)
    out = [torch.zeros(2, dtype=torch.int32) for _ in range(3)]
    args: tuple = (torch.tensor([0, 1]), state["l2p"], state["row_owner"], state["row_stamp"], state["clock"])
    args += (state["counters"], torch.zeros(4, dtype=torch.int32), *out, 0, 4, 4, 3, 16, 1)
    rows, hosts = random_rows(2, 3, 4, torch.Generator().manual_seed(0))
    sync = torch.zeros(plan_copy.SYNC_WORDS, dtype=torch.int32)
    k = _Recorder()
    monkeypatch.setattr(admit_copy, "pdl_available", lambda t: available)
    if plan == "lru":
        monkeypatch.setattr(plan_copy, "_plan_copy_kernel", k)
        plan_copy.plan_lru_copy(*args, None, None, rows, hosts, 0, sync, pdl=asked)
    else:
        policy = AdaptivePolicy(3)
        policy.bind(1, 4, torch.device("cpu"))
        monkeypatch.setattr(plan_adaptive_copy, "_plan_adaptive_copy_kernel", k)
        plan_adaptive_copy.plan_adaptive_copy(
            *args, policy.kernel_state(), policy.kernel_rule(), None, rows, hosts, 0, sync, pdl=asked
        )
    assert len(k.calls) == 1
    on = asked and available
    assert k.calls[0]["PDL"] is on and ("launch_pdl" in k.calls[0]) == on
    assert k.calls[0]["EARLY_TRIGGER"] is False  # not asked


@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_launchers_pass_pdl_to_both_kernels(monkeypatch, on, split):
    """The GEMV path's wiring: with the gate open, gate_up (waits, then triggers) and down + combine (waits
    before reading act) are compiled with PDL and launched with `launch_pdl`; with it shut, neither, and no
    `launch_pdl` at all. Split K of gate_up and of down (K tiles of 16 values: two in I = 32) changes nothing.
    Kernels replaced by recorders."""
    import dataclasses

    from pooled_runner.kernels import gemv
    from pooled_runner.kernels.fused_moe import pooled_fused_moe

    from tests.kernel_helpers import small_layer_args

    args = small_layer_args(64, 32, 5, 3, 2, 2, seed=3)
    k1, k2 = _Recorder(), _Recorder()
    monkeypatch.setattr(gemv, "_gate_up_kernel", k1)
    monkeypatch.setattr(gemv, "_down_kernel", k2)
    monkeypatch.setattr(pdl, "gemv_pdl_enabled", lambda t: on)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = dataclasses.replace(gemv.gemv_configs(64, 32), split_k1=split, split_k2=split, block_k2=16)
    pooled_fused_moe(*args, variant="gemv", gemv_config=cfg)
    assert len(k1.calls) == 1 and len(k2.calls) == 1, (k1.calls, k2.calls)
    assert k1.calls[0]["SPLIT"] == split and k2.calls[0]["SPLIT"] == split
    for k in (k1, k2):
        assert k.calls[0]["PDL"] is on, k.calls[0]
        assert k.calls[0].get("launch_pdl", False) is on and ("launch_pdl" in k.calls[0]) == on
