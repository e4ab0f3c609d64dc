"""bench/gemv_sweep.py on the CPU: its `--alt` parsing and the config sets it sweeps."""

from __future__ import annotations

import dataclasses

import pytest
from pooled_runner.kernels.gemv import GemvConfig

from bench.gemv_sweep import _alt_fields, _differs_for, _row, down_configs, gate_up_configs
from bench.kernel_variants import DecodeLayer


def test_alt_fields_parse_each_config():
    assert _alt_fields("split_k2=2,max_registers=0") == {"split_k2": 2, "max_registers": 0}
    cfg = dataclasses.replace(GemvConfig(), **_alt_fields("prefetch=1,block_n2=32"))
    assert cfg.prefetch_code() == 1 and cfg.block_n2 == 32


@pytest.mark.parametrize("text", ["splitk=2", "split_k2", "split_k2=two"])
def test_alt_fields_refuse_what_is_not_a_field(text):
    with pytest.raises((SystemExit, ValueError)):
        _alt_fields(text)


def test_config_sets_start_at_the_default_without_repeats():
    base = GemvConfig(32, 256, 64, 256, prefetch=False, max_registers=96)
    for configs in (gate_up_configs(base), down_configs(base)):
        assert configs[0] == base and len(set(configs)) == len(configs)
    assert {c.split_k2 for c in down_configs(base)} == {1, 2, 4}


def test_alt_configs_rerun_only_where_the_kernel_reads_the_change():
    base = GemvConfig(32, 256, 64, 256, prefetch=False, max_registers=96)
    split_down = dataclasses.replace(base, split_k2=2)
    assert not _differs_for("gate_up", split_down, base)
    assert _differs_for("down", split_down, base) and _differs_for("layer", split_down, base)
    capped = dataclasses.replace(base, max_registers=128)
    assert all(_differs_for(k, capped, base) for k in ("gate_up", "down", "layer"))
    assert not _differs_for("down", dataclasses.replace(base, one_launch=True), base)


def test_rows_name_each_kernels_own_load_mode_and_cap():
    base = GemvConfig(
        32, 256, 64, 256, prefetch=True, max_registers=128, down_prefetch=0, down_max_registers=96
    )
    cells = {
        k: _row("deepseek", "nvfp4", 1, k, base, 1.0, 50.0, 0.0).split(" | ")
        for k in ("gate_up", "down", "layer")
    }
    # columns: shape, format, M, kernel, BN, BK, warps, prefetch, split K, max regs, word dot, ...
    assert cells["gate_up"][7:11] == ["1", "1", "128", "fp32"], cells
    assert cells["down"][7:10] == ["0", "1", "96"], cells
    assert cells["layer"][7:10] == ["1/0", "1", "128/96"], cells
    half = _row("deepseek", "nvfp4", 1, "layer", dataclasses.replace(base, half_dot=True), 1.0, 50.0, 0.0)
    assert half.split(" | ")[10] == "half", half
    # the combine column: fused in down's epilogue, or its own kernel (fuse_combine=0); none for gate_up
    separate = dataclasses.replace(base, fuse_combine=False)
    assert [_row("deepseek", "nvfp4", 1, k, c, 1.0, 50.0, 0.0).split(" | ")[11] for k, c in
            (("gate_up", base), ("down", base), ("down", separate), ("layer", separate))] == \
        ["-", "fused", "kernel", "kernel"]  # fmt: skip
    assert _differs_for("down", separate, base)
    # the schedule column: the sort's width or pair order, and one launch; both kernels read the width
    unsorted = dataclasses.replace(base, schedule_width=0)
    assert [_row("deepseek", "nvfp4", 1, "layer", c, 1.0, 50.0, 0.0).split(" | ")[12] for c in
            (base, unsorted, dataclasses.replace(base, one_launch=True, down_max_registers=-1, down_prefetch=-1),
             dataclasses.replace(base, down_prefetch=0, schedule_width=8, down_peel=True))] == \
        ["sort 64", "pair order", "one launch, sort 64", "sort 8, peel"]  # fmt: skip
    assert _differs_for("gate_up", unsorted, base) and _differs_for("down", unsorted, base)
    assert _differs_for("down", dataclasses.replace(base, half_dot=True), base)
    assert not _differs_for("gate_up", dataclasses.replace(base, down_prefetch=1), base)
    assert _differs_for("down", dataclasses.replace(base, down_prefetch=1), base)


@pytest.mark.parametrize("fmt_name", ["FMT_DENSE", "FMT_INT4", "FMT_NVFP4", "FMT_FP8_BLOCK"])
def test_config_sets_build_from_every_default(monkeypatch, fmt_name):
    """The sweeps' config sets (bench.gemv_sweep's and bench.kernel_variants') are valid configs around every
    format's compiled default (132 SMs, DeepSeek-like and Qwen3-like, one token and eight): a set that turns a
    default's knob into a clash (the register prefetch on a default that peels down) fails here, not on the GPU;
    an --alt that clashes is refused by name."""
    from pooled_runner.kernels import dequant, gemv_config

    from bench.gemv_sweep import _apply_alt, focus_configs
    from bench.kernel_variants import sweep_configs

    monkeypatch.setattr(gemv_config, "interpreting", lambda: False)
    monkeypatch.setattr(gemv_config, "_num_sms", lambda: 132)
    fmt = getattr(dequant, fmt_name)
    for H, I in ((7168, 2048), (2048, 768)):
        for pairs in (8, 64):
            base = gemv_config.gemv_configs(H, I, fmt, pairs, 128)
            sets = [gate_up_configs(base), down_configs(base), sweep_configs(base)]
            sets += [focus_configs(base, k) for k in ("gate_up", "down")]
            assert all(isinstance(c, GemvConfig) for configs in sets for c in configs)
    peeled = gemv_config.gemv_configs(7168, 2048, dequant.FMT_NVFP4, 8, 128)
    assert peeled.down_peel
    with pytest.raises(SystemExit, match="down_peel"):
        _apply_alt(peeled, {"prefetch": 1})
    assert _apply_alt(peeled, {"prefetch": 1, "down_peel": 0}).prefetch_code(down=True) == 1


def test_bound_adds_pool_rows_at_hbm_and_host_rows_at_zero_copy():
    # 3 experts of 7e6 bytes: 2 pool rows at 3000 GB/s and 1 host row at 50 GB/s
    layer = DecodeLayer(args=(), nbytes=3 * 7_000_000, host_nbytes=7_000_000)
    assert layer.bound_us(3000.0, 50.0) == pytest.approx(2 * 7e6 / 3000e3 + 7e6 / 50e3)
    resident = DecodeLayer(args=(), nbytes=21_000_000)
    assert resident.bound_us(3000.0, 50.0) == pytest.approx(21e6 / 3000e3)
    assert resident.pct_hbm(resident.bound_us(3000.0, 50.0), 3000.0) == pytest.approx(100.0)
    every_row = DecodeLayer(args=(), nbytes=21_000_000, host_nbytes=21_000_000)
    assert every_row.bound_us(3000.0, 50.0) == pytest.approx(21e6 / 50e3)
