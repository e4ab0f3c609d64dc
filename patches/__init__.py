"""Patches of SGLang symbols, installed as `pooled_runner.patches`; one upstream symbol per module.

Nothing here is applied at import time: the launcher (and the wrapped child entry functions) apply each
patch explicitly. Every patch checks the SGLang version and that its target exists (`_check.py`).
"""

from __future__ import annotations


def apply_cpu_patches() -> list[str]:
    """Apply the patches a machine without CUDA needs; returns their module names (for the log)."""
    from pooled_runner.patches import cpu_parallel_state, cpu_rotary

    applied = []
    for patch in (cpu_rotary, cpu_parallel_state):
        patch.apply()
        applied.append(patch.__name__)
    return applied


def apply_cpu_speculative_patches() -> list[str]:
    """The extra patches speculative decoding (EAGLE/NEXTN) needs without CUDA; returns their module names."""
    from pooled_runner.patches import cpu_cache_locs, cpu_cuda_synchronize, cpu_spec_tree

    applied = []
    for patch in (cpu_spec_tree, cpu_cache_locs, cpu_cuda_synchronize):
        patch.apply()
        applied.append(patch.__name__)
    return applied
