"""The adaptive policies' decision of one decode step of one layer as a Triton device function, run by one
program: the body of `plan_adaptive` (its own single-program launch) and of role 0 of `plan_adaptive_copy`
(plan + admission copy in one launch). The rule, shapes and ordering are `plan_adaptive.py`'s docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _duel(
    misses_ptr, first_only, second_only, duel_shift, margin_shift, floor, score, FIRST_LAYER: tl.constexpr
):
    """Set dueling: `misses [2]` (decayed by `>> duel_shift` at layer 0) += (first-only, second-only misses) x
    score; returns 1 (int64) when the second wins clearly (`second + (second >> margin_shift) + floor < first`).
    The adaptive policy's mode (LRU, frequency) and the duel's order (slow, fast)."""
    m_offs = tl.arange(0, 2)
    misses = tl.load(misses_ptr + m_offs)
    if FIRST_LAYER:
        misses = misses - (misses >> duel_shift)
    misses += tl.where(m_offs == 0, first_only, second_only) * score
    tl.store(misses_ptr + m_offs, misses)
    first = tl.sum(tl.where(m_offs == 0, misses, 0), 0)
    second = tl.sum(tl.where(m_offs == 1, misses, 0), 0)
    return (second + (second >> margin_shift) + floor < first).to(tl.int64)


@triton.jit
def _plan_adaptive_body(
    ids_ptr, num_routed, l2p_ptr, owner_ptr, stamp_ptr, clock_ptr, counters_ptr, counts_ptr,
    victims_ptr, codes_ptr, valid_ptr, tel_counts_ptr, tel_routed_ptr, tel_flags_ptr, tel_max,
    count_ptr, last_ptr, misses_ptr, mode_ptr, member_ptr, ranked_ptr, scratch_ptr,
    order_misses_ptr, order_state_ptr,
    base, E, EM, R, N, L, num_pairs, block_m, min_reads, never,
    decay_shift, duel_shift, margin_shift, floor, bonus, score, one, member_decay_shift,
    fast_decay_shift, order_floor,
    BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr, ROUTER: tl.constexpr, DUEL: tl.constexpr,
    FIRST_LAYER: tl.constexpr, COUNT_IN_REGISTERS: tl.constexpr, TELEMETRY: tl.constexpr,
    DEFER_COMMIT: tl.constexpr,
):  # fmt: skip
    """The whole plan, by one program (see `plan_adaptive.py`'s docstring); returns n = 1 + the index of the
    last admitted pair, 0 if none (the pairs to copy: entries 0..n-1 of victims/codes/valid; a rejected pair
    has `valid = 0`; by the rule the admitted pairs are a prefix of the pairs found, so n is the admissions).
    DEFER_COMMIT: an admitted expert's location code (its new row) is left for the caller to write once the
    row holds its weights (`plan_sync._commit_admitted`), as in `plan_body._plan_lru_body`."""
    INT64_MAX: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    e_offs = tl.arange(0, BLOCK_E)
    e_in = e_offs < E
    p_in = e_offs < num_pairs
    now = tl.load(clock_ptr) + 1
    code = tl.load(l2p_ptr + base + e_offs, mask=e_in, other=0).to(tl.int64)
    tl.store(valid_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=p_in)
    tl.store(victims_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=p_in)
    tl.store(codes_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32) + R, mask=p_in)
    # 1. tokens per expert (as plan_body)
    if COUNT_IN_REGISTERS:
        t_offs = tl.arange(0, BLOCK_TK)
        ids = tl.load(ids_ptr + t_offs, mask=t_offs < num_routed, other=-1).to(tl.int64)
        routed = (ids >= 0) & (ids < E)
        tokens = tl.sum(((ids[:, None] == e_offs[None, :]) & routed[:, None]).to(tl.int32), 0)
        num_bad = tl.sum(((ids < -1) | (ids >= E)).to(tl.int32), 0)
    else:
        num_bad = 0
        tl.store(counts_ptr + e_offs, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_in)
        tl.debug_barrier()
        for start in range(0, num_routed, BLOCK_TK):
            t_offs = start + tl.arange(0, BLOCK_TK)
            ids = tl.load(ids_ptr + t_offs, mask=t_offs < num_routed, other=-1).to(tl.int64)
            routed = (ids >= 0) & (ids < E)
            ones = tl.full([BLOCK_TK], 1, tl.int32)
            tl.atomic_add(counts_ptr + tl.where(routed, ids, 0), ones, mask=routed)
            num_bad += tl.sum(((ids < -1) | (ids >= E)).to(tl.int32), 0)
        tl.debug_barrier()
        tokens = tl.load(counts_ptr + e_offs, mask=e_in, other=0, volatile=True)
    present = tokens > 0
    if TELEMETRY:  # saturating counts, bitmap, sticky poison / overflow bits (as plan_body)
        tel_new = tl.load(tel_counts_ptr + base + e_offs, mask=e_in, other=0) + tokens
        tel_over = present & (tel_new >= tel_max)
        tl.store(tel_counts_ptr + base + e_offs, tl.minimum(tel_new, tel_max), mask=present)
        tl.store(tel_routed_ptr + base + e_offs, tl.full([BLOCK_E], 1, tl.int8), mask=present)
        tl.store(tel_flags_ptr + 0, 1, mask=num_bad > 0)
        tl.store(tel_flags_ptr + 1, 1, mask=tl.sum(tel_over.to(tl.int32), 0) > 0)
    tl.store(clock_ptr, now)
    # 2. shadow caches as of the previous tick, for the present experts (compacted into the scratch)
    pos = tl.cumsum(present.to(tl.int32), 0) - 1
    num_present = tl.sum(present.to(tl.int32), 0)
    tl.store(scratch_ptr + pos, e_offs.to(tl.int64), mask=present)
    tl.debug_barrier()
    lru_only = tl.zeros([], dtype=tl.int64)
    freq_only = tl.zeros([], dtype=tl.int64)
    value_ptr = ranked_ptr if ROUTER else count_ptr  # with DUEL: the slow order's ranked counts
    # the duel's fast order (its membership and ranked counts follow the slow ones'); read only with DUEL
    fast_member_ptr = member_ptr + N
    fast_ranked_ptr = ranked_ptr + N + 1
    slow_only = tl.zeros([], dtype=tl.int64)  # the duel's misses of one order's frequency shadow only
    fast_only = tl.zeros([], dtype=tl.int64)
    prev_fast = tl.zeros([], dtype=tl.int64)
    if DUEL:
        prev_fast = tl.load(order_state_ptr)  # the order the adaptive duel reads: the last tick's choice
    p_start = 0
    while p_start < num_present:
        q_offs = p_start + tl.arange(0, BLOCK_P)
        q_in = q_offs < num_present
        flat = base + tl.load(scratch_ptr + q_offs, mask=q_in, other=0, volatile=True)
        mine_last = tl.load(last_ptr + flat, mask=q_in, other=never)
        mine = tl.load(value_ptr + flat, mask=q_in, other=0)
        mine_bonus = bonus * ((now - 1 - mine_last) < L).to(tl.int64)
        mine += mine_bonus
        mine_fast = mine
        if DUEL:
            mine_fast = tl.load(fast_ranked_ptr + flat, mask=q_in, other=0) + mine_bonus
        newer = tl.zeros([BLOCK_P], dtype=tl.int32)
        above = tl.zeros([BLOCK_P], dtype=tl.int32)
        above_fast = tl.zeros([BLOCK_P], dtype=tl.int32)
        for n_start in range(0, N, BLOCK_N):
            n_offs = n_start + tl.arange(0, BLOCK_N)
            n_in = n_offs < N
            last_n = tl.load(last_ptr + n_offs, mask=n_in, other=never)
            bonus_n = bonus * ((now - 1 - last_n) < L).to(tl.int64)
            value_n = tl.load(value_ptr + n_offs, mask=n_in, other=0) + bonus_n
            later = (last_n[None, :] > mine_last[:, None]) & n_in[None, :]
            higher = (value_n[None, :] > mine[:, None]) | ((value_n[None, :] == mine[:, None]) & later)
            newer += tl.sum(later.to(tl.int32), 1)
            above += tl.sum((higher & n_in[None, :]).to(tl.int32), 1)
            if DUEL:
                fast_n = tl.load(fast_ranked_ptr + n_offs, mask=n_in, other=0) + bonus_n
                higher = (fast_n[None, :] > mine_fast[:, None]) | (
                    (fast_n[None, :] == mine_fast[:, None]) & later
                )
                above_fast += tl.sum((higher & n_in[None, :]).to(tl.int32), 1)
        seen = mine_last != never
        lru_out = ~(seen & (newer < R))
        freq_out = ~(seen & (above < R))
        if DUEL:  # the two orders' shadows; the adaptive duel scores the last tick's choice
            fast_out = ~(seen & (above_fast < R))
            slow_only += tl.sum((q_in & freq_out & ~fast_out).to(tl.int64), 0)
            fast_only += tl.sum((q_in & fast_out & ~freq_out).to(tl.int64), 0)
            freq_out = tl.where(prev_fast != 0, fast_out, freq_out)
        lru_only += tl.sum((q_in & lru_out & ~freq_out).to(tl.int64), 0)
        freq_only += tl.sum((q_in & freq_out & ~lru_out).to(tl.int64), 0)
        p_start += BLOCK_P
    tl.debug_barrier()  # every thread has read the counts before any decays them (write after read)
    # 3. decays (once per step), shadow misses, mode, chain starts, last use
    if FIRST_LAYER:
        for n_start in range(0, N, BLOCK_N):
            n_offs = n_start + tl.arange(0, BLOCK_N)
            n_in = n_offs < N
            c = tl.load(count_ptr + n_offs, mask=n_in, other=0)
            tl.store(count_ptr + n_offs, c - (c >> decay_shift), mask=n_in)
            if ROUTER:
                m = tl.load(member_ptr + n_offs, mask=n_in, other=0)
                tl.store(member_ptr + n_offs, m - (m >> member_decay_shift), mask=n_in)
                k = tl.load(ranked_ptr + n_offs, mask=n_in, other=0)
                tl.store(ranked_ptr + n_offs, k - (k >> decay_shift), mask=n_in)
            if DUEL:
                m = tl.load(fast_member_ptr + n_offs, mask=n_in, other=0)
                tl.store(fast_member_ptr + n_offs, m - (m >> fast_decay_shift), mask=n_in)
                k = tl.load(fast_ranked_ptr + n_offs, mask=n_in, other=0)
                tl.store(fast_ranked_ptr + n_offs, k - (k >> decay_shift), mask=n_in)
    mode = _duel(misses_ptr, lru_only, freq_only, duel_shift, margin_shift, floor, score, FIRST_LAYER)
    tl.store(mode_ptr, mode)
    if DUEL:  # the order duel, as the mode's: slow-only, fast-only misses, the fast order on a clear win
        fast = _duel(order_misses_ptr, slow_only, fast_only, duel_shift, margin_shift, order_floor, score,
                     FIRST_LAYER)  # fmt: skip
        s_offs = tl.arange(0, 4)
        s_in = s_offs < 3
        order_state = tl.load(order_state_ptr + s_offs, mask=s_in, other=0)
        order_state = tl.where(s_offs == 0, fast, order_state + tl.where(s_offs == 1, fast, 1))
        tl.store(order_state_ptr + s_offs, order_state, mask=s_in)
        value_ptr = ranked_ptr + fast * (N + 1)  # the decisions below read the chosen order
    tl.debug_barrier()  # the decayed counts were written by other threads
    last = tl.load(last_ptr + base + e_offs, mask=e_in, other=never)
    layer_count = tl.load(count_ptr + base + e_offs, mask=e_in, other=0, volatile=True)
    chain_start = present & (last != now - L)
    tl.store(count_ptr + base + e_offs, layer_count + chain_start.to(tl.int64) * one, mask=e_in)
    tl.store(last_ptr + base + e_offs, tl.zeros([BLOCK_E], dtype=tl.int64) + now, mask=present)
    tl.debug_barrier()
    # 4. the router's ranked counts of this layer (its whole E_max slice)
    if ROUTER:
        em_in = e_offs < EM
        c_e = tl.load(count_ptr + base + e_offs, mask=em_in, other=0, volatile=True)
        m_e = tl.load(member_ptr + base + e_offs, mask=em_in, other=0, volatile=True)
        mf_e = m_e
        if DUEL:
            mf_e = tl.load(fast_member_ptr + base + e_offs, mask=em_in, other=0, volatile=True)
        order_rank = tl.zeros([BLOCK_E], dtype=tl.int32)
        count_rank = tl.zeros([BLOCK_E], dtype=tl.int32)
        fast_rank = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j_start in range(0, EM, BLOCK_J):
            j_offs = j_start + tl.arange(0, BLOCK_J)
            j_in = j_offs < EM
            c_j = tl.load(count_ptr + base + j_offs, mask=j_in, other=0, volatile=True)
            m_j = tl.load(member_ptr + base + j_offs, mask=j_in, other=0, volatile=True)
            by_count = (c_j[None, :] > c_e[:, None]) | (
                (c_j[None, :] == c_e[:, None]) & (j_offs[None, :] < e_offs[:, None])
            )
            by_order = (m_j[None, :] > m_e[:, None]) | ((m_j[None, :] == m_e[:, None]) & by_count)
            count_rank += tl.sum((by_count & j_in[None, :]).to(tl.int32), 1)
            order_rank += tl.sum((by_order & j_in[None, :]).to(tl.int32), 1)
            if DUEL:
                mf_j = tl.load(fast_member_ptr + base + j_offs, mask=j_in, other=0, volatile=True)
                by_fast = (mf_j[None, :] > mf_e[:, None]) | ((mf_j[None, :] == mf_e[:, None]) & by_count)
                fast_rank += tl.sum((by_fast & j_in[None, :]).to(tl.int32), 1)
        tl.store(scratch_ptr + count_rank, c_e, mask=em_in)  # the curve: counts, largest first
        tl.debug_barrier()
        curve = tl.load(scratch_ptr + order_rank, mask=em_in, other=0, volatile=True)
        tl.store(ranked_ptr + base + e_offs, curve, mask=em_in)
        if DUEL:
            curve = tl.load(scratch_ptr + fast_rank, mask=em_in, other=0, volatile=True)
            tl.store(fast_ranked_ptr + base + e_offs, curve, mask=em_in)
        tl.debug_barrier()
    # 5. hits first (their rows are busy this step); candidates and victims in key order
    hit = present & (code < R)
    miss = present & (code >= R)
    tl.store(stamp_ptr + tl.where(hit, code, 0), tl.zeros([BLOCK_E], dtype=tl.int64) + now, mask=hit)
    cand = miss & ((tokens + block_m - 1) // block_m >= min_reads)
    num_iter = tl.minimum(tl.sum(cand.to(tl.int32), 0), num_pairs)
    value_e = tl.load(value_ptr + base + e_offs, mask=e_in, other=0, volatile=True)
    ckey = -value_e * mode
    tl.debug_barrier()
    num_admitted = 0
    num_evicted = 0
    num_published = 0
    prev_ckey = tl.full([], -INT64_MAX, tl.int64)
    prev_expert = tl.full([], -1, tl.int64)
    prev_vkey = tl.full([], -2, tl.int64)  # free rows' key is -1, an owned row's value x mode >= 0
    prev_rkey = tl.full([], -1, tl.int64)
    i = 0
    while i < num_iter:
        after = (ckey > prev_ckey) | ((ckey == prev_ckey) & (e_offs > prev_expert))
        ok_c = cand & after
        best_ckey = tl.min(tl.where(ok_c, ckey, INT64_MAX), 0)
        expert = tl.min(tl.where(ok_c & (ckey == best_ckey), e_offs, BLOCK_E), 0).to(tl.int64)
        best_vkey = tl.full([], INT64_MAX, tl.int64)
        best_rkey = tl.full([], INT64_MAX, tl.int64)
        for r_start in range(0, R, BLOCK_R):
            rows = r_start + tl.arange(0, BLOCK_R)
            r_in = rows < R
            stamp = tl.load(stamp_ptr + rows, mask=r_in, other=0, volatile=True)
            owner = tl.load(owner_ptr + rows, mask=r_in, other=-1, volatile=True)
            owned = owner >= 0
            # volatile (no L1): step 3 and 4 wrote these values from other threads in this launch
            value_r = tl.load(
                value_ptr + tl.where(owned, owner, 0), mask=r_in & owned, other=0, volatile=True
            )
            vkey = tl.where(owned, (value_r + bonus * ((now - stamp) < L).to(tl.int64)) * mode, -1)
            rkey = (stamp + 1) * R + rows
            ok_r = r_in & (stamp != now)
            ok_r = ok_r & ((vkey > prev_vkey) | ((vkey == prev_vkey) & (rkey > prev_rkey)))
            block_vkey = tl.min(tl.where(ok_r, vkey, INT64_MAX), 0)
            block_rkey = tl.min(tl.where(ok_r & (vkey == block_vkey), rkey, INT64_MAX), 0)
            take = (block_vkey < best_vkey) | ((block_vkey == best_vkey) & (block_rkey < best_rkey))
            best_vkey = tl.where(take, block_vkey, best_vkey)
            best_rkey = tl.where(take, block_rkey, best_rkey)
        found = best_rkey != INT64_MAX
        row = tl.where(found, best_rkey % R, 0)
        old = tl.load(owner_ptr + row, mask=found, other=-1, volatile=True)
        cand_value = tl.load(value_ptr + base + expert, mask=found, other=0, volatile=True)
        admit = found & ((old < 0) | (mode == 0) | (cand_value + bonus >= best_vkey))
        tl.store(l2p_ptr + tl.where(old >= 0, old, 0), (R + old % EM).to(tl.int32), mask=admit & (old >= 0))
        if not DEFER_COMMIT:
            tl.store(l2p_ptr + base + expert, row.to(tl.int32), mask=admit)
        tl.store(owner_ptr + row, base + expert, mask=admit)
        tl.store(stamp_ptr + row, now, mask=admit)
        tl.store(victims_ptr + i, row.to(tl.int32), mask=found)
        tl.store(codes_ptr + i, (R + expert).to(tl.int32), mask=found)
        tl.store(valid_ptr + i, admit.to(tl.int32))
        num_admitted += admit.to(tl.int32)
        num_published = tl.where(admit, i + 1, num_published)
        num_evicted += (admit & (old >= 0)).to(tl.int32)
        prev_ckey, prev_expert = best_ckey, expert
        prev_vkey, prev_rkey = best_vkey, best_rkey
        i = tl.where(found, i + 1, num_iter)  # no row left: the rest read the host view
    # 6. counters
    c_offs = tl.arange(0, 8)
    old_counters = tl.load(counters_ptr + c_offs, mask=c_offs < 5, other=0)
    num_hits = tl.sum(hit.to(tl.int64), 0)
    num_misses = tl.sum(miss.to(tl.int64), 0)
    added = tl.where(c_offs == 0, num_hits, 0) + tl.where(c_offs == 1, num_misses, 0)
    added += tl.where(c_offs == 2, num_admitted, 0) + tl.where(c_offs == 3, num_misses - num_admitted, 0)
    added += tl.where(c_offs == 4, num_evicted, 0)
    tl.store(counters_ptr + c_offs, old_counters + added, mask=c_offs < 5)
    return num_published
