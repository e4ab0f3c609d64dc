"""Patch `sglang.srt.layers.rotary_embedding.base._is_cpu` to True on a machine without CUDA.

Why: `RotaryEmbedding.__init__` imports `vllm._custom_ops` unless `_is_cpu` is set, and `_is_cpu` is only
True for SGLang's CPU build (`SGLANG_USE_CPU_ENGINE`, which needs a CPU build of sgl_kernel that PyPI does
not ship). With the flag set, rotary embeddings take their `forward_native` path. Apply before any model is
built (the flag is read in `__init__`).
"""

from __future__ import annotations

from pooled_runner.patches._check import require_target

TARGET_MODULE = "sglang.srt.layers.rotary_embedding.base"
TARGET_ATTR = "_is_cpu"


def apply() -> None:
    module = require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    module._is_cpu = True  # type: ignore[attr-defined]
