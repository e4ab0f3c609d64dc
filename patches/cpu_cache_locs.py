"""Patch `sglang.kernels.ops.speculative.cache_locs._is_xpu` to True on a machine without CUDA.

Why: `assign_extend_cache_locs_uniform_func` (SGLang's verify write window) runs a Triton kernel on
CUDA/HIP/MUSA/XPU and otherwise falls back to `assign_extend_cache_locs_func`, whose branches are the same Triton
platforms, NPU and SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, which our CPU servers do not use), and no
else: here it returns None. With a draft depth of 1 or more the EAGLE v2
worker plans the verify step's write window itself and never calls it, but at depth 0 (adaptive speculation with
0 among the candidates: SGLang's slots for batch sizes >= 8, and every slot of our cost-aware governor) the
trivial verify input has no planned window, `eagle_prepare_for_verify` asks this function, and the target's
verify step (and the draft extend after it) write their K/V with `out_cache_loc=None`: wrong tokens from then
on, with no error. With the flag the module's Triton kernel runs (under Triton's interpreter; the launcher sets
`TRITON_INTERPRET=1` for speculative servers without CUDA). `_is_xpu` gates nothing else in that module; the
flag is read at call time. Only applied when CUDA is absent and speculative decoding is on, and left alone on
SGLang's CPU engine or an NPU (the XPU test comes before their native branches).
"""

from __future__ import annotations

from pooled_runner.patches._check import require_target

TARGET_MODULE = "sglang.kernels.ops.speculative.cache_locs"
TARGET_ATTR = "_is_xpu"


def apply() -> None:
    module = require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    if getattr(module, "_is_cpu", False) or getattr(module, "_is_npu", False):
        return  # a native branch serves the window there
    module._is_xpu = True  # type: ignore[attr-defined]
