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
    from bench.stock_sglang import activation, align, kernels, moe

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
@pytest.mark.parametrize("shape", [(128, 768), (256, 2048), (8, 14336)])
@pytest.mark.parametrize("M", [1, 3, 4, 8, 16, 64, 512, 4096])
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
    if up.pop("USE_TMA", False) or (down is not None and down.pop("USE_TMA", False)):
        with pytest.raises(NotImplementedError, match="TMA"):
            moe.pick_configs(M, E, I, device_name, triton_version)
        return
    assert moe.pick_configs(M, E, I, device_name, triton_version) == (up, down)


def test_tma_config_refused():
    """The H100's tuned down config asks for TMA at M=4096: that path is not reproduced, so it is refused."""
    with pytest.raises(NotImplementedError, match="TMA"):
        moe.pick_configs(4096, 128, 768, "NVIDIA H100 80GB HBM3", "3.6.0")


# the first three: stock's single-launch Triton align (<= 64 pairs, > 64 buckets); then its CUDA align's cases
# (the torch stand-in): 72 pairs; 9 buckets (Mixtral-like top-2: the torch.add combine); top-1 (no combine);
# 35 tokens (the CUDA top-k sum's stand-in, stock's Triton sum)
@pytest.mark.parametrize(
    ("M", "K", "E", "H", "I"),
    [(1, 8, 67, 48, 40), (3, 3, 65, 72, 24), (7, 8, 129, 40, 56), (9, 8, 67, 48, 40), (5, 2, 8, 64, 40),
     (3, 1, 8, 40, 24), (35, 3, 9, 40, 24)],
)  # fmt: skip
def test_stock_launches_compute_the_moe(M, K, E, H, I):
    """The vendored kernels through `stock_fused_experts` against the torch reference (fresh random inputs;
    top-k 3 does not divide the M block of 16), with the align stand-in where stock runs its CUDA align."""
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
    aligned = None
    if moe.uses_cuda_align(ids.numel(), E):
        aligned = align.align_stand_in(ids, configs[0]["BLOCK_SIZE_M"], E)
    got = moe.stock_fused_experts(x, w13, w2, weights, ids, configs, pdl=False, aligned=aligned)
    want = moe.reference_fused_experts(x, w13, w2, weights, ids)
    diff = (got.float() - want.float()).abs()
    tol = 2e-2 * want.float().abs().max().item() + 1e-3
    worst = divmod(int(diff.argmax()), H)
    assert diff.max().item() <= tol, f"max |diff| {diff.max().item():.3g} > {tol:.3g} at (token, h) {worst}"


def test_cuda_align_needs_the_stand_in():
    """Above 64 (token, expert) pairs stock runs its CUDA align kernel: the caller must pass the stand-in's
    buffers (of the right size); where stock's Triton align runs, they are refused."""
    x = torch.randn(9, 16).bfloat16()
    w13, w2 = torch.randn(67, 32, 16).bfloat16(), torch.randn(67, 16, 16).bfloat16()
    weights, ids = torch.rand(9, 8), torch.randint(0, 67, (9, 8), dtype=torch.int32)
    configs = moe.pick_configs(9, 67, 16, "cpu", "3.6.0")
    with pytest.raises(AssertionError, match="CUDA align"):
        moe.stock_fused_experts(x, w13, w2, weights, ids, configs, pdl=False)
    wrong_block = align.align_stand_in(ids, 2 * configs[0]["BLOCK_SIZE_M"], 67)
    with pytest.raises(AssertionError, match="aligned buffers"):
        moe.stock_fused_experts(x, w13, w2, weights, ids, configs, pdl=False, aligned=wrong_block)
    small = ids[:1].contiguous()
    small_aligned = align.align_stand_in(small, 16, 67)
    with pytest.raises(AssertionError, match="Triton align"):
        moe.stock_fused_experts(x[:1], w13, w2, weights[:1], small, configs, pdl=False, aligned=small_aligned)


def _align_loops(ids: torch.Tensor, block: int, E: int) -> tuple[list[int], list[int], int]:
    """moe_align_block_size's layout by plain loops: (sorted ids, block expert ids, padded total)."""
    flat = ids.reshape(-1).tolist()
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for bucket in range(E + 1):
        pairs = [p for p, e in enumerate(flat) if e + 1 == bucket]
        num_blocks = -(-len(pairs) // block)
        sorted_ids += pairs + [len(flat)] * (num_blocks * block - len(pairs))
        expert_ids += [bucket - 1] * num_blocks
    return sorted_ids, expert_ids, len(sorted_ids)


@pytest.mark.parametrize(
    ("M", "K", "E", "block", "filtered"),
    [(1, 1, 8, 16, 0), (7, 2, 8, 16, 3), (33, 8, 67, 64, 5), (13, 3, 9, 128, 0), (50, 8, 256, 16, 40)],
)
def test_align_stand_in_layout(M, K, E, block, filtered):
    """The CUDA align's stand-in against plain loops (fresh random ids, some -1 as expert parallelism filters
    them): every sorted id written (padding = numel, also past the total), expert ids exact."""
    g = torch.Generator().manual_seed(M * 131 + E)
    ids = torch.randint(0, E, (M, K), generator=g, dtype=torch.int32)
    ids.view(-1)[torch.randperm(M * K, generator=g)[:filtered]] = -1
    sorted_ids, expert_ids, num_post = align.align_stand_in(ids, block, E)
    want_sorted, want_experts, total = _align_loops(ids, block, E)
    size = align.max_padded_tokens(M * K, E, block)
    assert int(num_post) == total and total <= size, (int(num_post), total, size)
    assert sorted_ids.tolist() == want_sorted + [M * K] * (size - total)
    assert expert_ids.tolist()[: total // block] == want_experts
    assert set(expert_ids.tolist()[total // block :]) <= {-1}


@pytest.mark.parametrize(
    ("M", "K", "E", "block", "filtered"), [(1, 8, 67, 16, 0), (7, 3, 128, 16, 4), (8, 8, 129, 64, 9)]
)
def test_align_stand_in_is_stocks_triton_align(M, K, E, block, filtered):
    """Where both apply (<= 64 pairs, > 64 buckets), the stand-in's layout is the one of stock's own
    single-launch align (vendored, under the interpreter), ids of -1 (filtered) included: the stand-in follows
    stock's contract."""
    g = torch.Generator().manual_seed(M * 7 + E)
    ids = torch.randint(0, E, (M, K), generator=g, dtype=torch.int32)
    ids.view(-1)[torch.randperm(M * K, generator=g)[:filtered]] = -1
    size = align.max_padded_tokens(M * K, E, block)
    sorted_ids = torch.full((size,), -7, dtype=torch.int32)
    expert_ids = torch.full(((size + block - 1) // block,), -7, dtype=torch.int32)
    num_post = torch.zeros(1, dtype=torch.int32)
    kernels._moe_align_small_numel_kernel[(1,)](
        ids, sorted_ids, expert_ids, num_post, E + 1, block, M * K,
        NP=max(2, 1 << (M * K - 1).bit_length()), NB=max(2, 1 << (expert_ids.numel() - 1).bit_length()),
        WRITE_INACTIVE_PREFIX_COUNT=False,
    )  # fmt: skip
    want_sorted, want_experts, want_total = align.align_stand_in(ids, block, E)
    total = int(num_post)
    assert total == int(want_total), (total, int(want_total))
    assert sorted_ids[:total].tolist() == want_sorted[:total].tolist()
    assert expert_ids[: total // block].tolist() == want_experts[: total // block].tolist()


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


@pytest.mark.parametrize(
    ("numel", "E", "block", "size"),
    [
        (2, 8, 16, 32),
        (3, 65, 16, 48),
        (128, 128, 16, 2048),
        (129, 128, 16, 2064),
        (105, 9, 16, 256),
        (1, 8, 64, 64),
    ],
)
def test_max_padded_tokens(numel, E, block, size):
    """Stock's sorted-ids buffer length (`moe_align_block_size`): numel x block below E + 1 pairs, else numel +
    (E + 1) x (block - 1), rounded up to 4 (by hand from its source); the GEMMs' grids follow it."""
    assert align.max_padded_tokens(numel, E, block) == size


@pytest.mark.skipif(not HAS_SGLANG, reason="needs the installed SGLang's constants")
def test_gates_are_sglangs():
    """Where stock switches align kernels and top-k sums: the constants moe.py keeps are SGLang's."""
    utils = "sglang.srt.layers.moe.moe_runner.triton_utils"
    # modules, not the functions of the same names the package re-exports
    moe_align_small_numel = importlib.import_module("sglang.kernels.ops.moe.moe_align_small_numel")
    moe_align_block_size = importlib.import_module(f"{utils}.moe_align_block_size")
    fused_moe = importlib.import_module(f"{utils}.fused_moe")

    assert moe.SMALL_NUMEL_LIMIT == moe_align_small_numel.SMALL_NUMEL_LIMIT
    assert moe.CUDA_SMALL_BATCH_MAX_BUCKETS == moe_align_block_size._CUDA_SMALL_BATCH_MAX_BUCKETS
    limit = moe.TRITON_SUM_MAX_TOKENS
    assert fused_moe._use_moe_sum_reduce_torch_compile(limit)
    assert not fused_moe._use_moe_sum_reduce_torch_compile(limit + 1)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(("M", "K"), [(3, 1), (3, 2), (33, 2), (3, 3), (32, 3), (33, 3)])
def test_combine_launches(monkeypatch, M, K, skip):
    """Which combine runs (stock's `moe_combine_topk` at routed scaling 1 on CUDA): none at top-1 (the down GEMM
    writes the output), one add at top-2, the Triton sum above (up to 32 tokens stock's own, kept by
    `skip_stand_ins`; above, the stand-in for its CUDA sum, left out by it); the gated SiLU's stand-in runs
    unless skipped. Launches are recorded, the GEMMs run."""
    ran: list[str] = []

    class _Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            return lambda *a, **k: ran.append(self.name)

    monkeypatch.setattr(moe.kernels, "_moe_sum_reduce_kernel", _Recorder("sum"))
    monkeypatch.setattr(moe, "silu_and_mul", lambda *a, **k: ran.append("silu"))
    monkeypatch.setattr(moe, "_add_top2", lambda *a, **k: ran.append("add"))
    E, H, I = 9, 16, 16
    dtype = torch.float16
    x = torch.randn(M, H).to(dtype)
    w13, w2 = torch.randn(E, 2 * I, H).to(dtype), torch.randn(E, H, I).to(dtype)
    weights, ids = torch.rand(M, K), torch.randint(0, E, (M, K), dtype=torch.int32)
    configs = moe.pick_configs(M, E, I, "cpu", "3.6.0")
    aligned = align.align_stand_in(ids, configs[0]["BLOCK_SIZE_M"], E)
    moe.stock_fused_experts(
        x, w13, w2, weights, ids, configs, pdl=False, aligned=aligned, skip_stand_ins=skip
    )
    combine = {1: [], 2: ["add"]}.get(K, [] if skip and M > 32 else ["sum"])
    assert ran == ([] if skip else ["silu"]) + combine, (M, K, skip, ran)
