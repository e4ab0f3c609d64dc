"""Patch `sglang.kernels.ops.speculative.spec_tree._is_xpu` to True on a machine without CUDA.

Why: the EAGLE/NEXTN tree build and verify call `sgl_build_tree_kernel_efficient` and friends from sgl_kernel's
CUDA build unless `_is_xpu` is set (otherwise: `NameError sgl_build_tree_kernel_efficient`); with the flag they
take the module's pure-Triton versions, which run under Triton's interpreter (`TRITON_INTERPRET=1` for that
server). Only applied when CUDA is absent and speculative decoding is on. The flag is read at call time.
"""

from __future__ import annotations

from pooled_runner.patches._check import require_target

TARGET_MODULE = "sglang.kernels.ops.speculative.spec_tree"
TARGET_ATTR = "_is_xpu"


def apply() -> None:
    module = require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    module._is_xpu = True  # type: ignore[attr-defined]
