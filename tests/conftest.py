"""Shared test setup: Triton's interpreter on CPU-only machines; GPU tests skip cleanly without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run only under Triton's interpreter, and that choice is fixed when
# triton.language is first imported (its own @jit helpers, e.g. tl.cdiv, are decorated then). Choose it here,
# before any test module or SGLang (which imports Triton) can import Triton. Servers started by the engine
# tests get an environment without it (tests/engine/server.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
