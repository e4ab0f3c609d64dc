"""Environment knobs, all typed and all under one prefix: POOLED_RUNNER_.

Read through the functions here, never with os.environ elsewhere, so the full list lives in one place.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Mapping

PREFIX = "POOLED_RUNNER_"
# Every name a function below reads, plus the test harness's two (scripts/test.sh, tests/engine/server.py).
KNOWN = frozenset(
    {
        "LOG_LEVEL", "FORCE_TORCH_PATH", "DEBUG_CHECKS", "TORCH_PLANNER", "PLAN_SPLIT_COPY", "PLAN_COOPERATIVE",
        "PLAN_PDL", "PLAN_OVERLAP", "MOE_PDL", "CACHE_DIR", "SPEC_STATE_DIR", "MOE_DECODE", "SERVE_CONFIG",
        "TEST_WORKERS", "TEST_STARTUP_TIMEOUT",
    }
)  # fmt: skip
_checked = False


def check_names(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a `POOLED_RUNNER_` variable that no knob reads: a misspelt knob would otherwise be ignored in
    silence and the run would use the default. Raises ValueError naming the closest knob. The knob readers
    below call it once per process, at the first read."""
    unknown = sorted(k for k in (os.environ if environ is None else environ) if k.startswith(PREFIX))
    unknown = [k for k in unknown if k[len(PREFIX) :] not in KNOWN]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k[len(PREFIX) :], sorted(KNOWN), n=1, cutoff=0.5)
            hints.append(f"{k} (did you mean {PREFIX}{close[0]}?)" if close else k)
        raise ValueError(
            f"unknown environment variable(s) {', '.join(hints)}; the knobs are "
            f"{', '.join(PREFIX + n for n in sorted(KNOWN))} (pooled_runner/envs.py): unset or rename it"
        )


def _read(name: str) -> str | None:
    global _checked
    if not _checked:
        check_names()
        _checked = True
    assert name in KNOWN, f"{name} is read but not in envs.KNOWN"
    return os.environ.get(PREFIX + name)


def _get_bool(name: str, default: bool) -> bool:
    raw = _read(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")


def _get_str(name: str, default: str) -> str:
    return _read(name) or default


def log_level() -> str:
    """POOLED_RUNNER_LOG_LEVEL: level of the `pooled_runner` logger (default INFO; any name `logging` takes)."""
    value = _get_str("LOG_LEVEL", "INFO").strip().upper()
    # getLevelName maps a registered name to its number (getLevelNamesMapping is Python >= 3.11 only)
    if not isinstance(logging.getLevelName(value), int):
        raise ValueError(
            f"{PREFIX}LOG_LEVEL={value!r}: expected a logging level (DEBUG, INFO, WARNING, ERROR)"
        )
    return value


def force_torch_path() -> bool:
    """POOLED_RUNNER_FORCE_TORCH_PATH: run the plain torch forward even where kernels are available."""
    return _get_bool("FORCE_TORCH_PATH", False)


def debug_checks() -> bool:
    """POOLED_RUNNER_DEBUG_CHECKS: extra consistency checks (slow; tests and debugging).

    Under tensor parallelism: at every stats boundary the ranks all-gather a hash of their location tables
    (and telemetry) and stop with `TablesDisagree`, naming the layer and step, if any rank differs.
    """
    return _get_bool("DEBUG_CHECKS", False)


def torch_planner() -> bool:
    """POOLED_RUNNER_TORCH_PLANNER: plan decode steps with torch ops instead of the fused plan kernels (A/B)."""
    return _get_bool("TORCH_PLANNER", False)


def plan_split_copy() -> bool:
    """POOLED_RUNNER_PLAN_SPLIT_COPY: run the fused planner's admission copy as its own launch (`plan_lru` or
    `plan_adaptive`, then `gather_rows_multi`) instead of inside the plan launch (`kernels/plan_copy.py`,
    `kernels/plan_adaptive_copy.py`; A/B and fallback)."""
    return _get_bool("PLAN_SPLIT_COPY", False)


def plan_cooperative() -> bool:
    """POOLED_RUNNER_PLAN_COOPERATIVE: launch the one-launch plan + copy as a cooperative grid where Triton
    supports it. Default off: its programs take their roles by ticket (`kernels/plan_sync._draw_ticket`), so the
    program the others wait for has started and no co-residency is needed; the plain grid measured faster on the
    H200 (2026-12-02, `bench/planner.py`)."""
    return _get_bool("PLAN_COOPERATIVE", False)


def plan_pdl() -> bool:
    """POOLED_RUNNER_PLAN_PDL: launch the one-launch plan + copy as a programmatic dependent launch (sm_90+; it
    waits for the kernel before it first thing). Default on: together with overlap it cut the planner's cost on
    the H200 (2026-12-02, `bench/planner.py`, see docs/BENCHMARKS.md)."""
    return _get_bool("PLAN_PDL", True)


def plan_overlap() -> bool:
    """POOLED_RUNNER_PLAN_OVERLAP: let the one-launch plan + copy of a device-planned decode step trigger the
    MoE's first GEMM at its start, so that the GEMM's programs of resident experts run beside the plan
    (`kernels/plan_copy.py`); those of host-view experts still wait for it. Default on where the device has PDL
    (elsewhere nothing can run beside the plan). Measured on the H200 (6 Qwen3-like bf16 layers, M=1, graph
    replay): with the cooperative launch and no PDL it gained 0.5% of the step (2026-12-01: 190.5 vs 191.4 µs) and,
    in one run of 2026-12-02, 10.0% against 15.7% planner share; with the plan + copy PDL-launched as a plain grid the planner's share
    fell to 2.5-2.7% (three runs, 8.1% in a fourth; docs/BENCHMARKS.md). Off with PDL on (the other defaults) was
    the slowest launch form of `bench/planner_forms.py` in three runs (2026-12-02): 2-4% slower at one token per
    step, 0.5-13.5% at 64; to leave the overlap out, take the old form whole (POOLED_RUNNER_PLAN_PDL=0 and
    POOLED_RUNNER_PLAN_COOPERATIVE=1 as well): 2% slower at one token, even at 64."""
    return _get_bool("PLAN_OVERLAP", True)


def moe_pdl() -> bool:
    """POOLED_RUNNER_MOE_PDL: launch the MoE's gemm2 as a programmatic dependent of gemm1 on sm_90+ (default on,
    except for the formats where it measured slower: `kernels/pdl.py`). Read once, at import."""
    return _get_bool("MOE_PDL", True)


def cache_dir() -> str:
    """POOLED_RUNNER_CACHE_DIR: where generated checkpoints (the embedded model) and, by default, the cost
    governor's calibration (`spec_state_dir`) are kept."""
    return _get_str("CACHE_DIR", "~/.cache/pooled_runner")


def spec_state_dir() -> str:
    """POOLED_RUNNER_SPEC_STATE_DIR: the directory of the cost governor's calibration files under
    `--moe-expert-pool-spec-governor-state auto` (default: `spec_governor` in POOLED_RUNNER_CACHE_DIR). The tests
    point it at a temporary directory, so no test reads what an earlier run left."""
    return _get_str("SPEC_STATE_DIR", "") or os.path.join(cache_dir(), "spec_governor")


def moe_decode_kernel() -> str:
    """POOLED_RUNNER_MOE_DECODE: kernels of decode steps (T*K <= 64 routed pairs; `gemv` up to 128) on the CUDA
    kernel path.

    Unset (""): the measured default per format and width (`kernels/fused_moe.py` `default_variant`).
    `align`: align + gemm1 + gemm2 + combine, as wider steps. `align-fc`: the combine fused into
    gemm2. `inline`: no align launch (each gemm program computes its block), combine fused. `gemv`: two launches
    on CUDA cores (kernels/gemv.py). `mma`: the two-launch MMA decode path (kernels/decode.py). `splitk`: one
    launch (kernels/splitk.py; dense weights, the others take the default). Read once, at import
    (kernels/fused_moe.py).
    """
    value = _get_str("MOE_DECODE", "").strip().lower()
    if value not in ("", "align", "align-fc", "inline", "gemv", "mma", "splitk"):
        raise ValueError(
            f"{PREFIX}MOE_DECODE={value!r}: expected align, align-fc, inline, gemv, mma or splitk"
        )
    return value


def serve_config() -> str:
    """POOLED_RUNNER_SERVE_CONFIG: JSON of the resolved serving config, set by the launcher for its children."""
    return _get_str("SERVE_CONFIG", "")


def check_all() -> list[str]:
    """Read every knob once and return each problem (an unknown name, a value a knob refuses), so that a launch
    refuses a bad environment before it starts anything rather than when a child first reads the knob."""
    try:
        check_names()
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for read in READERS:
        try:
            read()
        except ValueError as exc:
            problems.append(str(exc))
    return problems


# every knob reader above (tests/test_launch_refusals.py checks that none is missing)
READERS: tuple[Callable[[], object], ...] = (
    log_level, force_torch_path, debug_checks, torch_planner, plan_split_copy, plan_cooperative, plan_pdl,
    plan_overlap, moe_pdl, cache_dir, spec_state_dir, moe_decode_kernel, serve_config,
)  # fmt: skip
