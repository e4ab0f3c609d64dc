"""`PoolRuntime.after_forward` (no SGLang needed): steps counted at the first pooled layer, boundaries every
`stats_interval` steps, and nothing counted or reported while a CUDA graph is captured."""

from __future__ import annotations

import pytest

import pooled_runner.sglang.runtime as runtime_mod
from pooled_runner.config import PoolConfig
from pooled_runner.sglang.runtime import PoolRuntime
from pooled_runner.sglang.serve_config import ServeConfig


def make_runtime(interval: int) -> tuple[PoolRuntime, list[int]]:
    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=4, device="cpu"), cpu=True, stats_interval=interval)
    )
    reports: list[int] = []
    rt.report = lambda: reports.append(rt.num_steps)  # type: ignore[method-assign]
    return rt, reports


def test_steps_counted_at_the_first_layer_with_a_boundary_every_interval() -> None:
    rt, reports = make_runtime(interval=3)
    widths = [5, 1, 7, 2, 9, 3, 4]
    for width in widths:
        for layer in (0, 1, 2):
            rt.after_forward(layer, width)
    assert (rt.num_steps, rt.num_tokens) == (len(widths), sum(widths))
    assert reports == [3, 6]


def test_a_capture_counts_no_step_and_runs_no_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, reports = make_runtime(interval=1)
    monkeypatch.setattr(runtime_mod, "capturing", lambda: True)
    for width in (1, 2, 4, 8):  # the capture's dummy batches
        rt.after_forward(0, width)
    assert (rt.num_steps, rt.num_tokens, reports) == (0, 0, [])
    monkeypatch.setattr(runtime_mod, "capturing", lambda: False)
    rt.after_forward(0, 6)
    assert (rt.num_steps, rt.num_tokens, reports) == (1, 6, [1])
