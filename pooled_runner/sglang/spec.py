"""Speculative decoding (EAGLE / NEXTN / MTP) with the pool: decode lanes from SGLang's resolved arguments.

With speculative decoding a target verify step carries `speculative_num_draft_tokens` tokens per request
(`spec_utils.resolve_num_tokens_per_req(phase="target_verify")`) and a draft decode step
`speculative_eagle_topk`; the pool's decode path must serve `max_running_requests` times the widest of them
(`lanes.decode_lanes`), so a verify step never counts as a prefill step (never staged, later: captured).

`max_running_requests` and the speculative defaults (steps=3, topk=1, draft tokens=4 for the DeepSeek/Qwen MoE
families) are only final inside the scheduler, once the target's `ModelRunner` has sized its memory pools:
`install_lanes_hook` reads them there (HookRegistry AFTER `ModelRunner.alloc_memory_pool`, which only reads),
sets the lanes, logs them, and runs the launcher's checks again on the resolved values. The launcher checks
what the command line already fixes (`check_launch`).

The draft model's MoE layers are built in SGLang's draft scope (`is_draft`) and are never pooled
(`layer.not_pooled_reason`); they keep their experts on the device behind the runtime's one warning.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

from pooled_runner.lanes import adaptive_decode_lanes, check_speculative, decode_lanes
from pooled_runner.sglang.runtime import get_runtime

logger = logging.getLogger("pooled_runner")

ALLOC_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
GRAPHS_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"


def tokens_per_request(speculative: bool, num_draft_tokens: int | None, eagle_topk: int | None) -> int:
    """Tokens one request puts into a pooled step: 1 without speculation, else the widest speculative phase.

    Raises ValueError when speculation is on but the number of draft tokens is not known (resolve it first).
    """
    if not speculative:
        return 1
    if num_draft_tokens is None:
        raise ValueError("speculative decoding without a resolved --speculative-num-draft-tokens")
    return max(int(num_draft_tokens), int(eagle_topk or 1), 1)


def check_launch(server_args: Any, pool_rows: int, top_k: int, staging_min_tokens: int | None) -> list[str]:
    """The launcher's check of SGLang's resolved arguments; returns warnings, raises ValueError to refuse.

    Only what the command line fixes is checked here (SGLang resolves the speculative defaults and
    `max_running_requests` later, in the scheduler, where `install_lanes_hook` checks them again). With
    `--speculative-adaptive` the width is that of the widest candidate depth.
    """
    if not server_args.speculative_algorithm:
        return []
    from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens

    # with --speculative-adaptive: the widest candidate depth's verify step
    bounds = (server_args.speculative_num_draft_tokens, max_speculative_num_draft_tokens(server_args))
    known = [int(n) for n in bounds if n is not None]
    if not known:
        return []
    num_draft_tokens = max(known)
    width = tokens_per_request(True, num_draft_tokens, server_args.speculative_eagle_topk)
    # with --speculative-adaptive the lanes are not max_running x the widest width (deep drafts only at small
    # batch sizes): their warning waits for the scheduler's check, which has SGLang's slots (`_lanes`)
    max_running = None if server_args.speculative_adaptive else server_args.max_running_requests
    checks = check_speculative(pool_rows, top_k, width, max_running, staging_min_tokens)
    if checks.problems:
        raise ValueError("cannot launch:\n  - " + "\n  - ".join(checks.problems))
    return checks.warnings


def _runner_widths(runner: Any) -> tuple[int, str]:
    """Tokens per request of this target runner's pooled steps, and how they were derived (for the log).

    With `--speculative-adaptive` the verify width changes with the depth SGLang (or our governor) runs: this is
    the widest candidate's (`_adaptive_slot_widths`), as SGLang's `ModelRunner.max_decode_logits_rows` sizes its
    buffers.
    """
    if not runner.spec_algorithm.is_speculative():
        return 1, "no speculative decoding"
    from sglang.srt.runtime_context import get_spec, max_speculative_num_draft_tokens

    spec = get_spec()
    verify = max(  # SGLang's own target_verify width; None: its starting width
        int(runner.decode_num_tokens_per_req(num_draft_tokens=n))
        for n in (None, max_speculative_num_draft_tokens())
    )
    slot_widths = _adaptive_slot_widths(runner)
    if slot_widths:
        verify = max(verify, *slot_widths.values())
    topk = spec.speculative_eagle_topk
    width = tokens_per_request(True, verify, topk)
    adaptive = ", the widest adaptive depth" if slot_widths else ""
    return width, f"{verify} tokens per request in target verify{adaptive}, eagle topk {topk}"


def _adaptive_slot_widths(runner: Any) -> dict[int, int] | None:
    """With `--speculative-adaptive`: per slot (keyed by its smallest batch size), the verify tokens per request
    at its deepest candidate; None without it. A batch of `bs` requests runs in the slot of the largest key <=
    bs, else the smallest (`AdaptiveSpeculativeParams._find_closest_bs`; no CUDA-graph padding: our launcher runs
    SGLang without its graph runner)."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if not runner.spec_algorithm.is_speculative() or not spec.speculative_adaptive:
        return None
    from sglang.srt.speculative.adaptive_spec_params import _load_adaptive_config

    _, entries = _load_adaptive_config(spec.speculative_adaptive_config)
    return {
        key: int(runner.decode_num_tokens_per_req(num_draft_tokens=max(entry["candidate_steps"]) + 1))
        for key, entry in entries.items()
    }


def _width_at(slot_widths: dict[int, int], bs: int) -> int:
    """Verify tokens per request of a batch of `bs` requests (see `_adaptive_slot_widths`)."""
    keys = sorted(slot_widths)
    return slot_widths[keys[max(bisect.bisect_right(keys, bs) - 1, 0)]]


def _lanes(runner: Any, max_running: int, width: int) -> tuple[int, str]:
    """The decode lanes of this runner and how they were derived."""
    slot_widths = _adaptive_slot_widths(runner)
    if slot_widths is None:
        lanes = decode_lanes(max_running, width - 1)
        return lanes, f"max_running_requests {max_running} x {width} tokens per request"
    lanes = adaptive_decode_lanes(max_running, lambda bs: _width_at(slot_widths, bs))
    return lanes, f"the widest adaptive step up to max_running_requests {max_running}"


def after_alloc_memory_pool(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """Set the pool's decode lanes from the target runner's resolved `max_running_requests` (draft: skipped)."""
    runtime = get_runtime()
    if runtime is None or runner.is_draft_worker:
        return None
    width, how = _runner_widths(runner)
    max_running = int(runner.max_running_requests)
    lanes, lanes_how = _lanes(runner, max_running, width)
    moe = runtime.moe
    if moe is not None:
        staging = runtime.config.staging_min_tokens if runtime.config.prefill_staging else None
        checks = check_speculative(runtime.config.pool_rows, moe.top_k, width, max_running, staging, lanes)
        for warning in checks.warnings:
            logger.warning("pooled_runner: %s", warning)
        if checks.problems:
            raise ValueError("pooled_runner: " + "; ".join(checks.problems))
    runtime.set_decode_lanes(lanes, f"{lanes_how}: {how}")
    return None


def after_init_cuda_graphs(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """Warn when the target captured decode widths the lanes do not serve (they would leave the decode path)."""
    runtime = get_runtime()
    if runtime is None or runner.is_draft_worker or runtime.decode_lanes is None:
        return None
    capture_bs = list(getattr(runner, "decode_cuda_graph_capture_bs", []) or [])
    if not capture_bs:
        return None
    width, _ = _runner_widths(runner)
    slot_widths = _adaptive_slot_widths(runner)

    def width_at(bs: int) -> int:
        return width if slot_widths is None else _width_at(slot_widths, bs)

    too_wide = [bs * width_at(bs) for bs in capture_bs if bs * width_at(bs) > runtime.decode_lanes]
    if too_wide:
        logger.warning(
            "pooled_runner: decode graphs captured at %s tokens, wider than the decode lanes %d",
            too_wide,
            runtime.decode_lanes,
        )
    else:
        logger.info(
            "pooled_runner: decode graphs captured at batch sizes %s (up to %d tokens, lanes %d)",
            capture_bs,
            max(bs * width_at(bs) for bs in capture_bs),
            runtime.decode_lanes,
        )
    return None


def install_lanes_hook() -> None:
    """Register the AFTER hooks on the target `ModelRunner` (idempotent; HookRegistry applies each once)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pooled_runner.patches._check import require_hook_target

    for target, hook in ((ALLOC_TARGET, after_alloc_memory_pool), (GRAPHS_TARGET, after_init_cuda_graphs)):
        if target in HookRegistry._patched:
            continue
        require_hook_target(
            target, f"decode lanes ({hook.__name__})"
        )  # the SGLang version it was written for
        HookRegistry.register(target, hook, HookType.AFTER)
    HookRegistry.apply_hooks()
    missing = [t for t in (ALLOC_TARGET, GRAPHS_TARGET) if t not in HookRegistry._patched]
    if missing:
        raise RuntimeError(f"pooled_runner: HookRegistry did not hook {missing}; see the log above")
