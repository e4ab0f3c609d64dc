"""Kernel imports under Triton's interpreter (CPU test modules). Imports nothing of pooled_runner: it must run
before the kernels are imported."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def interpreter_imports() -> Iterator[None]:
    """Import kernels under Triton's interpreter where there is no CUDA (the choice is made when triton.jit
    decorates them), then restore TRITON_INTERPRET, so nothing else in the session (servers, other Triton users)
    inherits it. Use around a test module's kernel imports."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
