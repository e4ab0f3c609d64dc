"""bench/gemv_sweep.py on the CPU: its `--alt` parsing and the config sets it sweeps."""

from __future__ import annotations

import dataclasses

import pytest
from pooled_runner.kernels.gemv import GemvConfig

from bench.gemv_sweep import _alt_fields, down_configs, gate_up_configs


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
