"""Shared test setup: Triton's interpreter on CPU-only machines; GPU tests skip cleanly without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Without CUDA, Triton kernels run only under Triton's interpreter, and that choice is fixed when
# triton.language is first imported (its own @jit helpers, e.g. tl.cdiv, are decorated then). Choose it here,
# before any test module or SGLang (which imports Triton) can import Triton. Servers started by the engine
# tests get an environment without it (tests/engine/server.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA, `gpu` tests skip; where the kernels are compiled (not interpreted), `interpreter` tests skip
    and name the GPU file that covers them (`pytest.mark.interpreter(gpu="tests/..._gpu.py")`)."""
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # imported here, after the interpreter choice above: importing the kernels fixes it
    from pooled_runner.kernels.gemm_args import interpreting

    if interpreting():
        return
    for item in items:
        marker = item.get_closest_marker("interpreter")
        if marker is not None:
            where = marker.kwargs.get("gpu", "the *_gpu.py tests")
            item.add_marker(pytest.mark.skip(reason=f"interpreter tests; the GPU runs {where}"))


@pytest.fixture(autouse=True, scope="session")
def _spec_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The cost governor keeps its calibration by default (`envs.spec_state_dir`): no test, nor a server an engine
    test starts (it inherits this environment), may read what an earlier run left in the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POOLED_RUNNER_SPEC_STATE_DIR", str(tmp_path_factory.mktemp("spec-state")))
        yield


@pytest.fixture(autouse=True)
def _interpreter_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton also reads TRITON_INTERPRET at launch time: set it while each `interpreter` test runs (another
    test, or `tests/interpreter.py`'s imports, may have taken it out of the environment)."""
    if request.node.get_closest_marker("interpreter") is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
