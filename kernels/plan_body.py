"""The LRU decision of one decode step of one layer as a Triton device function, run by one program: the body
of `plan_lru` (its own single-program launch) and of role 0 of `plan_lru_copy` (plan + admission copy in
one launch). The decision rule, shapes and ordering are `plan_lru.py`'s docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plan_lru_body(
    ids_ptr,
    num_routed,
    l2p_ptr,
    owner_ptr,
    stamp_ptr,
    clock_ptr,
    counters_ptr,
    counts_ptr,
    victims_ptr,
    codes_ptr,
    valid_ptr,
    cycle_ptr,
    tel_counts_ptr,
    tel_routed_ptr,
    tel_flags_ptr,
    tel_max,
    layer,
    base,
    E,
    EM,
    R,
    num_pairs,
    block_m,
    min_reads,
    BLOCK_TK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PROTECT: tl.constexpr,
    TELEMETRY: tl.constexpr,
    COUNT_IN_REGISTERS: tl.constexpr,
    DEFER_COMMIT: tl.constexpr,
):
    """The whole plan, by one program (see the module docstring); returns the number of admissions (the
    admitted pairs are entries 0..n-1 of victims/codes/valid: a prefix). DEFER_COMMIT: an admitted expert's
    location code (its new row) is left for the caller to write once the row holds its weights
    (`plan_copy._commit_admitted`); until then the table keeps its host code, so a kernel that reads the
    table while the copy runs reads the expert from the host view or waits, never a half-copied row."""
    INT64_MAX: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    e_offs = tl.arange(0, BLOCK_E)
    e_in = e_offs < E
    p_in = e_offs < num_pairs
    # The loads that depend on nothing are issued first, so their latencies overlap: an all-hit step costs
    # about one round trip to memory, not one per phase (each phase's words are read by this program alone).
    now = tl.load(clock_ptr) + 1
    code = tl.load(l2p_ptr + base + e_offs, mask=e_in, other=0).to(tl.int64)
    c_offs = tl.arange(0, 8)  # the 5 counters
    old_counters = tl.load(counters_ptr + c_offs, mask=c_offs < 5, other=0)
    if TELEMETRY:
        tel = tl.load(tel_counts_ptr + base + e_offs, mask=e_in, other=0)
    if PROTECT:
        last_layer = tl.load(cycle_ptr + 0)
        cur_start = tl.load(cycle_ptr + 1)
        prev_start = tl.load(cycle_ptr + 2)
    tl.store(valid_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=p_in)
    tl.store(victims_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=p_in)
    tl.store(codes_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32) + R, mask=p_in)
    # 1. tokens per expert
    if COUNT_IN_REGISTERS:  # all ids in one block: a [T*K, E] comparison, no atomics, no barrier
        t_offs = tl.arange(0, BLOCK_TK)
        ids = tl.load(ids_ptr + t_offs, mask=t_offs < num_routed, other=-1).to(tl.int64)
        routed = (ids >= 0) & (ids < E)
        same = (ids[:, None] == e_offs[None, :]) & routed[:, None]
        tokens = tl.sum(same.to(tl.int32), 0)
        num_bad = tl.sum(((ids < -1) | (ids >= E)).to(tl.int32), 0)
        tl.store(counts_ptr + e_offs, tokens, mask=e_in)
    else:  # integer atomics (the sum does not depend on their order)
        tl.store(counts_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_in)
        tl.debug_barrier()
        num_bad = 0
        for start in range(0, num_routed, BLOCK_TK):
            t_offs = start + tl.arange(0, BLOCK_TK)
            ids = tl.load(ids_ptr + t_offs, mask=t_offs < num_routed, other=-1).to(tl.int64)
            routed = (ids >= 0) & (ids < E)
            ones = tl.full([BLOCK_TK], 1, tl.int32)
            tl.atomic_add(counts_ptr + tl.where(routed, ids, 0), ones, mask=routed)
            num_bad += tl.sum(((ids < -1) | (ids >= E)).to(tl.int32), 0)
        tl.debug_barrier()
        # volatile (no L1): these words were written in this launch by other threads (atomics, stores)
        tokens = tl.load(counts_ptr + e_offs, mask=e_in, other=0, volatile=True)
    present = tokens > 0
    # saturating counts, bitmap, sticky poison / overflow bits (this program alone writes them)
    if TELEMETRY:
        tel_new = tel + tokens
        tel_over = present & (tel_new >= tel_max)
        tl.store(tel_counts_ptr + base + e_offs, tl.minimum(tel_new, tel_max), mask=present)
        tl.store(tel_routed_ptr + base + e_offs, tl.full([BLOCK_E], 1, tl.int8), mask=present)
        tl.store(tel_flags_ptr + 0, 1, mask=num_bad > 0)
        tl.store(tel_flags_ptr + 1, 1, mask=tl.sum(tel_over.to(tl.int32), 0) > 0)
    tl.store(clock_ptr, now)
    if PROTECT:  # a new cycle starts at a layer not above the previous one
        new_cycle = last_layer >= layer
        prev_start = tl.where(new_cycle, cur_start, prev_start)
        cur_start = tl.where(new_cycle, now, cur_start)
        tl.store(cycle_ptr + 0, last_layer * 0 + layer)
        tl.store(cycle_ptr + 1, cur_start)
        tl.store(cycle_ptr + 2, prev_start)
    else:
        prev_start = now  # unused without PROTECT
    hit = present & (code < R)
    miss = present & (code >= R)
    # 2. hits are stamped first: their rows are busy for the rest of the step
    tl.store(stamp_ptr + tl.where(hit, code, 0), tl.zeros([BLOCK_E], dtype=tl.int64) + now, mask=hit)
    reads = (tokens + block_m - 1) // block_m
    cand = miss & (reads >= min_reads)
    cand_rank = tl.cumsum(cand.to(tl.int32), 0) - 1  # [BLOCK_E] position in expert-id order
    num_cand = tl.sum(cand.to(tl.int32), 0)
    num_iter = tl.minimum(num_cand, num_pairs)
    tl.debug_barrier()
    # 3-5. candidate i <- i-th least recently used row not used by this step
    num_admitted = 0
    num_evicted = 0
    prev_key = tl.full([], -1, tl.int64)
    i = 0
    while i < num_iter:
        best = tl.full([], INT64_MAX, tl.int64)
        for r_start in range(0, R, BLOCK_R):
            rows = r_start + tl.arange(0, BLOCK_R)
            r_in = rows < R
            stamp = tl.load(stamp_ptr + rows, mask=r_in, other=0, volatile=True)
            key = (stamp + 1) * R + rows
            ok = r_in & (stamp != now) & (key > prev_key)
            if PROTECT:  # free, own layer's, or idle since before the previous cycle began
                owner = tl.load(owner_ptr + rows, mask=r_in, other=-1, volatile=True)
                own = (owner >= base) & (owner < base + EM)
                ok = ok & ((owner < 0) | own | (stamp < prev_start))
            best = tl.minimum(best, tl.min(tl.where(ok, key, INT64_MAX), 0))
        found = best != INT64_MAX
        row = best % R
        expert = tl.sum(tl.where(cand & (cand_rank == i), e_offs, 0), 0).to(tl.int64)
        old = tl.load(owner_ptr + row, mask=found, other=-1, volatile=True)
        tl.store(l2p_ptr + tl.where(old >= 0, old, 0), (R + old % EM).to(tl.int32), mask=found & (old >= 0))
        if not DEFER_COMMIT:
            tl.store(l2p_ptr + base + expert, row.to(tl.int32), mask=found)
        tl.store(owner_ptr + row, base + expert, mask=found)
        tl.store(stamp_ptr + row, now, mask=found)
        tl.store(victims_ptr + i, row.to(tl.int32), mask=found)
        tl.store(codes_ptr + i, (R + expert).to(tl.int32), mask=found)
        tl.store(valid_ptr + i, 1, mask=found)
        num_admitted += found.to(tl.int32)
        num_evicted += (found & (old >= 0)).to(tl.int32)
        prev_key = best
        i = tl.where(found, i + 1, num_iter)  # no free-able row left: the rest read the host view
    # 6. counters
    num_hits = tl.sum(hit.to(tl.int64), 0)
    num_misses = tl.sum(miss.to(tl.int64), 0)
    added = tl.where(c_offs == 0, num_hits, 0) + tl.where(c_offs == 1, num_misses, 0)
    added += tl.where(c_offs == 2, num_admitted, 0) + tl.where(c_offs == 3, num_misses - num_admitted, 0)
    added += tl.where(c_offs == 4, num_evicted, 0)
    tl.store(counters_ptr + c_offs, old_counters + added, mask=c_offs < 5)
    return num_admitted
