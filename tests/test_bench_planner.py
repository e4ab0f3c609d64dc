"""CLI checks of `bench/planner.py` that run without a GPU: bad `--forms` / `--form-tokens` are refused before
any CUDA work, naming what is expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.planner", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--forms", "two"), "expected one-launch names"),  # the two-launch planner has no launch form
        (("--forms", "one,nope"), "expected one-launch names"),
        (("--forms", "one", "--form-tokens", "0"), "token counts >= 1"),
    ],
)
def test_bad_forms_refused(args: tuple[str, ...], message: str) -> None:
    result = _run(*args)
    assert result.returncode != 0, (args, result.stdout, result.stderr)
    assert message in result.stderr, (args, result.stderr)


def test_forms_are_one_launch_planners_and_the_first_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ratios in the table are to the first form: it must be what DevicePlanner launches by default."""
    from bench.planner_forms import FORMS
    from bench.planner_overhead import PLANNERS
    from pooled_runner import envs

    for knob in ("PLAN_COOPERATIVE", "PLAN_PDL", "PLAN_OVERLAP"):
        monkeypatch.delenv(envs.PREFIX + knob, raising=False)
    first = PLANNERS[FORMS[0]][1]
    assert (first["cooperative"], first["pdl"], first["overlap"]) == (
        envs.plan_cooperative(),
        envs.plan_pdl(),
        envs.plan_overlap(),
    ), first
    for name in FORMS:
        assert PLANNERS[name][1]["one_launch"] is True, name
