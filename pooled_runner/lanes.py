"""Step sizes: decode lanes (which steps take the captured, device-planned decode path) and prefill chunk
alignment (which chunk size the engine really runs on hybrid models).

Decode lanes: with speculative decoding a verify step carries `1 + num_speculative_tokens` tokens per request,
so the decode path must serve `max_running_requests x (1 + num_speculative_tokens)` tokens; only larger steps
take the partition/staging path. (Regression guarded: 1 request with 3 speculative tokens sends 4-token verify
steps, which must stay on the decode path.)

Chunk alignment: hybrid models checkpoint their recurrent state on a grid, and SGLang rounds prefill chunk cut
points down to `page_size` and `truncation_align_size`, so a chunk that is not a multiple of the grid is
silently clipped (seed: 8192 ran as 4608-token steps). Pick the largest multiple of the grid within the budget
and say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def decode_lanes(max_running_requests: int, num_speculative_tokens: int = 0) -> int:
    """Tokens one decode step may carry: `max_running_requests x (1 + num_speculative_tokens)`."""
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests={max_running_requests} must be >= 1")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
    return max_running_requests * (1 + num_speculative_tokens)


def adaptive_decode_lanes(max_running_requests: int, tokens_per_request_at: Callable[[int], int]) -> int:
    """Tokens one decode step may carry when the draft depth depends on the batch size (adaptive speculation:
    SGLang's slots allow depth 7 at batch sizes 1-7, 3 at 8-31, ...): the largest `bs x
    tokens_per_request_at(bs)` over batch sizes 1..max_running_requests."""
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests={max_running_requests} must be >= 1")
    return max(bs * tokens_per_request_at(bs) for bs in range(1, max_running_requests + 1))


def takes_decode_path(num_tokens: int, lanes: int) -> bool:
    """True when a step of `num_tokens` fits the decode lanes (decode, verify and draft steps alike)."""
    return 0 <= num_tokens <= lanes


def check_rows_for_verify(pool_rows: int, top_k: int, num_speculative_tokens: int) -> str | None:
    """A warning when the rows cannot hold one verify step's worst case (`top_k x (1 + num_spec)` experts).

    Not an error: the extra experts of such a step are read through the host view, which is correct but slow.
    """
    worst = top_k * (1 + num_speculative_tokens)
    if pool_rows < worst:
        return (
            f"--moe-expert-pool-rows {pool_rows} < top_k {top_k} x (1 + {num_speculative_tokens} speculative "
            f"tokens) = {worst}: a verify step whose tokens route to distinct experts reads the rest through the "
            f"host view; use >= {worst} rows for one request's worst case"
        )
    return None


@dataclass(frozen=True)
class SpecChecks:
    """What the launcher says about a speculative configuration: warnings to log, problems that refuse it."""

    warnings: list[str]
    problems: list[str]


def check_speculative(
    pool_rows: int,
    top_k: int,
    tokens_per_request: int,
    max_running_requests: int | None,
    staging_min_tokens: int | None,
    lanes: int | None = None,
) -> SpecChecks:
    """Check one request's verify width (`tokens_per_request` = 1 + num_spec) against the rows and staging.

    - rows < top_k x tokens_per_request: warned (`check_rows_for_verify`): correct, the rest goes through the
      host view, but every verify step whose tokens route apart misses.
    - staging on and one request's verify step alone reaches `staging_min_tokens`: refused. Steps of up to
      `lanes` tokens take the decode path and never stage, so such a width could never be told from a
      prefill step, even with `--max-running-requests 1`; the fix names the largest width that stays apart.
    - staging on and the lanes of all requests reach `staging_min_tokens`: warned: staging then starts at
      `lanes + 1` tokens.
    `staging_min_tokens` None = staging off; `max_running_requests` None = not known yet (resolved later);
    `lanes`: the decode lanes when they are not `max_running_requests x tokens_per_request` (adaptive speculation,
    `adaptive_decode_lanes`).
    """
    warnings: list[str] = []
    problems: list[str] = []
    if tokens_per_request < 1:
        problems.append(f"tokens per request {tokens_per_request} must be >= 1 (1 + speculative tokens)")
        return SpecChecks(warnings, problems)
    num_spec = tokens_per_request - 1
    rows_warning = check_rows_for_verify(pool_rows, top_k, num_spec)
    if rows_warning is not None:
        warnings.append(rows_warning)
    if staging_min_tokens is None:
        return SpecChecks(warnings, problems)
    if tokens_per_request >= staging_min_tokens:
        problems.append(
            f"one request's verify step carries 1 + {num_spec} speculative tokens = {tokens_per_request} >= "
            f"--moe-expert-pool-staging-min-tokens {staging_min_tokens}: the decode lanes would swallow "
            f"prefill-sized steps; use at most {staging_min_tokens - 2} speculative tokens "
            f"(--speculative-num-draft-tokens <= {staging_min_tokens - 1}), raise "
            f"--moe-expert-pool-staging-min-tokens above {tokens_per_request}, or pass "
            "--no-moe-expert-pool-prefill-staging"
        )
    elif max_running_requests is not None:
        how = "the widest adaptive step"
        if lanes is None:
            lanes = decode_lanes(max_running_requests, num_spec)
            how = f"--max-running-requests {max_running_requests} x {tokens_per_request} tokens per request"
        if lanes >= staging_min_tokens:
            warnings.append(
                f"decode lanes {lanes} = {how} >= --moe-expert-pool-staging-min-tokens {staging_min_tokens}: "
                f"steps of up to {lanes} tokens take the decode path, so prefill staging starts at {lanes + 1} "
                "tokens"
            )
    return SpecChecks(warnings, problems)


@dataclass(frozen=True)
class ChunkPlan:
    """The prefill chunk size the engine should be given, and why."""

    requested: int
    effective: int
    grid: int

    def message(self) -> str:
        return f"chunked prefill: requested {self.requested}, effective {self.effective} (grid {self.grid})"


def aligned_chunk_size(
    requested: int,
    page_size: int = 1,
    truncation_align_size: int | None = None,
    state_grid: int | None = None,
) -> ChunkPlan:
    """The largest chunk size <= `requested` that is a multiple of every grid the engine cuts on.

    Args:
      requested: the chunked-prefill budget (tokens).
      page_size: the KV page size (cut points are rounded down to it).
      truncation_align_size: SGLang's `Scheduler.truncation_align_size` (None when unset).
      state_grid: the hybrid model's state-checkpoint grid (SGLang `mamba_cache_chunk_size()`), or None for a
        model without recurrent state.
    Raises ValueError when even one grid step exceeds the budget (SGLang could not schedule such a chunk).
    """
    for name, value in (("requested", requested), ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    grid = page_size
    for extra in (truncation_align_size, state_grid):
        if extra is not None:
            if extra < 1:
                raise ValueError(f"grid {extra} must be >= 1")
            grid = math.lcm(grid, extra)
    if requested < grid:
        raise ValueError(
            f"--chunked-prefill-size {requested} is below one step of the chunk grid {grid} "
            f"(page_size {page_size}, truncation_align_size {truncation_align_size}, state grid {state_grid}); "
            f"use --chunked-prefill-size >= {grid}"
        )
    return ChunkPlan(requested, requested // grid * grid, grid)
