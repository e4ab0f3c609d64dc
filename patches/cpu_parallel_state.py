"""Patch `sglang.srt.distributed.parallel_state.init_model_parallel_group` to default `use_pynccl=False`.

Why: on a machine without CUDA (`--tp-size > 1` on CPU) the PyNccl communicator calls
`torch.cuda.device(cpu)` and fails; the gloo groups work. Only applied when CUDA is absent. An explicit
`use_pynccl=` from the caller is kept.
"""

from __future__ import annotations

import functools
from typing import Any

from pooled_runner.patches._check import require_target

TARGET_MODULE = "sglang.srt.distributed.parallel_state"
TARGET_ATTR = "init_model_parallel_group"


def apply() -> None:
    module = require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    original = module.init_model_parallel_group
    if getattr(original, "_pooled_runner_patched", False):
        return

    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    init_model_parallel_group._pooled_runner_patched = True  # type: ignore[attr-defined]
    module.init_model_parallel_group = init_model_parallel_group
