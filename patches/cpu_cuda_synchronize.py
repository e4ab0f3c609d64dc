"""Patch `torch.cuda.synchronize` (as called by `sglang.srt.models.qwen3_moe_mtp`) to a no-op without CUDA.

Why: a draft model that shares the target's embedding and lm_head (`Qwen3MoeForCausalLMMTP.set_embed_and_head`,
and the other NextN/MTP heads) calls `torch.cuda.synchronize()`, which raises on a machine without a CUDA
driver; on the CPU there is nothing to wait for. Only applied when CUDA is absent and speculative decoding is
on. The target symbol is torch's (SGLang calls it through the `torch` module), so the check is that the model
file still exists in the pinned SGLang and that torch really has no CUDA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from pooled_runner.patches._check import PatchError, require_target

TARGET_MODULE = "sglang.srt.models.qwen3_moe_mtp"
TARGET_ATTR = "Qwen3MoeForCausalLMMTP"


def apply() -> None:
    require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    if torch.cuda.is_available():
        raise PatchError(f"patch {__name__}: CUDA is available; torch.cuda.synchronize must stay as it is")
    original = torch.cuda.synchronize
    if getattr(original, "_pooled_runner_patched", False):
        return

    @functools.wraps(original)
    def synchronize(device: Any = None) -> None:
        return None

    synchronize._pooled_runner_patched = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = synchronize
