"""The copy of stock SGLang 0.5.23's fused MoE in bench/stock_sglang/: the vendored kernels and configs equal the
installed SGLang's, the config choice equals SGLang's own, and the launch sequence (under the interpreter on the
CPU) computes the MoE of a plain torch reference at awkward sizes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from bench.stock_sglang import activation, moe

ROOT = Path(__file__).resolve().parent.parent
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.skipif(not HAS_SGLANG, reason="needs the installed SGLang to compare the copy with")
def test_vendored_copy_matches_installed_sglang():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vendor_stock_sglang.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, f"bench/stock_sglang differs from SGLang's (rerun the script):\n{run.stderr}"


@pytest.mark.skipif(not HAS_SGLANG, reason="needs SGLang's own config lookup")
@pytest.mark.parametrize("device_name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA B200"])
@pytest.mark.parametrize("triton_version", ["3.6.0", "3.7.1", "3.1.0"])
@pytest.mark.parametrize("shape", [(128, 768), (256, 2048)])
@pytest.mark.parametrize("M", [1, 3, 4, 8])
def test_config_choice_is_sglangs(monkeypatch, device_name, triton_version, shape, M):
    """pick_configs against SGLang's try_get_optimal_moe_config with the device name and Triton version set."""
    import triton
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as cfg

    E, I = shape
    monkeypatch.setattr(cfg, "get_device_name", lambda: device_name)
    # no server here: the execution namespace stock reads says what a default launch says
    not_deterministic = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(cfg, "get_exec", lambda: not_deterministic)
    monkeypatch.setattr(triton, "__version__", triton_version)
    cfg.get_moe_configs.cache_clear()
    try:
        up, (down, _) = cfg.try_get_optimal_moe_config(
            (E, 2 * I, 64), (E, 64, I), 8, None, M, return_down_config=True
        )
    finally:
        cfg.get_moe_configs.cache_clear()
    up = dict(up)
    up.pop("USE_TMA", None)
    if down is not None:
        down.pop("USE_TMA", None)
    assert moe.pick_configs(M, E, I, device_name, triton_version) == (up, down)


def test_tma_config_refused():
    """The H100's tuned down config asks for TMA at M=4096: that path is not reproduced, so it is refused."""
    with pytest.raises(NotImplementedError, match="TMA"):
        moe.pick_configs(4096, 128, 768, "NVIDIA H100 80GB HBM3", "3.6.0")


@pytest.mark.parametrize(
    ("M", "K", "E", "H", "I"), [(1, 8, 67, 48, 40), (3, 3, 65, 72, 24), (7, 8, 129, 40, 56)]
)
def test_stock_launches_compute_the_moe(M, K, E, H, I):
    """The vendored kernels through `stock_fused_experts` against the torch reference (fresh random inputs;
    top-k 3 does not divide the M block of 16; E + 1 > 64 buckets, as stock's single-launch align needs)."""
    g = torch.Generator().manual_seed(M * 1000 + E)
    # fp16 (stock's other dense dtype): the interpreter's tl.dot multiplies bf16 operands' raw bits
    dtype = torch.float16 if not torch.cuda.is_available() else torch.bfloat16
    x = torch.randn(M, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(M, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(K, -1)
    ids = ids.int()
    configs = moe.pick_configs(M, E, I, "cpu", "3.6.0")
    got = moe.stock_fused_experts(x, w13, w2, weights, ids, configs, pdl=False)
    want = moe.reference_fused_experts(x, w13, w2, weights, ids)
    diff = (got.float() - want.float()).abs()
    tol = 2e-2 * want.float().abs().max().item() + 1e-3
    worst = divmod(int(diff.argmax()), H)
    assert diff.max().item() <= tol, f"max |diff| {diff.max().item():.3g} > {tol:.3g} at (token, h) {worst}"


def test_wide_steps_refused():
    """Above 64 (token, expert) pairs stock runs its CUDA align kernel, which is not reproduced."""
    x = torch.randn(9, 16).bfloat16()
    w13, w2 = torch.randn(67, 32, 16).bfloat16(), torch.randn(67, 16, 16).bfloat16()
    weights, ids = torch.rand(9, 8), torch.randint(0, 67, (9, 8), dtype=torch.int32)
    with pytest.raises(AssertionError, match="CUDA align"):
        moe.stock_fused_experts(
            x, w13, w2, weights, ids, moe.pick_configs(9, 67, 16, "cpu", "3.6.0"), pdl=False
        )


@pytest.mark.parametrize(("T", "I"), [(0, 8), (1, 8), (7, 24), (3, 776)])
def test_silu_and_mul_stand_in(T, I):
    """The Triton stand-in for stock's CUDA gated SiLU against torch (fp32, one rounding), fresh random rows;
    3 x 776 spans two programs with a ragged end."""
    dtype = torch.float16 if not torch.cuda.is_available() else torch.bfloat16
    gate_up = (torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(T * 31 + I)) * 3).to(dtype)
    got = torch.full((T, I), float("nan"), dtype=dtype)
    want = torch.empty(T, I, dtype=dtype)
    activation.silu_and_mul(gate_up, got, pdl=False)
    activation.reference_silu_and_mul(gate_up, want)
    diff = (got.float() - want.float()).abs()
    if T:
        worst = divmod(int(diff.argmax()), I)
        assert diff.max().item() <= 2e-3 * want.float().abs().max().item(), (
            f"max |diff| {diff.max()} at {worst}"
        )
    with pytest.raises(AssertionError, match="16-byte"):
        activation.silu_and_mul(torch.zeros(2, 12, dtype=dtype), torch.zeros(2, 6, dtype=dtype), pdl=False)
