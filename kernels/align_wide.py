"""Align's wide path (more than `align.SMALL_MAX_PAIRS` routed pairs): three launches, count per chunk, scan,
scatter; the same outputs as `align.align_blocks`' one-program paths (see `align.py` for their layout)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .align import BLOCK_CHUNK, CHUNK, AlignOutput, _block_tables, _chunk_ids, _rank_in_chunk


@triton.jit
def _align_count_kernel(
    ids_ptr, counts_ptr, num_pairs, num_experts, E_POW2: tl.constexpr, CHUNK: tl.constexpr
):
    pid = tl.program_id(0)
    _offs, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_pairs, num_experts, CHUNK)
    tl.atomic_add(counts_ptr + pid * E_POW2 + ids, 1, mask=valid)


@triton.jit
def _align_scan_kernel(
    counts_ptr,  # [P, E_POW2] int32 in: per-chunk counts; out: per-chunk base slot
    ends_ptr,
    l2p_ptr,
    block_experts_ptr,
    block_codes_ptr,
    block_order_ptr,
    num_post_ptr,
    num_chunks,
    num_experts,
    num_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    e_offs = tl.arange(0, E_POW2)
    totals = tl.zeros((E_POW2,), dtype=tl.int32)
    for p0 in range(0, num_chunks, P_BLOCK):
        p = p0 + tl.arange(0, P_BLOCK)
        c = tl.load(
            counts_ptr + p[:, None] * E_POW2 + e_offs[None, :], mask=(p < num_chunks)[:, None], other=0
        )
        totals += tl.sum(c, axis=0)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(ends_ptr + e_offs, ends)
    tl.store(num_post_ptr, total)
    carry = ends - padded
    for p0 in range(0, num_chunks, P_BLOCK):
        p = p0 + tl.arange(0, P_BLOCK)
        ptrs = counts_ptr + p[:, None] * E_POW2 + e_offs[None, :]
        mask = (p < num_chunks)[:, None]
        c = tl.load(ptrs, mask=mask, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(ptrs, carry[None, :] + incl - c, mask=mask)
        carry += tl.sum(c, axis=0)
    tl.debug_barrier()
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
def _align_scatter_kernel(
    ids_ptr, base_ptr, sorted_ptr, num_pairs, num_experts, E_POW2: tl.constexpr, CHUNK: tl.constexpr
):
    pid = tl.program_id(0)
    offs, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_pairs, num_experts, CHUNK)
    rank = _rank_in_chunk(ids, valid, CHUNK)
    base = tl.load(base_ptr + pid * E_POW2 + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)


def align_wide(
    ids: torch.Tensor, l2p: torch.Tensor, num_experts: int, num_rows: int, out: AlignOutput
) -> None:
    """Fill `out` (allocated by `align.align_blocks` for `ids.numel()` pairs) for the flat ids `[N]`."""
    num_pairs = ids.numel()
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    counts = torch.zeros((num_chunks, e_pow2), dtype=torch.int32, device=ids.device)
    ends = torch.empty(e_pow2, dtype=torch.int32, device=ids.device)
    out.sorted_pairs.fill_(num_pairs)
    _align_count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, E_POW2=e_pow2, CHUNK=CHUNK)
    p_block = max(1, min(64, 16384 // e_pow2))
    _align_scan_kernel[(1,)](
        counts, ends, l2p, out.block_experts, out.block_codes, out.block_order, out.num_post_padded,
        num_chunks, num_experts, num_rows, out.max_blocks,
        BLOCK_M=out.block_m, E_POW2=e_pow2, P_BLOCK=p_block, BLOCK_CHUNK=BLOCK_CHUNK, num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](
        ids, counts, out.sorted_pairs, num_pairs, num_experts, E_POW2=e_pow2, CHUNK=CHUNK
    )
