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

Three device paths with identical results: for decode steps (N <= TINY_MAX_PAIRS) one program computing
everything in registers from one load of the ids and one gather of their codes; one program stepping through
the pairs with per-expert counts in registers (N <= SMALL_MAX_PAIRS, one launch); and three launches (count per
chunk, scan, scatter) for wide steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 128  # pairs per rank computation ([CHUNK, CHUNK] compare)
BLOCK_CHUNK = 64  # blocks per step of the block-table pass
SMALL_MAX_PAIRS = 1024  # up to this many pairs, the one-program path
TINY_MAX_PAIRS = 64  # up to this many pairs, the register-only one-program path (`_align_tiny_kernel`)


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


# ------------------------------------------------------------------------------------------------------------
# jit helpers
@triton.jit
def _block_tables(
    ends_ptr,  # [E_POW2] int32: padded end slot of each expert (cumulative)
    l2p_ptr,
    block_experts_ptr,
    block_codes_ptr,
    block_order_ptr,
    num_experts,
    num_rows,
    max_blocks,
    total,  # used slots
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    e_offs = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + e_offs)
    num_host = 0
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        pos = b * BLOCK_M
        used = (pos < total) & (b < max_blocks)
        before = (ends[None, :] <= pos[:, None]) & (e_offs[None, :] < num_experts)
        expert = tl.sum(before.to(tl.int32), axis=1)
        expert = tl.where(used, expert, -1)
        code = tl.load(l2p_ptr + expert, mask=used, other=-1)
        tl.store(block_experts_ptr + b, expert, mask=b < max_blocks)
        tl.store(block_codes_ptr + b, code, mask=b < max_blocks)
        num_host += tl.sum((used & (code >= num_rows)).to(tl.int32), axis=0)
    tl.debug_barrier()  # the codes written above are read back by other threads below
    # host-row blocks first, then the rest; each group keeps block order
    host_seen = 0
    other_seen = 0
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        used = (b * BLOCK_M < total) & (b < max_blocks)
        code = tl.load(block_codes_ptr + b, mask=used, other=-1)
        is_host = used & (code >= num_rows)
        is_other = used & (code < num_rows)
        host_pos = host_seen + tl.cumsum(is_host.to(tl.int32), axis=0) - 1
        other_pos = num_host + other_seen + tl.cumsum(is_other.to(tl.int32), axis=0) - 1
        tl.store(block_order_ptr + host_pos, b, mask=is_host)
        tl.store(block_order_ptr + other_pos, b, mask=is_other)
        host_seen += tl.sum(is_host.to(tl.int32), axis=0)
        other_seen += tl.sum(is_other.to(tl.int32), axis=0)
    # blocks past the used ones: -1
    num_used = host_seen + other_seen
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        tl.store(block_order_ptr + b, -1, mask=(b >= num_used) & (b < max_blocks))


@triton.jit
def _chunk_ids(ids_ptr, start, num_pairs, num_experts, CHUNK: tl.constexpr):
    offs = start + tl.arange(0, CHUNK)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    return offs, ids, valid


@triton.jit
def _rank_in_chunk(ids, valid, CHUNK: tl.constexpr):
    """For each pair: how many earlier valid pairs of the chunk have the same expert."""
    i = tl.arange(0, CHUNK)
    same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _align_small_kernel(
    ids_ptr,
    l2p_ptr,
    ends_ptr,  # [E_POW2] int32 scratch: each expert's padded end slot (cumulative), for _block_tables
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
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """Counts and each expert's next free slot live in registers ([CHUNK, E_POW2] one-hot sums per chunk of
    pairs): no global atomics and no explicit barrier per chunk. (The first form kept them in global memory, an atomic
    add and two barriers per chunk: Qwen3-like 128 / 512 / 1024 pairs took 11.7 / 28.1 / 46.8 µs on an H100,
    2026-12-06, against 19.0 for 4096 pairs on the three-launch path.) `CHUNK` shrinks as E grows
    (`small_chunk`) so that the [CHUNK, CHUNK] and [CHUNK, E_POW2] compares fit the registers."""
    e_offs = tl.arange(0, E_POW2)
    for s0 in range(0, max_blocks * BLOCK_M, S_CHUNK):
        s = s0 + tl.arange(0, S_CHUNK)
        tl.store(sorted_ptr + s, num_pairs, mask=s < max_blocks * BLOCK_M)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        _offs, ids, valid = _chunk_ids(ids_ptr, start, num_pairs, num_experts, CHUNK)
        counts += tl.sum(((ids[:, None] == e_offs[None, :]) & valid[:, None]).to(tl.int32), axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(ends_ptr + e_offs, ends)
    tl.store(num_post_ptr, total)
    cursor = ends - padded  # each expert's next free slot
    tl.debug_barrier()  # the padding fill above before the scatter below; `ends` before _block_tables reads it
    for start in range(0, num_pairs, CHUNK):
        offs, ids, valid = _chunk_ids(ids_ptr, start, num_pairs, num_experts, CHUNK)
        # [CHUNK, E_POW2] (`valid` for clarity: an invalid pair's slot is never stored, nor its column read)
        onehot = (ids[:, None] == e_offs[None, :]) & valid[:, None]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        rank = _rank_in_chunk(ids, valid, CHUNK)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        cursor += tl.sum(onehot.to(tl.int32), axis=0)
    _block_tables(
        ends_ptr,
        l2p_ptr,
        block_experts_ptr,
        block_codes_ptr,
        block_order_ptr,
        num_experts,
        num_rows,
        max_blocks,
        total,
        BLOCK_M,
        E_POW2,
        BLOCK_CHUNK,
    )


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
    """`_align_small_kernel` for N <= P_POW2 pairs with no global round trip between phases: counts, ranks,
    segment starts and the block table come from [P, P] compares of the ids in registers; the only dependent
    loads are ids -> l2p codes (per pair, then selected per block), and one barrier orders the padding fill
    of `sorted_pairs` before the scatter of the pairs into it."""
    i = tl.arange(0, P_POW2)
    e = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
    valid = (i < num_pairs) & (e >= 0) & (e < num_experts)
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
    in_table = b < max_blocks
    tl.store(block_experts_ptr + b, expert, mask=in_table)
    tl.store(block_codes_ptr + b, bcode, mask=in_table)
    # order: host-row blocks first, then the others, each in block order; -1 past the used blocks
    is_host = used & (bcode >= num_rows)
    is_other = used & (bcode < num_rows)
    num_host = tl.sum(is_host.to(tl.int32), axis=0)
    host_pos = tl.cumsum(is_host.to(tl.int32), axis=0) - 1
    other_pos = num_host + tl.cumsum(is_other.to(tl.int32), axis=0) - 1
    order_pos = tl.where(is_host, host_pos, tl.where(is_other, other_pos, b))
    tl.store(block_order_ptr + order_pos, tl.where(used, b, -1), mask=in_table)


# ------------------------------------------------------------------------------------------------------------
def small_chunk(e_pow2: int) -> int:
    """Pairs per step of `_align_small_kernel` (8 warps): compiled for sm_90 with Triton 3.6 (2026-12-06), 128
    pairs per step spilled at 4 warps (255 registers and 104-152 bytes of stack at E 128 and 256) and at 8
    warps for E 256; 64 pairs at 8 warps use 128 / 174 registers at E 128 / 256, no stack."""
    return max(16, min(64, 16384 // e_pow2))


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
) -> AlignOutput:
    """Align routed pairs into M-blocks per expert and locate each block (see the module docstring).
    `before_plan`: launched before the step's plan changes `l2p` (the output says so: `AlignOutput.before_plan`).

    Args:
      topk_ids: `[T, K]` int32/int64 logical expert ids, -1 padding (contiguous, on the device).
      l2p: `[E_max]` int32 location codes of this layer (E_max >= num_experts).
      num_experts: E of this layer. num_rows: R (codes >= R are host rows).
      block_m: rows per M-block (power of two >= 16).
    """
    _check_align_inputs(topk_ids, l2p, num_experts, block_m)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_blocks = max_blocks_for(num_pairs, num_experts, block_m)
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_codes = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_order = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    out = AlignOutput(sorted_pairs, block_experts, block_codes, block_order, num_post, block_m, before_plan)
    common = (num_experts, num_rows, max_blocks)
    if num_pairs <= TINY_MAX_PAIRS:
        _align_tiny_kernel[(1,)](
            ids, l2p, sorted_pairs, block_experts, block_codes, block_order, num_post,
            num_pairs, *common,
            BLOCK_M=block_m, P_POW2=max(16, triton.next_power_of_2(num_pairs)), S_CHUNK=1024, num_warps=4,
        )  # fmt: skip
    elif num_pairs <= SMALL_MAX_PAIRS:
        ends = torch.empty(e_pow2, dtype=torch.int32, device=device)
        _align_small_kernel[(1,)](
            ids, l2p, ends, sorted_pairs, block_experts, block_codes, block_order, num_post,
            num_pairs, *common,
            BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=small_chunk(e_pow2), BLOCK_CHUNK=BLOCK_CHUNK, S_CHUNK=1024,
            num_warps=8,
        )  # fmt: skip
    else:
        from .align_wide import align_wide  # imported here: it uses this module's jit helpers

        align_wide(ids, l2p, num_experts, num_rows, out)
    return out


# the reference lives in align_ref.py (imported last: it uses this module's checks); re-exported for the callers
from .align_ref import align_blocks_ref as align_blocks_ref  # noqa: E402
