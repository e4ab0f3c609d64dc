"""Fused plan of one decode step of one layer for the adaptive policies (`adaptive`, `adaptive-router`,
`adaptive-router-duel`): the policy's update and the whole residency decision in one single-program launch.

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
  DUEL (`policy_duel.py`): two memberships and two ranked counts (slow, fast), stored one after the other; step
     2 also scores an idealized frequency cache under each ranked order (the adaptive duel reads the order
     chosen at the previous tick), step 3 decays both memberships (their own shifts), both ranked counts and
     the order misses, adds the misses where the two orders disagree and picks the order, step 4 ranks both,
     and the decisions below read the chosen order's ranked counts;
  5. hit rows get the new stamp; candidates = misses with `ceil(tokens / block_m) >= min_reads`, in the order
     (-value x mode, expert id); victims = rows not used by this step in the order (free first, value x mode,
     then `(stamp + 1) * R + row`, i.e. least recently used, then row index): pair i is the i-th of each, both
     searched in increasing key order; it is admitted when the victim is free, the mode is LRU, or the
     candidate's value plus the recent bonus reaches the victim's key;
  6. evictions and admissions in the tables, the admitted pairs for the row gather (`victims`, `codes` =
     R + expert, `valid`: 0 for a rejected pair; the admitted pairs come first: candidates in falling value
     meet victims in rising key, so once a pair is rejected so are the rest), and the counters (hits, misses,
     admissions, host reads, evictions).
The router's membership units are added before the launch (`RouterAdaptivePolicy.observe_scores_fused`: one
launch of `kernels/membership.py`). In LRU mode the decisions equal `plan_lru`'s without cycle protection.

Shapes: as `plan_lru.py` (`ids [T*K]`, `l2p [L * E_max]` int32, `row_owner, row_stamp [>= R]` int64, `clock
[1]`, `counters [5]` int64, `counts [>= E_max]` int32 scratch, `victims, codes, valid [P]` int32), plus the
policy's state (`AdaptiveState`): `count [L * E_max + 1]`, `last_use [L * E_max]`, `misses [2]`, `mode [1]`,
with the router `member [L * E_max]` and `ranked [L * E_max + 1]` (with the duel `[2 * L * E_max]` and
`[2 * (L * E_max + 1)]`: slow then fast, plus `order_misses [2]` and `order_state [3]`), and a scratch
`[>= E_max]`, all int64.
The torch reference with the same signature is `plan_adaptive_ref.plan_adaptive_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .plan_lru import MAX_COUNT_MATRIX, Telemetry, check_plan_arguments, check_plan_warps

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

NEVER = -(1 << 40)  # `policy_base.NEVER`: the last use of an expert never routed
ROW_BLOCK = 256
SHADOW_BLOCK = 256  # experts of all layers compared per pass of the shadow ranks
PRESENT_BLOCK = 16  # present experts per pass (a narrow step: one pass)
# experts compared per pass of the router's pairwise ranks (H200, 2026-12-04, bench.plan_blocks, tree 0c3d7df,
# 6 layers, E 128, R 384: the plan alone 106.3 µs per step at M=1 and 212.7 at M=8, against 124.0 and 223.9 with
# 16; 64: 201.7 and 324.2)
RANK_BLOCK = 32


class AdaptiveState(NamedTuple):
    """The adaptive policy's device state (`AdaptivePolicy` / `RouterAdaptivePolicy` tensors) and a scratch."""

    count: torch.Tensor  # [N + 1] chain-start counts (fixed point), last slot a dummy
    last_use: torch.Tensor  # [N] tick of the last routing, NEVER before the first
    misses: torch.Tensor  # [2] decayed shadow misses: LRU-only, frequency-only (x SCORE)
    mode: torch.Tensor  # [1] 1 = frequency mode
    member: torch.Tensor | None  # [N] router membership units (the router policies; duel: [2N] slow, fast)
    ranked: torch.Tensor | None  # [N + 1] ranked counts (the router policies; duel: [2(N + 1)] slow, fast)
    scratch: torch.Tensor  # [>= E_max] int64 workspace
    # the duel only (`MemoryDuelPolicy`): [2] decayed slow-only, fast-only shadow misses (x SCORE); [3] the
    # order chosen at the last tick (1: fast), ticks that ended with it fast, all ticks
    order_misses: torch.Tensor | None = None
    order_state: torch.Tensor | None = None


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
    fast_decay_shift: int = 0  # the duel's fast membership decay (its slow one is member_decay_shift)
    order_floor: int = 0  # the duel's order floor x SCORE


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
    duel = state.order_misses is not None
    if duel != (state.order_state is not None) or (duel and state.member is None):
        raise ValueError("order_misses and order_state come together, with member and ranked (the duel)")
    if duel and (not 1 <= rule.fast_decay_shift <= 30 or rule.order_floor < 0):
        raise ValueError(f"the duel needs fast_decay_shift in [1, 30] and order_floor >= 0: {rule}")
    copies = 2 if duel else 1
    want = {"count": n + 1, "last_use": n, "misses": 2, "mode": 1, "member": copies * n,
            "ranked": copies * (n + 1), "order_misses": 2, "order_state": 3}  # fmt: skip
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


def check_adaptive_arguments(
    plan: tuple[torch.Tensor, ...],
    sizes: tuple[int, ...],
    state: AdaptiveState,
    rule: AdaptiveRule,
    telemetry: Telemetry | None = None,
) -> None:
    """ValueError naming the first bad argument of `plan_adaptive` (the plan tables as `plan_lru`'s, the
    layer count, the policy state, the pair count). `plan` = (ids, l2p, row_owner, row_stamp, clock, counters,
    counts, victims, codes, valid), `sizes` = (layer, num_experts, max_experts, num_rows, block_m, min_reads):
    `plan_adaptive`'s arguments in order."""
    check_plan_arguments(*plan, *sizes, None, telemetry)
    ids, l2p, victims = plan[0], plan[1], plan[7]
    _, num_experts, max_experts, num_rows, _, _ = sizes
    num_layers = rule.num_layers
    if l2p.shape[0] != num_layers * max_experts:
        raise ValueError(f"l2p holds {l2p.shape[0]} entries, expected L * E_max = {num_layers * max_experts}")
    check_adaptive_state(state, rule, max_experts)
    if state.count.device != ids.device:
        raise ValueError(f"the policy state is on {state.count.device}, the ids on {ids.device}")
    num_pairs = victims.shape[0]
    if num_pairs > min(num_experts, num_rows):
        raise ValueError(f"num_pairs={num_pairs} > min(E={num_experts}, R={num_rows})")


def adaptive_kernel_arguments(
    plan: tuple[torch.Tensor, ...],
    sizes: tuple[int, ...],
    state: AdaptiveState,
    rule: AdaptiveRule,
    telemetry: Telemetry | None = None,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The positional arguments and the constexprs of `_plan_adaptive_body` for checked `plan_adaptive`
    arguments (`plan`, `sizes` as `check_adaptive_arguments`'s; shared by the one-launch plan + copy)."""
    ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid = plan
    layer, num_experts, max_experts, num_rows, block_m, min_reads = sizes
    num_layers, num_routed = rule.num_layers, ids.shape[0]
    block_tk = min(1024, triton.next_power_of_2(max(num_routed, 1)))
    block_e = triton.next_power_of_2(max_experts)
    # no wider than the present experts can be: at M = 1 (8 ids) a pass of 8 (H200, 2026-12-04, bench.plan_blocks,
    # 6 layers, E 128: router plan 91.6 µs per step against 107.3 with 16, the duel's 141.3 against 164.2)
    block_p = min(PRESENT_BLOCK, triton.next_power_of_2(max(num_routed, 1)))
    member = state.member if state.member is not None else state.count  # placeholders: unread without ROUTER
    ranked = state.ranked if state.ranked is not None else state.count
    # placeholders again: unread without DUEL
    order_misses = state.order_misses if state.order_misses is not None else state.misses
    order_state = state.order_state if state.order_state is not None else state.mode
    tel = (
        (telemetry[0], telemetry[1].view(torch.int8), telemetry[2]) if telemetry is not None else (clock,) * 3
    )
    args = (
        ids, num_routed, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid,
        *tel, telemetry[3] if telemetry is not None else 1,
        state.count, state.last_use, state.misses, state.mode, member, ranked, state.scratch,
        order_misses, order_state,
        layer * max_experts, num_experts, max_experts, num_rows, num_layers * max_experts, num_layers,
        victims.shape[0], block_m, min_reads, NEVER,
        rule.decay_shift, rule.duel_shift, rule.margin_shift, rule.floor, rule.bonus, rule.score, rule.one,
        rule.member_decay_shift, rule.fast_decay_shift, rule.order_floor,
    )  # fmt: skip
    meta = dict(
        BLOCK_TK=block_tk, BLOCK_E=block_e, BLOCK_R=ROW_BLOCK, BLOCK_N=SHADOW_BLOCK, BLOCK_P=block_p,
        BLOCK_J=RANK_BLOCK, ROUTER=state.member is not None, DUEL=state.order_misses is not None,
        FIRST_LAYER=layer == 0,
        COUNT_IN_REGISTERS=block_tk * block_e <= MAX_COUNT_MATRIX and num_routed <= 1024,
        TELEMETRY=telemetry is not None,
    )  # fmt: skip
    return args, meta


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
    num_warps: int = 4,
) -> None:
    """Plan one step of `layer` and update the policy's state in place (see module docstring). One launch,
    graph-safe (no host sync, no allocation). `P = victims.shape[0]` (the planner passes `min(E, R, T*K)`) and
    T*K may be 0 (then the clock moves and the policy sees an empty step). `telemetry = (counts, routed, flags,
    max_count)` also records the step's route telemetry (the `count_routes` contract, from the token counts the
    kernel computes anyway). `num_warps`: a power of two <= 32. ValueError for bad shapes."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("plan_adaptive needs Triton")
    plan = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    sizes = (layer, num_experts, max_experts, num_rows, block_m, min_reads)
    check_adaptive_arguments(plan, sizes, state, rule, telemetry)
    check_plan_warps(num_warps)
    args, meta = adaptive_kernel_arguments(plan, sizes, state, rule, telemetry)
    _plan_adaptive_kernel[(1,)](*args, **meta, num_warps=num_warps)


if triton is not None:
    from .plan_adaptive_body import _plan_adaptive_body

    @triton.jit
    def _plan_adaptive_kernel(
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
    ):  # fmt: skip
        _plan_adaptive_body(
            ids_ptr, num_routed, l2p_ptr, owner_ptr, stamp_ptr, clock_ptr, counters_ptr, counts_ptr,
            victims_ptr, codes_ptr, valid_ptr, tel_counts_ptr, tel_routed_ptr, tel_flags_ptr, tel_max,
            count_ptr, last_ptr, misses_ptr, mode_ptr, member_ptr, ranked_ptr, scratch_ptr,
            order_misses_ptr, order_state_ptr,
            base, E, EM, R, N, L, num_pairs, block_m, min_reads, never,
            decay_shift, duel_shift, margin_shift, floor, bonus, score, one, member_decay_shift,
            fast_decay_shift, order_floor,
            BLOCK_TK, BLOCK_E, BLOCK_R, BLOCK_N, BLOCK_P, BLOCK_J, ROUTER, DUEL, FIRST_LAYER,
            COUNT_IN_REGISTERS, TELEMETRY, False,
        )  # fmt: skip
