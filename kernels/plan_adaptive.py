"""Fused plan of one decode step of one layer for the adaptive policies (`adaptive`, `adaptive-router`): the
policy's update and the whole residency decision in one single-program launch.

The torch-ops planner (`pooled_runner/planner_ops.py`) runs these policies as ~100 small kernels per layer
(10-17x the MoE's own step time at M=1 on the H200, docs/BENCHMARKS.md); this program does the same, in order,
with the same integers (the rules are `policy_adaptive.py`'s and `policy_router.py`'s docstrings):
  1. per-expert token counts of the routed ids (ids outside [0, E) are not routed); `clock += 1`;
  2. the shadow caches, as of the previous tick, for each expert routed now: its rank by last use and by
     (value, last use) among all L * E_max experts (the present experts are compacted first, so a narrow step
     compares a few experts with every expert, not E with every expert);
  3. at layer 0, the decays (counts, shadow misses; with the router, members and ranked counts); the shadow
     misses where the two shadows disagree, the mode, the chain-start counts and the last-use ticks;
  4. with the router (ROUTER), the layer's ranked counts: its counts, largest first, handed out in the order
     (member desc, count desc, expert id), by pairwise ranks;
  5. hit rows get the new stamp; candidates = misses with `ceil(tokens / block_m) >= min_reads`, in the order
     (-value x mode, expert id); victims = rows not used by this step in the order (free first, value x mode,
     then `(stamp + 1) * R + row`, i.e. least recently used, then row index): pair i is the i-th of each, both
     searched in increasing key order; it is admitted when the victim is free, the mode is LRU, or the
     candidate's value plus the recent bonus reaches the victim's key;
  6. evictions and admissions in the tables, the admitted pairs for the row gather (`victims`, `codes` =
     R + expert, `valid`: not a prefix, a rejected pair leaves a hole), and the counters (hits, misses,
     admissions, host reads, evictions).
The router's membership units are added before the launch (`RouterAdaptivePolicy.observe_scores_fused`: one
launch of `kernels/membership.py`). In LRU mode the decisions equal `plan_lru`'s without cycle protection.

Shapes: as `plan_lru.py` (`ids [T*K]`, `l2p [L * E_max]` int32, `row_owner, row_stamp [>= R]` int64, `clock
[1]`, `counters [5]` int64, `counts [>= E_max]` int32 scratch, `victims, codes, valid [P]` int32), plus the
policy's state (`AdaptiveState`): `count [L * E_max + 1]`, `last_use [L * E_max]`, `misses [2]`, `mode [1]`,
with the router `member [L * E_max]` and `ranked [L * E_max + 1]`, and a scratch `[>= E_max]`, all int64.
The torch reference with the same signature is `plan_adaptive_ref.plan_adaptive_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .plan_lru import MAX_COUNT_MATRIX, Telemetry, check_plan_arguments

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

NEVER = -(1 << 40)  # `policy_base.NEVER`: the last use of an expert never routed
ROW_BLOCK = 256
SHADOW_BLOCK = 256  # experts of all layers compared per pass of the shadow ranks
PRESENT_BLOCK = 16  # present experts per pass (a narrow step: one pass)
RANK_BLOCK = 16  # experts compared per pass of the router's pairwise ranks


class AdaptiveState(NamedTuple):
    """The adaptive policy's device state (`AdaptivePolicy` / `RouterAdaptivePolicy` tensors) and a scratch."""

    count: torch.Tensor  # [N + 1] chain-start counts (fixed point), last slot a dummy
    last_use: torch.Tensor  # [N] tick of the last routing, NEVER before the first
    misses: torch.Tensor  # [2] decayed shadow misses: LRU-only, frequency-only (x SCORE)
    mode: torch.Tensor  # [1] 1 = frequency mode
    member: torch.Tensor | None  # [N] router membership units (the router policy only)
    ranked: torch.Tensor | None  # [N + 1] ranked counts (the router policy only)
    scratch: torch.Tensor  # [>= E_max] int64 workspace


class AdaptiveRule(NamedTuple):
    """The adaptive policy's constants (see `AdaptivePolicy`)."""

    num_layers: int
    decay_shift: int
    duel_shift: int
    margin_shift: int
    floor: int  # floor_misses x SCORE
    bonus: int  # recent_bonus x ONE
    score: int  # SCORE, one shadow miss
    one: int  # ONE, one chain start
    member_decay_shift: int  # the router's membership decay (`RouterAdaptivePolicy`; default: decay_shift)


def check_adaptive_state(state: AdaptiveState, rule: AdaptiveRule, max_experts: int) -> None:
    """ValueError naming the first bad constant, or state tensor of the wrong shape, dtype or device."""
    n = rule.num_layers * max_experts
    shifts = (rule.decay_shift, rule.duel_shift, rule.margin_shift, rule.member_decay_shift)
    if not all(1 <= s <= 30 for s in shifts):
        raise ValueError(f"shifts out of [1, 30]: {rule}")
    if min(rule.floor, rule.bonus) < 0 or min(rule.score, rule.one) < 1:
        raise ValueError(f"floor and bonus must be >= 0, score and one >= 1: {rule}")
    if (state.member is None) != (state.ranked is None):
        raise ValueError("member and ranked come together (the router policy) or not at all")
    want = {"count": n + 1, "last_use": n, "misses": 2, "mode": 1, "member": n, "ranked": n + 1}
    device = state.count.device
    for name, size in want.items():
        t = getattr(state, name)
        if t is None:
            continue
        if t.shape != (size,) or t.dtype != torch.int64 or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} dtype {t.dtype} on {t.device}; expected [{size}] int64 on "
                f"{device}, contiguous"
            )
    s = state.scratch
    if s.dim() != 1 or s.dtype != torch.int64 or s.shape[0] < max_experts or s.device != device:
        raise ValueError(
            f"scratch: shape {tuple(s.shape)} dtype {s.dtype}; expected [>= {max_experts}] int64"
        )


def plan_adaptive(
    ids: torch.Tensor,
    l2p: torch.Tensor,
    row_owner: torch.Tensor,
    row_stamp: torch.Tensor,
    clock: torch.Tensor,
    counters: torch.Tensor,
    counts: torch.Tensor,
    victims: torch.Tensor,
    codes: torch.Tensor,
    valid: torch.Tensor,
    layer: int,
    num_experts: int,
    max_experts: int,
    num_rows: int,
    block_m: int,
    min_reads: int,
    state: AdaptiveState,
    rule: AdaptiveRule,
    telemetry: Telemetry | None = None,
) -> None:
    """Plan one step of `layer` and update the policy's state in place (see module docstring). One launch,
    graph-safe (no host sync, no allocation). `P = victims.shape[0]` (the planner passes `min(E, R, T*K)`) and
    T*K may be 0 (then the clock moves and the policy sees an empty step). `telemetry = (counts, routed, flags,
    max_count)` also records the step's route telemetry (the `count_routes` contract, from the token counts the
    kernel computes anyway). ValueError for bad shapes."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("plan_adaptive needs Triton")
    args = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    check_plan_arguments(
        *args, layer, num_experts, max_experts, num_rows, block_m, min_reads, None, telemetry
    )
    num_layers = rule.num_layers
    if l2p.shape[0] != num_layers * max_experts:
        raise ValueError(f"l2p holds {l2p.shape[0]} entries, expected L * E_max = {num_layers * max_experts}")
    check_adaptive_state(state, rule, max_experts)
    if state.count.device != ids.device:
        raise ValueError(f"the policy state is on {state.count.device}, the ids on {ids.device}")
    num_routed, num_pairs = ids.shape[0], victims.shape[0]
    if num_pairs > min(num_experts, num_rows):
        raise ValueError(f"num_pairs={num_pairs} > min(E={num_experts}, R={num_rows})")
    router = state.member is not None
    block_tk = min(1024, triton.next_power_of_2(max(num_routed, 1)))
    block_e = triton.next_power_of_2(max_experts)
    member = state.member if state.member is not None else state.count  # placeholders: unread without ROUTER
    ranked = state.ranked if state.ranked is not None else state.count
    tel = (
        (telemetry[0], telemetry[1].view(torch.int8), telemetry[2]) if telemetry is not None else (clock,) * 3
    )
    _plan_adaptive_kernel[(1,)](
        ids, num_routed, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid,
        *tel, telemetry[3] if telemetry is not None else 1,
        state.count, state.last_use, state.misses, state.mode, member, ranked, state.scratch,
        layer * max_experts, num_experts, max_experts, num_rows, num_layers * max_experts, num_layers,
        num_pairs, block_m, min_reads, NEVER,
        rule.decay_shift, rule.duel_shift, rule.margin_shift, rule.floor, rule.bonus, rule.score, rule.one,
        rule.member_decay_shift,
        BLOCK_TK=block_tk, BLOCK_E=block_e, BLOCK_R=ROW_BLOCK, BLOCK_N=SHADOW_BLOCK, BLOCK_P=PRESENT_BLOCK,
        BLOCK_J=RANK_BLOCK, ROUTER=router, FIRST_LAYER=layer == 0, TELEMETRY=telemetry is not None,
        COUNT_IN_REGISTERS=block_tk * block_e <= MAX_COUNT_MATRIX and num_routed <= 1024,
        num_warps=4,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _plan_adaptive_kernel(
        ids_ptr, num_routed, l2p_ptr, owner_ptr, stamp_ptr, clock_ptr, counters_ptr, counts_ptr,
        victims_ptr, codes_ptr, valid_ptr, tel_counts_ptr, tel_routed_ptr, tel_flags_ptr, tel_max,
        count_ptr, last_ptr, misses_ptr, mode_ptr, member_ptr, ranked_ptr, scratch_ptr,
        base, E, EM, R, N, L, num_pairs, block_m, min_reads, never,
        decay_shift, duel_shift, margin_shift, floor, bonus, score, one, member_decay_shift,
        BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr, ROUTER: tl.constexpr, FIRST_LAYER: tl.constexpr,
        COUNT_IN_REGISTERS: tl.constexpr, TELEMETRY: tl.constexpr,
    ):  # fmt: skip
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
        value_ptr = ranked_ptr if ROUTER else count_ptr
        p_start = 0
        while p_start < num_present:
            q_offs = p_start + tl.arange(0, BLOCK_P)
            q_in = q_offs < num_present
            flat = base + tl.load(scratch_ptr + q_offs, mask=q_in, other=0, volatile=True)
            mine_last = tl.load(last_ptr + flat, mask=q_in, other=never)
            mine = tl.load(value_ptr + flat, mask=q_in, other=0)
            mine += bonus * ((now - 1 - mine_last) < L).to(tl.int64)
            newer = tl.zeros([BLOCK_P], dtype=tl.int32)
            above = tl.zeros([BLOCK_P], dtype=tl.int32)
            for n_start in range(0, N, BLOCK_N):
                n_offs = n_start + tl.arange(0, BLOCK_N)
                n_in = n_offs < N
                last_n = tl.load(last_ptr + n_offs, mask=n_in, other=never)
                value_n = tl.load(value_ptr + n_offs, mask=n_in, other=0)
                value_n += bonus * ((now - 1 - last_n) < L).to(tl.int64)
                later = (last_n[None, :] > mine_last[:, None]) & n_in[None, :]
                higher = (value_n[None, :] > mine[:, None]) | ((value_n[None, :] == mine[:, None]) & later)
                newer += tl.sum(later.to(tl.int32), 1)
                above += tl.sum((higher & n_in[None, :]).to(tl.int32), 1)
            seen = mine_last != never
            lru_out = ~(seen & (newer < R))
            freq_out = ~(seen & (above < R))
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
        m_offs = tl.arange(0, 2)
        misses = tl.load(misses_ptr + m_offs)
        if FIRST_LAYER:
            misses = misses - (misses >> duel_shift)
        misses += tl.where(m_offs == 0, lru_only, freq_only) * score
        tl.store(misses_ptr + m_offs, misses)
        lru_misses = tl.sum(tl.where(m_offs == 0, misses, 0), 0)
        freq_misses = tl.sum(tl.where(m_offs == 1, misses, 0), 0)
        mode = (freq_misses + (freq_misses >> margin_shift) + floor < lru_misses).to(tl.int64)
        tl.store(mode_ptr, mode)
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
            order_rank = tl.zeros([BLOCK_E], dtype=tl.int32)
            count_rank = tl.zeros([BLOCK_E], dtype=tl.int32)
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
            tl.store(scratch_ptr + count_rank, c_e, mask=em_in)  # the curve: counts, largest first
            tl.debug_barrier()
            curve = tl.load(scratch_ptr + order_rank, mask=em_in, other=0, volatile=True)
            tl.store(ranked_ptr + base + e_offs, curve, mask=em_in)
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
            tl.store(
                l2p_ptr + tl.where(old >= 0, old, 0), (R + old % EM).to(tl.int32), mask=admit & (old >= 0)
            )
            tl.store(l2p_ptr + base + expert, row.to(tl.int32), mask=admit)
            tl.store(owner_ptr + row, base + expert, mask=admit)
            tl.store(stamp_ptr + row, now, mask=admit)
            tl.store(victims_ptr + i, row.to(tl.int32), mask=found)
            tl.store(codes_ptr + i, (R + expert).to(tl.int32), mask=found)
            tl.store(valid_ptr + i, admit.to(tl.int32))
            num_admitted += admit.to(tl.int32)
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
