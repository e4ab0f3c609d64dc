"""Plan + admission copy of one decode step of one layer in ONE launch (`plan_lru` then `gather_rows_multi`).

In a replayed graph every launch costs 1.5-2.5 µs even with no work, and on a step where every routed expert
hits, the admission copy has none: this kernel saves that launch. A grid of P programs:
  - role 0 (see below) runs the whole plan (`plan_lru._plan_lru_body`: tables, counters, telemetry, admitted pairs),
    then publishes the number of admissions n: `sync = n + 1` (an atomic exchange after a CTA barrier, with
    release semantics when n > 0, so every plan write is visible to whoever acquires it);
  - roles 1..P-1 spin on `sync != 0` (volatile loads), then add 2^16 to it (one atomic, acquire: it reads n
    and counts the arrival); the last arriver resets the word to 0 for the next launch (stream order: the next
    launch starts after this one ends, so nobody reads the word in between);
  - then all P programs copy their share of the admitted rows: items (pair, operand, chunk) over the n
    admitted pairs (a prefix of the pair list), item i by role i mod P, chunk c of a row = its blocks
    c, c + C, c + 2C, ... of COPY_BLOCK elements (`gather_rows_multi`'s chunking, with twice its block).
  - with `early_trigger`, an admitted expert's location code is written only after its row is whole
    (`_commit_admitted`; without it, by role 0 in the plan, as `plan_lru` does): each program arrives at
    `sync[1]` once its copies are stored (release); the last arriver (acquire) writes the admitted codes with
    release semantics and resets the word. Until then the table keeps the expert's host code. So a kernel that
    reads the table while this one runs finds, for each routed expert, either its old code (a hit's row, which
    this step cannot evict, or a host code) or the new row with its weights visible to an acquire load
    (`pdl.load_acquire`);
  - and every program lets the next kernel launch first thing (PDL `trigger`), so that the MoE's first GEMM
    runs beside the plan; that GEMM must then follow the rule above (`OVERLAP` in `moe_gemm.py`, `gemv.py` and `splitk.py`:
    read a code with acquire, wait for this kernel only on a host code, and wait before it ends, so that its
    completion still implies this kernel's).
Roles: in a plain grid each program takes the role of its ticket (`plan_sync._draw_ticket`: the order in which
the programs start), so role 0, which every spinner waits for, has started, whether or not the grid fits on the
device at once; `cooperative=True` launches a cooperative grid instead, roles by program id. Why no cooperative
launch is needed (DESIGN.md §5 asks for one where a grid's CTAs wait on each other): there is no grid barrier
here, only one-way waits on role 0, which has started and waits for nobody, and two last-arriver counters,
which never wait. Role 0 never waits for the others, so the scheme also runs under TRITON_INTERPRET=1 (programs
one after the other in program-id order, tickets equal to ids: role 0 has published before role 1 starts, the
last program commits). The sync words are zero again when the launch ends; the next launch of the planner reads
them only after this one is complete (it waits for the kernel before it first thing, and every kernel between
them waits before it completes: the chain of kernels/pdl.py).

Same results as `plan_lru` followed by `gather_rows_multi` over every operand group (the reference below is
exactly that composition); `sync [SYNC_WORDS]` int32 must be zero before the launch and is zero after it.
"""

from __future__ import annotations

import torch

from .admit_copy import (  # noqa: F401 (COPY_BLOCK, MAX_FUSED_OPERANDS, COPY_PROGRAMS: this module's API too)
    COPY_BLOCK,
    COPY_PROGRAMS,
    MAX_FUSED_OPERANDS,
    check_copy,
    copy_launch,
)
from .plan_lru import Telemetry, check_plan_arguments, kernel_arguments, plan_lru_reference
from .plan_sync import SYNC_WORDS  # noqa: F401 (the launch's sync words: this module's API too)
from .row_gather import MULTI_CHUNK_PROGRAMS, gather_rows_reference

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]


def plan_lru_copy_reference(
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
    cycle: torch.Tensor | None,
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
    """Reference of `plan_lru_copy`: `plan_lru_reference`, then each operand's admitted rows copied from the
    bank (`gather_rows_reference`, the pool rows as the device source). Host-synchronizing; `sync` untouched."""
    plan = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    sizes = (layer, num_experts, max_experts, num_rows, block_m, min_reads)
    check_plan_arguments(*plan, *sizes, cycle, telemetry)
    check_copy(rows, hosts, victims, codes, valid, num_rows, host_offset, sync, num_programs, chunk_programs)
    plan_lru_reference(*plan, *sizes, cycle, telemetry)
    for dst, host in zip(rows, hosts):
        gather_rows_reference(dst, victims, dst, host, codes, valid, num_rows, host_offset)


if triton is not None:
    from .admit_copy import _copy_published_pairs
    from .pdl import trigger as _pdl_trigger
    from .pdl import wait as _pdl_wait
    from .plan_body import _plan_lru_body
    from .plan_sync import _commit_admitted, _draw_ticket, _wait_for_plan

    @triton.jit
    def _plan_copy_kernel(
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
        sync_ptr,
        host_offset,
        num_chunks,
        rows0,
        host0,
        numel0,
        rows1,
        host1,
        numel1,
        rows2,
        host2,
        numel2,
        rows3,
        host3,
        numel3,
        rows4,
        host4,
        numel4,
        rows5,
        host5,
        numel5,
        rows6,
        host6,
        numel6,
        rows7,
        host7,
        numel7,
        BLOCK_TK: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PROTECT: tl.constexpr,
        TELEMETRY: tl.constexpr,
        COUNT_IN_REGISTERS: tl.constexpr,
        NUM_OPS: tl.constexpr,
        BLOCK: tl.constexpr,
        SPIN: tl.constexpr,
        PDL: tl.constexpr,
        EARLY_TRIGGER: tl.constexpr,
        DEFER_COMMIT: tl.constexpr,
        TICKET: tl.constexpr,
    ):
        # launched before the previous kernel ended: wait for it (its writes visible) before any access
        _pdl_wait(PDL)
        _pdl_trigger(EARLY_TRIGGER)  # the MoE's first GEMM may launch now (module docstring)
        num_programs = tl.num_programs(0)
        if TICKET:  # noqa: SIM108 (a plain grid: roles in start order, `_draw_ticket`: role 0 runs first)
            pid = _draw_ticket(sync_ptr, num_programs)
        else:  # a cooperative grid (all resident) or one program
            pid = tl.program_id(0)
        num_admitted = tl.full([], 0, tl.int32)
        if pid == 0:
            num_admitted += _plan_lru_body(
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
                BLOCK_TK,
                BLOCK_E,
                BLOCK_R,
                PROTECT,
                TELEMETRY,
                COUNT_IN_REGISTERS,
                DEFER_COMMIT,  # `_commit_admitted` then writes the admitted codes once the rows are whole
            )
            tl.debug_barrier()  # every thread's plan writes happen before the release below
            if SPIN:  # with no admission the spinners read nothing of the plan: no release (no fence) needed
                published = num_admitted + 1
                tl.atomic_xchg(sync_ptr, published, sem="release", scope="gpu", mask=num_admitted > 0)
                tl.atomic_xchg(sync_ptr, published, sem="relaxed", scope="gpu", mask=num_admitted == 0)
        else:
            num_admitted += _wait_for_plan(sync_ptr, num_programs)
        # fmt: off
        _copy_published_pairs(pid, num_programs, num_admitted, valid_ptr, codes_ptr, victims_ptr, R, host_offset,
                              num_chunks, rows0, host0, numel0, rows1, host1, numel1, rows2, host2, numel2,
                              rows3, host3, numel3, rows4, host4, numel4, rows5, host5, numel5, rows6, host6,
                              numel6, rows7, host7, numel7, NUM_OPS, BLOCK)
        # fmt: on
        if DEFER_COMMIT and num_admitted > 0:
            _commit_admitted(sync_ptr, l2p_ptr, codes_ptr, victims_ptr, valid_ptr, base, R, num_admitted,
                             num_programs, BLOCK_E)  # fmt: skip


def plan_lru_copy(
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
    cycle: torch.Tensor | None,
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
    """`plan_lru(...)` then `gather_rows_multi(rows, hosts, victims, codes, valid, num_rows, host_offset)` (every
    operand) in one launch (module docstring). The plan arguments are `plan_lru`'s; `rows[i] [R, n_i]` pool rows
    of operand i on the device, `hosts[i] [N, n_i]` its bank rows (page-locked on CUDA: not checked here, the
    caller checks once before capture), 1..8 operands; `host_offset` the layer's first bank row; `sync [SYNC_WORDS]`
    int32 zero. `num_programs` P (capped at the work: pairs x operands x chunks), `chunk_programs` C as in
    `gather_rows_multi`. `cooperative` (True: on CUDA where Triton supports it) launches cooperatively, None/False a
    plain grid whose programs take their roles by ticket; `pdl` (where `pdl.pdl_available`; both may be set) as a
    programmatic dependent launch: it may start while the previous kernel drains, every program waiting for it
    (`griddepcontrol.wait`) before its first access; `num_warps` per program (fewer: shorter reductions in the plan,
    the same bytes in flight in the copy); `early_trigger` (where `pdl.pdl_available`) lets the next kernel,
    PDL-launched, start beside this one (module docstring: what that kernel must then do). Graph-safe: no host
    sync, no allocation. Runs on CUDA or under the Triton interpreter."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("plan_lru_copy needs Triton")
    plan = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    sizes = (layer, num_experts, max_experts, num_rows, block_m, min_reads)
    check_plan_arguments(*plan, *sizes, cycle, telemetry)
    check_copy(rows, hosts, victims, codes, valid, num_rows, host_offset, sync, num_programs, chunk_programs)
    kernel_args, meta = kernel_arguments(*plan, *sizes, cycle, telemetry)
    geo = copy_launch(
        ids, rows, hosts, victims.shape[0], num_programs, chunk_programs, cooperative, pdl, num_warps
    )
    _plan_copy_kernel[(geo.programs,)](
        *kernel_args,
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
