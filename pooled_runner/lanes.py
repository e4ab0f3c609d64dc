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
from dataclasses import dataclass


def decode_lanes(max_running_requests: int, num_speculative_tokens: int = 0) -> int:
    """Tokens one decode step may carry: `max_running_requests x (1 + num_speculative_tokens)`."""
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests={max_running_requests} must be >= 1")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
    return max_running_requests * (1 + num_speculative_tokens)


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
