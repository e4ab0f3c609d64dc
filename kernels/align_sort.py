"""Align's sort path: one program, every phase in registers, for up to `SORT_MAX_PAIRS` routed pairs; the same
outputs as `align.align_blocks`' other paths (see `align.py` for their layout).

Every id is loaded once and nothing steps through the pairs:
  - counts per expert: `tl.histogram` of the ids;
  - the slot of each pair: the keys `expert * P + pair` sorted (`tl.sort`) list the pairs grouped by expert in
    ascending expert and pair order, the reference's order; the j-th sorted valid pair goes to slot
    `j + padded_start[e] - unpadded_start[e]` of its expert e (`tl.gather` of that per-expert offset);
  - the expert of each M-block: the number of experts whose padded segment ends at or before the block's first
    slot, an inclusive cumsum of the histogram of the segments' end blocks.
The only global round trips: the ids, the l2p codes of the blocks, and the stores (the padding fill ordered
before the scatter by one barrier).

Measured (H100, 2026-12-07, `bench.align_time`, graph replay, Qwen3-like top-8 routing): 3.7-3.8 / 4.3-4.6 /
5.8 / 6.8-7.2 / 9.6 µs at 64 / 128 / 256 / 512 / 1024 pairs, against 6.4 / 14.2-14.5 µs for the [N, N]-compare
program at 64 / 128 pairs (which is 0.3-0.9 µs faster up to 32 pairs: it keeps them), 12.9 / 21.0 / 33.8 / 59.2 µs
for the one-program path it replaced (steps of [64, E] one-hot sums; earlier, with global counters, 11.7 / 28.1
/ 46.8 µs at 128 / 512 / 1024) and 18.5-19.1 µs for the three launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Up to this many pairs the sort path (H100, 2026-12-07, `bench.align_time`, graph replay, against the three
# launches: Qwen3-like 2048 / 4096 / 8192 pairs 17.7 / 38.7 / 122.3 µs vs 18.8 / 18.9 / 21.4, DeepSeek-like 25.4
# / 53.7 / 137.6 vs 30.5 / 30.3 / 34.3: one program's sort grows as P log^2 P, the three launches barely). It
# compiles without spills to 8192 (sm_90, Triton 3.6: 39-128 registers, 1-32 KiB of shared memory; Triton 3.8
# spills 8 bytes at 8192 with 32 warps, none at 2048)
SORT_MAX_PAIRS = 2048
SORT_COMPILED_MAX_PAIRS = 8192  # forced (bench, tests) up to here


@triton.jit
def _first_half(x, N: tl.constexpr):
    """x[:N] of a [2N] tensor (Triton has no slicing: the rows of its [2, N] view, the first kept)."""
    rows = tl.reshape(x, (2, N))
    return tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, rows, 0), axis=0)


@triton.jit
def _align_sort_kernel(
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
    P_POW2: tl.constexpr,  # >= num_pairs
    E_POW2: tl.constexpr,  # >= num_experts
    B_POW2: tl.constexpr,  # >= max_blocks
    S_CHUNK: tl.constexpr,
):
    i = tl.arange(0, P_POW2)
    raw = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
    valid = (
        (i < num_pairs) & (raw >= 0) & (raw < num_experts)
    )  # on the loaded width (int64 ids not cut first)
    e = raw.to(tl.int32)
    counts = tl.histogram(tl.where(valid, e, 0), E_POW2, mask=valid)  # [E_POW2]
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    # the j-th pair in (expert, pair) order goes to slot j + (padded start - unpadded start) of its expert
    delta = (ends - padded) - (tl.cumsum(counts, axis=0) - counts)
    keys = tl.sort(tl.where(valid, e, E_POW2) * P_POW2 + i)  # invalid pairs sort last
    key_expert = keys // P_POW2
    key_valid = key_expert < E_POW2
    slot = i + tl.gather(delta, tl.minimum(key_expert, E_POW2 - 1), 0)
    for s0 in range(0, max_blocks * BLOCK_M, S_CHUNK):
        s = s0 + tl.arange(0, S_CHUNK)
        tl.store(sorted_ptr + s, num_pairs, mask=s < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding fill above before the scatter below (other threads' slots)
    tl.store(sorted_ptr + slot, keys % P_POW2, mask=key_valid)
    # blocks: expert of block b = experts whose padded end <= b * BLOCK_M (ends are multiples of BLOCK_M);
    # end blocks lie in [0, max_blocks], so 2 * B_POW2 bins hold them
    e_offs = tl.arange(0, E_POW2)
    end_blocks = tl.histogram(ends // BLOCK_M, 2 * B_POW2, mask=e_offs < num_experts)
    b = tl.arange(0, B_POW2)
    used = b * BLOCK_M < total
    expert = tl.where(used, _first_half(tl.cumsum(end_blocks, axis=0), B_POW2), -1)
    code = tl.load(l2p_ptr + expert, mask=used, other=-1)
    store_block_tables(block_experts_ptr, block_codes_ptr, block_order_ptr, b, used, expert, code, max_blocks,
                       num_rows)  # fmt: skip


@triton.jit
def store_block_tables(block_experts_ptr, block_codes_ptr, block_order_ptr, b, used, expert, code, max_blocks,
                       num_rows):  # fmt: skip
    """Every block's expert and code, and the block order (host-row blocks first, then the others, each in
    block order; -1 past the used blocks), from the whole table in registers (`b`: all block indices, a
    power of two >= max_blocks; the one-program paths)."""
    in_table = b < max_blocks
    tl.store(block_experts_ptr + b, expert, mask=in_table)
    tl.store(block_codes_ptr + b, code, mask=in_table)
    is_host = used & (code >= num_rows)
    is_other = used & (code < num_rows)
    num_host = tl.sum(is_host.to(tl.int32), axis=0)
    host_pos = tl.cumsum(is_host.to(tl.int32), axis=0) - 1
    other_pos = num_host + tl.cumsum(is_other.to(tl.int32), axis=0) - 1
    order_pos = tl.where(is_host, host_pos, tl.where(is_other, other_pos, b))
    tl.store(block_order_ptr + order_pos, tl.where(used, b, -1), mask=in_table)


def sort_launch_args(num_pairs: int, num_experts: int, max_blocks: int) -> dict[str, int]:
    """The sort kernel's constexprs and warps for a step (asserting its limits)."""
    assert 0 <= num_pairs <= SORT_COMPILED_MAX_PAIRS, (
        f"{num_pairs} pairs: the sort path takes 0..{SORT_COMPILED_MAX_PAIRS}"
    )
    assert 0 < max_blocks <= max(1, num_pairs), f"max_blocks={max_blocks} for {num_pairs} pairs"
    p_pow2 = max(16, triton.next_power_of_2(num_pairs))
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    assert e_pow2 * p_pow2 * 2 < 2**31, f"keys of {num_experts} experts x {num_pairs} pairs overflow int32"
    return {
        "P_POW2": p_pow2,
        "E_POW2": e_pow2,
        "B_POW2": max(16, triton.next_power_of_2(max_blocks)),
        "S_CHUNK": 1024,
        # 4 warps up to 128 keys, 8 up to 1024, 16 up to 2048 (measured), 32 above (forced only)
        "num_warps": 4 if p_pow2 <= 128 else 8 if p_pow2 <= 1024 else 16 if p_pow2 <= 2048 else 32,
    }
