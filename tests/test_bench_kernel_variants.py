"""bench/kernel_variants.py on the CPU: its columns and sweep tiles."""

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
