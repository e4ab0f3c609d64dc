"""Align's wide path (more than `align_sort.SORT_MAX_PAIRS` routed pairs): three launches, count per chunk, scan,
scatter; the same outputs as `align.align_blocks`' one-program paths (see `align.py` for their layout).

Nothing else is launched: each chunk's counts are its histogram, stored whole (no zeroed buffer to add into),
and the scatter's programs also write the padding slots of `sorted_pairs` (each expert's slots past its pairs,
then every slot past the used ones), which never overlap a pair's slot: no fill before the scatter. Until
2026-12-07 a memset of the counts and a fill of `sorted_pairs` ran before the three (18.9-21.4 µs for the five
at Qwen3-like 4096-8192 pairs, H100, `bench.align_time`; the three alone not yet timed)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .align import AlignOutput

CHUNK = 128  # pairs per rank computation ([CHUNK, CHUNK] compare)
BLOCK_CHUNK = 64  # blocks per step of the block-table pass


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
    raw = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (raw >= 0) & (raw < num_experts)  # on the loaded width (int64 ids not cut first)
    return offs, raw.to(tl.int32), valid


@triton.jit
def _rank_in_chunk(ids, valid, CHUNK: tl.constexpr):
    """For each pair: how many earlier valid pairs of the chunk have the same expert."""
    i = tl.arange(0, CHUNK)
    same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _align_count_kernel(
    ids_ptr, counts_ptr, num_pairs, num_experts, E_POW2: tl.constexpr, CHUNK: tl.constexpr
):
    """Row `pid` of counts `[num_chunks, E_POW2]`: the chunk's pairs per expert, every bin written."""
    pid = tl.program_id(0)
    _offs, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_pairs, num_experts, CHUNK)
    counts = tl.histogram(tl.where(valid, ids, 0), E_POW2, mask=valid)
    tl.store(counts_ptr + pid * E_POW2 + tl.arange(0, E_POW2), counts)


@triton.jit
def _align_scan_kernel(
    counts_ptr,  # [P, E_POW2] int32 in: per-chunk counts; out: per-chunk base slot
    ends_ptr,  # [2, E_POW2] int32 out: each expert's padded end slot, then its first padding slot
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
    tl.store(ends_ptr + E_POW2 + e_offs, ends - padded + totals)  # each expert's first padding slot
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
    ids_ptr, base_ptr, ends_ptr, sorted_ptr, num_post_ptr, num_pairs, num_experts, max_slots,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, E_CHUNK: tl.constexpr,
    S_CHUNK: tl.constexpr,
):  # fmt: skip
    """Each pair of chunk `pid` to its slot; and, shared out among the programs (at least one, for no pairs),
    `num_pairs` into every padding slot: each expert's `[first padding slot, end)` (fewer than BLOCK_M; none for
    a bin past the experts), then the slots past the used ones, `[num_post_padded, max_slots)`."""
    pid = tl.program_id(0)
    offs, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_pairs, num_experts, CHUNK)
    rank = _rank_in_chunk(ids, valid, CHUNK)
    base = tl.load(base_ptr + pid * E_POW2 + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)
    for e0 in range(pid * E_CHUNK, E_POW2, tl.num_programs(0) * E_CHUNK):
        e = e0 + tl.arange(0, E_CHUNK)
        end = tl.load(ends_ptr + e)
        slot = tl.load(ends_ptr + E_POW2 + e)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slot, num_pairs, mask=slot < end[:, None])
    total = tl.load(num_post_ptr)
    for s0 in range(pid * S_CHUNK, max_slots, tl.num_programs(0) * S_CHUNK):
        slot = s0 + tl.arange(0, S_CHUNK)
        tl.store(sorted_ptr + slot, num_pairs, mask=(slot >= total) & (slot < max_slots))


def align_wide(
    ids: torch.Tensor, l2p: torch.Tensor, num_experts: int, num_rows: int, out: AlignOutput
) -> None:
    """Fill `out` (allocated by `align.align_blocks` for `ids.numel()` pairs) for the flat ids `[N]`."""
    num_pairs = ids.numel()
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    counts = torch.empty((num_chunks, e_pow2), dtype=torch.int32, device=ids.device)  # every bin written
    ends = torch.empty((2, e_pow2), dtype=torch.int32, device=ids.device)
    _align_count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, E_POW2=e_pow2, CHUNK=CHUNK)
    p_block = max(1, min(64, 16384 // e_pow2))
    _align_scan_kernel[(1,)](
        counts, ends, l2p, out.block_experts, out.block_codes, out.block_order, out.num_post_padded,
        num_chunks, num_experts, num_rows, out.max_blocks,
        BLOCK_M=out.block_m, E_POW2=e_pow2, P_BLOCK=p_block, BLOCK_CHUNK=BLOCK_CHUNK, num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(max(1, num_chunks),)](
        ids, counts, ends, out.sorted_pairs, out.num_post_padded, num_pairs, num_experts,
        out.max_blocks * out.block_m,
        BLOCK_M=out.block_m, E_POW2=e_pow2, CHUNK=CHUNK, E_CHUNK=min(e_pow2, max(1, 2048 // out.block_m)),
        S_CHUNK=1024,
    )  # fmt: skip
