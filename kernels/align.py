"""Align + locate: routed (token, k) pairs -> M-blocks per logical expert -> location codes, on the device.

Outputs (all device tensors, sized by upper bounds so a CUDA graph can capture them; nothing is read back):
  sorted_pairs   `[max_blocks * block_m]` int32: flat pair index `t * K + k` for each slot, grouped by expert in
                 ascending expert order, ascending pair order inside an expert; `num_pairs` (= T*K) marks a
                 padding slot.
  block_experts  `[max_blocks]` int32: logical expert of each M-block, -1 past the used blocks.
  block_codes    `[max_blocks]` int32: `l2p[block_experts]` (0..R-1 pool row, R+e host row, -1 skip).
  block_order    `[max_blocks]` int32: the used blocks, host-row blocks first (stragglers start early), then
                 the pool-row blocks, each group in block order; -1 past the used blocks.
  num_post_padded `[1]` int32: used slots (= used blocks * block_m).

Padding ids (-1) and ids >= num_experts are not placed: their pairs contribute nothing downstream.
Upper bound of used blocks: each expert with c pairs uses ceil(c / block_m) blocks, so
`max_blocks = min(N, ceil(N / block_m) + E)` with N = T*K.

Device paths with identical results (`PATHS`; `default_path` picks one by N): "tiny", one program of [N, N]
compares in registers (here; N <= TINY_MAX_PAIRS, forced up to TINY_FORCED_MAX_PAIRS); "sort", one program
that sorts (expert, pair) keys in registers (`align_sort.py`, N <= SORT_MAX_PAIRS, forced up to
SORT_COMPILED_MAX_PAIRS); "wide", three launches (count per chunk, scan, scatter; `align_wide.py`) above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .align_sort import (
    SORT_COMPILED_MAX_PAIRS,
    SORT_MAX_PAIRS,
    _align_sort_kernel,
    sort_launch_args,
    store_block_tables,
)

# Up to this many pairs the [N, N]-compare program: 2.7-3.0 µs against the sort's 3.1-3.2 at Qwen3-like 8-32
# pairs, 2.9-3.8 against 3.7-4.1 at DeepSeek-like ones; 6.4 against 3.7 at 64 (H100, 2026-12-07, bench.align_time)
TINY_MAX_PAIRS = 32


@dataclass(frozen=True)
class AlignOutput:
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32
    block_experts: torch.Tensor  # [max_blocks] int32
    block_codes: torch.Tensor  # [max_blocks] int32
    block_order: torch.Tensor  # [max_blocks] int32
    num_post_padded: torch.Tensor  # [1] int32
    block_m: int
    # aligned before the step's plan (`align_blocks(before_plan=True)`): the layout reads only the ids, but
    # block_codes / block_order are the old table's; only the OVERLAP GEMMs (which locate each block's expert
    # themselves) may take it
    before_plan: bool = False

    @property
    def max_blocks(self) -> int:
        return self.block_codes.shape[0]


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of used M-blocks for `num_pairs` routed pairs over `num_experts` experts."""
    return max(1, min(num_pairs, triton.cdiv(num_pairs, block_m) + num_experts))


@triton.jit
def _align_tiny_kernel(
    ids_ptr,
    l2p_ptr,
    sorted_ptr,
    block_experts_ptr,
    block_codes_ptr,
    block_order_ptr,
    num_post_ptr,
    num_pairs,
    num_experts,
    num_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    P_POW2: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """The [N, N]-compare path, for N <= P_POW2 pairs with no global round trip between phases: counts, ranks,
    segment starts and the block table come from [P, P] compares of the ids in registers; the only dependent
    loads are ids -> l2p codes (per pair, then selected per block), and one barrier orders the padding fill
    of `sorted_pairs` before the scatter of the pairs into it."""
    i = tl.arange(0, P_POW2)
    raw = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
    valid = (
        (i < num_pairs) & (raw >= 0) & (raw < num_experts)
    )  # on the loaded width (int64 ids not cut first)
    e = raw.to(tl.int32)
    code = tl.load(l2p_ptr + e, mask=valid, other=-1)
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]  # [i, j]
    before = (i[None, :] < i[:, None]).to(tl.int32)
    rank = tl.sum(same.to(tl.int32) * before, axis=1)  # earlier pairs of my expert
    count = tl.sum(same.to(tl.int32), axis=1)
    first = valid & (rank == 0)  # one representative per expert
    padded = tl.where(first, tl.cdiv(count, BLOCK_M) * BLOCK_M, 0)
    smaller = first[None, :] & (e[None, :] < e[:, None])  # [i, j]: j is the first pair of a smaller expert
    start = tl.sum(tl.where(smaller, padded[None, :], 0), axis=1)  # my expert's first slot
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    # sorted_pairs: padding everywhere, then (after the barrier) each pair at its slot
    for s0 in range(0, max_blocks * BLOCK_M, S_CHUNK):
        sl = s0 + tl.arange(0, S_CHUNK)
        tl.store(sorted_ptr + sl, num_pairs, mask=sl < max_blocks * BLOCK_M)
    tl.debug_barrier()
    tl.store(sorted_ptr + start + rank, i, mask=valid)
    # blocks: block b belongs to the expert whose segment [start, start + padded) holds slot b * BLOCK_M
    b = tl.arange(0, P_POW2)
    pos = b * BLOCK_M
    used = pos < total
    owner = first[None, :] & (start[None, :] <= pos[:, None]) & (pos[:, None] < (start + padded)[None, :])
    expert = tl.where(used, tl.sum(tl.where(owner, e[None, :], 0), axis=1), -1)
    bcode = tl.where(used, tl.sum(tl.where(owner, code[None, :], 0), axis=1), -1)
    store_block_tables(block_experts_ptr, block_codes_ptr, block_order_ptr, b, used, expert, bcode, max_blocks,
                       num_rows)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
PATHS = ("tiny", "sort", "wide")
TINY_FORCED_MAX_PAIRS = 256  # the [P, P] compares of the tiny path, forced (bench, tests), up to here


def default_path(num_pairs: int) -> str:
    """The align path a step of `num_pairs` routed pairs takes."""
    if num_pairs <= TINY_MAX_PAIRS:
        return "tiny"
    return "sort" if num_pairs <= SORT_MAX_PAIRS else "wide"


def _check_path(path: str | None, num_pairs: int) -> None:
    if path is None:
        return
    limit = {"tiny": TINY_FORCED_MAX_PAIRS, "sort": SORT_COMPILED_MAX_PAIRS}.get(path)
    if path not in PATHS or (limit is not None and num_pairs > limit):
        raise ValueError(f"align path {path!r} for {num_pairs} pairs: expected one of {PATHS} ({limit=})")


def _check_align_inputs(topk_ids: torch.Tensor, l2p: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected [T, K]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids has dtype {topk_ids.dtype}, expected int32 or int64")
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids with strides {topk_ids.stride()} is not contiguous")
    if l2p.dim() != 1 or l2p.dtype != torch.int32 or l2p.shape[0] < num_experts:
        raise ValueError(
            f"l2p has shape {tuple(l2p.shape)} dtype {l2p.dtype}, expected [>= {num_experts}] int32"
        )
    if l2p.device != topk_ids.device:
        raise ValueError(f"l2p on {l2p.device}, topk_ids on {topk_ids.device}: expected one device")
    if num_experts <= 0:
        raise ValueError(f"num_experts={num_experts} must be positive")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m}: expected a power of two >= 16 (tl.dot needs M >= 16)")


def align_blocks(
    topk_ids: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    num_rows: int,
    block_m: int,
    before_plan: bool = False,
    path: str | None = None,
) -> AlignOutput:
    """Align routed pairs into M-blocks per expert and locate each block (see the module docstring).
    `before_plan`: launched before the step's plan changes `l2p` (the output says so: `AlignOutput.before_plan`).

    Args:
      topk_ids: `[T, K]` int32/int64 logical expert ids, -1 padding (contiguous, on the device).
      l2p: `[E_max]` int32 location codes of this layer (E_max >= num_experts).
      num_experts: E of this layer. num_rows: R (codes >= R are host rows).
      block_m: rows per M-block (power of two >= 16).
      path: one of `PATHS` (`default_path(T * K)` if None): every path gives the same outputs; benches and
        tests force one ("tiny" up to `TINY_FORCED_MAX_PAIRS` pairs, "sort" up to `SORT_COMPILED_MAX_PAIRS`).
    """
    _check_align_inputs(topk_ids, l2p, num_experts, block_m)
    _check_path(path, topk_ids.numel())
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_blocks = max_blocks_for(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_codes = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_order = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    out = AlignOutput(sorted_pairs, block_experts, block_codes, block_order, num_post, block_m, before_plan)
    common = (num_experts, num_rows, max_blocks)
    path = path or default_path(num_pairs)
    if path == "tiny":
        p_pow2 = max(16, triton.next_power_of_2(num_pairs))
        _align_tiny_kernel[(1,)](
            ids, l2p, sorted_pairs, block_experts, block_codes, block_order, num_post,
            num_pairs, *common,
            BLOCK_M=block_m, P_POW2=p_pow2, S_CHUNK=1024, num_warps=4 if p_pow2 <= 64 else 8,
        )  # fmt: skip
    elif path == "sort":
        _align_sort_kernel[(1,)](
            ids, l2p, sorted_pairs, block_experts, block_codes, block_order, num_post,
            num_pairs, *common, BLOCK_M=block_m, **sort_launch_args(num_pairs, num_experts, max_blocks),
        )  # fmt: skip
    else:
        from .align_wide import align_wide  # imported here: it imports AlignOutput from this module

        align_wide(ids, l2p, num_experts, num_rows, out)
    return out


# the reference lives in align_ref.py (imported last: it uses this module's checks); re-exported for the callers
from .align_ref import align_blocks_ref as align_blocks_ref  # noqa: E402
