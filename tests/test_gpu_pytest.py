"""scripts/gpu_pytest.sh, which runs the GPU test steps of scripts/gpu_check.sh: the tests marked
real_shape_layers in one process apart from the pytest-xdist workers, the others in the workers, and its exit
codes. On toy test files in a temporary folder (no GPU: the `gpu` marker only selects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytestmark = pytest.mark.slow  # pytest and its workers started about ten times: ~50 s

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_pytest.sh"

INI = """[pytest]
markers =
    gpu: toy
    real_shape_layers: toy
"""

TOY = """import json, os, pytest

def _record(name):
    with open(os.environ["TOY_RECORD"], "a") as f:
        row = [name, os.environ.get("PYTEST_XDIST_WORKER", "main"), os.getpid(), os.environ.get("OMP_NUM_THREADS")]
        f.write(json.dumps(row) + "\\n")

@pytest.mark.gpu
@pytest.mark.real_shape_layers
@pytest.mark.parametrize("i", range(5))
def test_layers_{mod}(i):
    _record("layers_{mod}")

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(7))
def test_rest_{mod}(i):
    _record("rest_{mod}")
    assert not {fail}

def test_not_gpu_{mod}():
    _record("not_gpu")
"""


def _run(tmp_path: Path, files: list[str], workers: int | str, **extra_env: str) -> tuple[int, list, str]:
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    env = dict(os.environ, TOY_RECORD=str(record), GPU_WORKERS=str(workers), PYTHON=sys.executable)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "OMP_NUM_THREADS", "OMP_THREAD_LIMIT"):
        env.pop(name, None)
    env.update(extra_env)
    proc = subprocess.run(
        ["bash", str(SCRIPT), *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc.returncode, rows, proc.stdout + proc.stderr


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_a.py").write_text(TOY.format(mod="a", fail=False))
    (tmp_path / "test_b.py").write_text(TOY.format(mod="b", fail=False))
    (tmp_path / "test_fails.py").write_text(TOY.format(mod="c", fail=True))
    (tmp_path / "test_none.py").write_text("def test_cpu():\n    pass\n")
    return tmp_path


def test_layers_tests_in_one_process_beside_the_workers(toy):
    rc, rows, out = _run(toy, ["test_a.py", "test_b.py"], workers=2)
    assert rc == 0, out
    layers = [r for r in rows if r[0].startswith("layers_")]
    rest = [r for r in rows if r[0].startswith("rest_")]
    assert len(layers) == 10 and len(rest) == 14, rows
    assert {(r[1], r[2]) for r in layers} == {("main", layers[0][2])}, f"layers tests spread: {layers}"
    assert {r[1] for r in rest} <= {"gw0", "gw1"} and layers[0][2] not in {r[2] for r in rest}, rows
    assert not any(r[0] == "not_gpu" for r in rows), "a test without the gpu marker ran"
    assert "real_shape_layers tests" in out
    # the cores shared out among the workers and the layers process: each worker's torch is not started with
    # a thread per core each (6 workers x 16 threads on 16 cores)
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    assert {r[3] for r in rows} == {share}, rows


def test_a_given_thread_count_is_kept(toy):
    rc, rows, out = _run(toy, ["test_a.py"], workers=2, OMP_NUM_THREADS="5")
    assert rc == 0, out
    assert len(rows) == 12 and {r[3] for r in rows} == {"5"}, rows


def test_one_process_without_workers(toy):
    rc, rows, out = _run(toy, ["test_a.py"], workers=0)
    assert rc == 0, out
    assert len(rows) == 12 and {(r[1], r[2]) for r in rows} == {("main", rows[0][2])}, rows


def test_exit_codes(toy):
    workers = 2
    rc, rows, out = _run(toy, ["test_a.py", "test_fails.py"], workers=workers)
    assert rc == 1, f"a failing test must fail the run: rc {rc}\n{out}"
    assert sum(r[0] == "layers_a" for r in rows) == 5, rows  # the other process still ran
    rc, rows, out = _run(toy, ["test_none.py"], workers=workers)
    assert rc == 5 and rows == [], f"nothing collected: rc {rc}\n{out}"
    rc, _, out = _run(toy, ["test_a.py"], workers=-1)
    assert rc == 2 and "GPU_WORKERS" in out
    rc, rows, out = _run(toy, ["test_a.py"], workers="08")
    assert rc == 0 and len(rows) == 12, f"GPU_WORKERS=08 read as octal? rc {rc}\n{out}"
