"""Patch `sglang.srt.speculative.eagle_worker_v2.AdaptiveSpeculativeParams` with `CostAwareSpecParams`.

Replaces: the class the EAGLE/NEXTN v2 worker instantiates for `--speculative-adaptive` (acceptance-length
rule). Why: with a pool a verify step's cost grows with its draft lanes' distinct experts, so the depth must be
chosen by measured tokens per second, with drafting off as a candidate (`pooled_runner/sglang/spec_governor.py`).
Applied in the scheduler process for `--moe-expert-pool-spec-governor cost` only; the worker reads the name when
it is built, after the patch.
"""

from __future__ import annotations

from pooled_runner.patches._check import require_target

TARGET_MODULE = "sglang.srt.speculative.eagle_worker_v2"
TARGET_ATTR = "AdaptiveSpeculativeParams"


def apply() -> None:
    module = require_target(TARGET_MODULE, TARGET_ATTR, __name__)
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    module.AdaptiveSpeculativeParams = CostAwareSpecParams  # type: ignore[attr-defined]
