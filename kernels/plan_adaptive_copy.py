"""Plan + admission copy of one decode step of one layer in ONE launch for the adaptive policies (`adaptive`,
`adaptive-router`, `adaptive-router-duel`): `plan_adaptive` then `gather_rows_multi` over every operand, with
`plan_copy.py`'s roles.

Why: the adaptive plan is a single program of serial phases (shadow ranks, decays, the router's ranking, the
key-ordered pair search); as its own launch followed by the row gather it adds its whole latency and two launches
to every layer of a decode step (docs/BENCHMARKS.md). Here role 0 runs the plan (`plan_adaptive_body`), publishes
the pairs up to the last admitted one (a rejected pair has `valid = 0` and copies nothing; by the rule they
follow the admitted ones, so a step that admits nothing publishes none), the other
roles copy their share of the admitted rows (`admit_copy._copy_published_pairs`), and with `early_trigger` the
MoE's first GEMM launches first thing and runs beside the plan: an admitted expert's code is written only once
its row is whole (`plan_sync._commit_admitted`), a hit's row cannot be a victim this step, so the GEMM reads
either the old code or a whole new row. The protocol (tickets, the sync words, PDL) is `plan_copy.py`'s.

The router's membership units are added before this launch (`kernels/membership.py`), as before `plan_adaptive`.
Same results as `plan_adaptive` followed by `gather_rows_multi` over every operand group (the reference below is
exactly that composition); `sync [SYNC_WORDS]` int32 must be zero before the launch and is zero after it.
"""

from __future__ import annotations

import torch

from .admit_copy import COPY_BLOCK, COPY_PROGRAMS, check_copy, copy_launch
from .plan_adaptive import AdaptiveRule, AdaptiveState, adaptive_kernel_arguments, check_adaptive_arguments
from .plan_adaptive_ref import plan_adaptive_reference
from .plan_lru import Telemetry
from .row_gather import MULTI_CHUNK_PROGRAMS, gather_rows_reference

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]


def plan_adaptive_copy(
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
    telemetry: Telemetry | None,
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    host_offset: int,
    sync: torch.Tensor,
    num_programs: int = COPY_PROGRAMS,
    chunk_programs: int = MULTI_CHUNK_PROGRAMS,
    cooperative: bool | None = None,
    pdl: bool = False,
    num_warps: int = 4,
    early_trigger: bool = False,
) -> None:
    """`plan_adaptive(...)` then `gather_rows_multi(rows, hosts, victims, codes, valid, num_rows, host_offset)`
    (every operand) in one launch (module docstring). The plan arguments are `plan_adaptive`'s; the copy and
    launch arguments (`rows`, `hosts`, `host_offset`, `sync`, `num_programs`, `chunk_programs`, `cooperative`,
    `pdl`, `num_warps`, `early_trigger`) are `plan_lru_copy`'s, with the same contract. Graph-safe: no host
    sync, no allocation. Runs on CUDA or under the Triton interpreter; ValueError for bad arguments."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("plan_adaptive_copy needs Triton")
    plan = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    sizes = (layer, num_experts, max_experts, num_rows, block_m, min_reads)
    check_adaptive_arguments(plan, sizes, state, rule, telemetry)
    check_copy(rows, hosts, victims, codes, valid, num_rows, host_offset, sync, num_programs, chunk_programs)
    args, meta = adaptive_kernel_arguments(plan, sizes, state, rule, telemetry)
    geo = copy_launch(
        ids, rows, hosts, victims.shape[0], num_programs, chunk_programs, cooperative, pdl, num_warps
    )
    _plan_adaptive_copy_kernel[(geo.programs,)](
        *args,
        sync,
        host_offset,
        geo.chunks,
        *geo.ops,
        **meta,
        NUM_OPS=len(rows),
        BLOCK=COPY_BLOCK,
        SPIN=geo.programs > 1,
        PDL=geo.pdl,
        EARLY_TRIGGER=early_trigger and geo.can_pdl,
        DEFER_COMMIT=early_trigger,  # also under the interpreter, which tests it
        TICKET=geo.ticket,
        **geo.launch,
    )


def plan_adaptive_copy_reference(
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
    telemetry: Telemetry | None,
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    host_offset: int,
    sync: torch.Tensor,
    num_programs: int = COPY_PROGRAMS,
    chunk_programs: int = MULTI_CHUNK_PROGRAMS,
    cooperative: bool | None = None,
    pdl: bool = False,
    num_warps: int = 4,
    early_trigger: bool = False,
) -> None:
    """Reference of `plan_adaptive_copy`: `plan_adaptive_reference`, then each operand's admitted rows copied
    from the bank (`gather_rows_reference`). Host-synchronizing; `sync` untouched; no telemetry (the reference
    plan records none: pass None)."""
    plan = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    sizes = (layer, num_experts, max_experts, num_rows, block_m, min_reads)
    if telemetry is not None:
        raise ValueError("plan_adaptive_copy_reference records no telemetry: pass telemetry=None")
    check_adaptive_arguments(plan, sizes, state, rule, None)
    check_copy(rows, hosts, victims, codes, valid, num_rows, host_offset, sync, num_programs, chunk_programs)
    plan_adaptive_reference(*plan, *sizes, state, rule)
    for dst, host in zip(rows, hosts):
        gather_rows_reference(dst, victims, dst, host, codes, valid, num_rows, host_offset)


if triton is not None:
    from .admit_copy import _copy_published_pairs
    from .pdl import trigger as _pdl_trigger
    from .pdl import wait as _pdl_wait
    from .plan_adaptive_body import _plan_adaptive_body
    from .plan_sync import _commit_admitted, _draw_ticket, _wait_for_plan

    @triton.jit
    def _plan_adaptive_copy_kernel(
        ids_ptr, num_routed, l2p_ptr, owner_ptr, stamp_ptr, clock_ptr, counters_ptr, counts_ptr,
        victims_ptr, codes_ptr, valid_ptr, tel_counts_ptr, tel_routed_ptr, tel_flags_ptr, tel_max,
        count_ptr, last_ptr, misses_ptr, mode_ptr, member_ptr, ranked_ptr, scratch_ptr,
        order_misses_ptr, order_state_ptr,
        base, E, EM, R, N, L, num_pairs, block_m, min_reads, never,
        decay_shift, duel_shift, margin_shift, floor, bonus, score, one, member_decay_shift,
        fast_decay_shift, order_floor,
        sync_ptr, host_offset, num_chunks,
        rows0, host0, numel0, rows1, host1, numel1, rows2, host2, numel2, rows3, host3, numel3,
        rows4, host4, numel4, rows5, host5, numel5, rows6, host6, numel6, rows7, host7, numel7,
        BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr, ROUTER: tl.constexpr, DUEL: tl.constexpr,
        FIRST_LAYER: tl.constexpr, COUNT_IN_REGISTERS: tl.constexpr, TELEMETRY: tl.constexpr,
        NUM_OPS: tl.constexpr, BLOCK: tl.constexpr,
        SPIN: tl.constexpr, PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr, DEFER_COMMIT: tl.constexpr,
        TICKET: tl.constexpr,
    ):  # fmt: skip
        # launched before the previous kernel ended: wait for it (its writes visible) before any access
        _pdl_wait(PDL)
        _pdl_trigger(EARLY_TRIGGER)  # the MoE's first GEMM may launch now (module docstring)
        num_programs = tl.num_programs(0)
        if TICKET:  # noqa: SIM108 (a plain grid: roles in start order, `_draw_ticket`: role 0 runs first)
            pid = _draw_ticket(sync_ptr, num_programs)
        else:  # a cooperative grid (all resident) or one program
            pid = tl.program_id(0)
        num_published = tl.full([], 0, tl.int32)
        if pid == 0:
            num_published += _plan_adaptive_body(
                ids_ptr, num_routed, l2p_ptr, owner_ptr, stamp_ptr, clock_ptr, counters_ptr, counts_ptr,
                victims_ptr, codes_ptr, valid_ptr, tel_counts_ptr, tel_routed_ptr, tel_flags_ptr, tel_max,
                count_ptr, last_ptr, misses_ptr, mode_ptr, member_ptr, ranked_ptr, scratch_ptr,
                order_misses_ptr, order_state_ptr,
                base, E, EM, R, N, L, num_pairs, block_m, min_reads, never,
                decay_shift, duel_shift, margin_shift, floor, bonus, score, one, member_decay_shift,
                fast_decay_shift, order_floor,
                BLOCK_TK, BLOCK_E, BLOCK_R, BLOCK_N, BLOCK_P, BLOCK_J, ROUTER, DUEL, FIRST_LAYER,
                COUNT_IN_REGISTERS, TELEMETRY, DEFER_COMMIT,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's plan writes happen before the release below
            if SPIN:  # with no pair the spinners read nothing of the plan: no release (no fence) needed
                published = num_published + 1
                tl.atomic_xchg(sync_ptr, published, sem="release", scope="gpu", mask=num_published > 0)
                tl.atomic_xchg(sync_ptr, published, sem="relaxed", scope="gpu", mask=num_published == 0)
        else:
            num_published += _wait_for_plan(sync_ptr, num_programs)
        # fmt: off
        _copy_published_pairs(pid, num_programs, num_published, valid_ptr, codes_ptr, victims_ptr, R, host_offset,
                              num_chunks, rows0, host0, numel0, rows1, host1, numel1, rows2, host2, numel2,
                              rows3, host3, numel3, rows4, host4, numel4, rows5, host5, numel5, rows6, host6,
                              numel6, rows7, host7, numel7, NUM_OPS, BLOCK)
        # fmt: on
        if DEFER_COMMIT and num_published > 0:
            _commit_admitted(sync_ptr, l2p_ptr, codes_ptr, victims_ptr, valid_ptr, base, R, num_published,
                             num_programs, BLOCK_E)  # fmt: skip
