"""bench/kernel_variants.py and bench/kernels.py on the CPU: columns, sweep tiles, the stock column."""

from __future__ import annotations

from pooled_runner.kernels.dequant import FMT_DENSE, FMT_INT4, FMT_NVFP4

from bench.kernel_variants import ALIGN_SWEEP_CASES, ALIGN_SWEEP_TILES, variant_specs


def test_variant_columns_unique_default_first_swap_paired():
    for fmt in (FMT_DENSE, FMT_INT4, FMT_NVFP4):
        specs = variant_specs(2048, 768, fmt, 8)
        names = [name for name, _ in specs]
        assert names[0] == "default" and len(set(names)) == len(names), names
        kw = dict(specs)
        for path in ("align", "inline"):
            plain, swapped = kw[path]["configs"], kw[f"{path} swap"]["configs"]
            assert all(not c.swap_ab for c in plain) and all(c.swap_ab for c in swapped)
            # the same tiles, only the operand order differs
            assert [(c.block_m, c.block_n, c.block_k, c.num_stages) for c in plain] == [
                (c.block_m, c.block_n, c.block_k, c.num_stages) for c in swapped
            ]


def test_sweep_tiles_and_cases_well_formed():
    assert len(set(ALIGN_SWEEP_TILES)) == len(ALIGN_SWEEP_TILES)
    for bn1, bn2, bk, warps, stages, swap in ALIGN_SWEEP_TILES:
        assert min(bn1, bn2) >= 16 and bk >= 16 and warps in (4, 8) and stages >= 1 and isinstance(swap, bool)
    assert all(variant in ("align", "inline") and M >= 1 for _, _, variant, M in ALIGN_SWEEP_CASES)


def test_stock_ratio_only_on_the_card_it_was_measured_on():
    """DESIGN.md §4's stock times are H200 numbers: bench.kernels shows a ratio to them on an H200 only (an H100
    row against them read 0.99x at Qwen3-like M=1 where the same card's stock was 1.17x slower, 2026-12-07)."""
    from bench.kernels import stock_us

    assert stock_us("qwen3", 1, "NVIDIA H200") == 31.7
    assert stock_us("qwen3", 16, "NVIDIA H200 NVL") == 197.0
    assert stock_us("qwen3", 1, "NVIDIA H100 80GB HBM3") is None
    assert stock_us("qwen3", 1, "NVIDIA GH200 480GB") is None
    assert stock_us("qwen3", 2, "NVIDIA H200") is None  # not measured there
    assert stock_us("deepseek", 1, "NVIDIA H200") is None
