"""Fused LRU plan of one decode step of one layer: the whole residency decision in one single-program launch.

It replaces the ~40 small torch ops of `DevicePlanner.plan` for the LRU policy (each a few microseconds of
launch time in a replayed graph) with one program that does, in order (the decision rule of `planner.py`):
  1. per-expert token counts of the routed ids (ids outside [0, E) are not routed);
  2. `clock += 1`; hit rows get the new stamp (so this step cannot evict them);
  3. candidates = misses with `ceil(tokens / block_m) >= min_reads`, in expert-id order;
  4. candidate i takes the i-th least recently used row not used by this step, free rows first, ties by row
     index (the key `(stamp + 1) * R + row`, searched in increasing order); with `cycle` given, only rows that
     are free, owned by this layer, or idle for a full cycle qualify (`pooled_runner/cycle_lru.py`);
  5. the victim's old owner goes back to its host code, the candidate takes the row;
  6. the counters (hits, misses, admissions, host reads, evictions) are incremented and the admitted pairs are
     written for the row-gather kernel (`victims`, `codes` = R + expert, `valid`).
Everything runs in one program, so the order is fixed (deterministic; `tl.debug_barrier` orders the global
writes between phases) and the integer results equal `HostTwin`'s. Latency, not work, is the cost: the loads that
depend on nothing (ids, clock, the layer's l2p, counters, telemetry, cycle words) are issued together first, and
the token counts of a narrow step (T*K x E <= MAX_COUNT_MATRIX) come from a comparison in registers, so a step
where every expert hits waits about one round trip to memory; each admitted miss adds a pass over the rows.
The body (`plan_body._plan_lru_body`) is shared with the one-launch plan + copy (`plan_copy.py`).

Shapes: `ids [T*K]` any integer dtype; `l2p [L * E_max]` int32 (flat); `row_owner, row_stamp [>= R]` int64;
`clock [1]`, `counters [5]` int64; `counts [>= E_max]` int32 scratch; `victims, codes, valid [P]` int32 outputs
with `P = num_pairs` (entries past the admissions get `valid = 0`).
"""

from __future__ import annotations

import torch

from .route_count import count_routes_check, count_routes_reference

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

Telemetry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # counts, routed, flags, max_count

MAX_ROWS = 1 << 22  # keeps (stamp + 1) * R + row inside int64 for 2^40 clock ticks
ROW_BLOCK = 1024
# Token counts by a [T*K, E] comparison in registers up to this many elements (64 per thread: M <= 8 at top-8
# of 128 experts, M <= 4 of 256), else by atomics in global memory (two barriers and a round trip more).
MAX_COUNT_MATRIX = 8192
# the warps a single-program plan launch takes (`plan_lru`, `plan_adaptive`)
PLAN_WARPS = (1, 2, 4, 8, 16, 32)


def check_plan_warps(num_warps: int) -> None:
    """ValueError unless `num_warps` is one of `PLAN_WARPS`."""
    if num_warps not in PLAN_WARPS:
        raise ValueError(f"num_warps={num_warps}: expected one of {PLAN_WARPS}")


def check_plan_arguments(
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
    cycle: torch.Tensor | None = None,
    telemetry: Telemetry | None = None,
) -> None:
    if telemetry is not None:
        tel_counts, tel_routed, tel_flags, tel_max = telemetry
        count_routes_check(ids, tel_counts, tel_routed, tel_flags, layer * max_experts, num_experts, tel_max)
    if cycle is not None and (
        cycle.shape != (3,) or cycle.dtype != torch.int64 or cycle.device != ids.device
    ):
        raise ValueError(
            f"cycle: shape {tuple(cycle.shape)} dtype {cycle.dtype}; expected [3] int64 on {ids.device}"
        )
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(
            f"ids: shape {tuple(ids.shape)} dtype {ids.dtype}; expected contiguous 1-d int32/int64"
        )
    if not 1 <= num_experts <= max_experts:
        raise ValueError(f"num_experts={num_experts} must be in [1, max_experts={max_experts}]")
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"num_rows={num_rows} must be in [1, {MAX_ROWS}]")
    if block_m < 1 or min_reads < 1:
        raise ValueError(f"block_m={block_m}, min_reads={min_reads} must be >= 1")
    if l2p.dim() != 1 or l2p.dtype != torch.int32 or l2p.shape[0] < (layer + 1) * max_experts or layer < 0:
        raise ValueError(
            f"l2p: shape {tuple(l2p.shape)} dtype {l2p.dtype}; expected flat int32 holding layer {layer} "
            f"(>= {(layer + 1) * max_experts} entries)"
        )
    for name, t, n in (("row_owner", row_owner, num_rows), ("row_stamp", row_stamp, num_rows)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] < n:
            raise ValueError(f"{name}: shape {tuple(t.shape)} dtype {t.dtype}; expected [>= {n}] int64")
    for name, t, n in (("clock", clock, 1), ("counters", counters, 5)):
        if t.shape != (n,) or t.dtype != torch.int64:
            raise ValueError(f"{name}: shape {tuple(t.shape)} dtype {t.dtype}; expected [{n}] int64")
    if counts.dim() != 1 or counts.dtype != torch.int32 or counts.shape[0] < max_experts:
        raise ValueError(
            f"counts: shape {tuple(counts.shape)} dtype {counts.dtype}; expected [>= {max_experts}] int32"
        )
    num_pairs = victims.shape[0]
    for name, t in (("victims", victims), ("codes", codes), ("valid", valid)):
        if t.shape != (num_pairs,) or t.dtype != torch.int32:
            raise ValueError(f"{name}: shape {tuple(t.shape)} dtype {t.dtype}; expected [{num_pairs}] int32")
    for name, t in (
        ("l2p", l2p),
        ("row_owner", row_owner),
        ("row_stamp", row_stamp),
        ("clock", clock),
        ("counters", counters),
        ("counts", counts),
        ("victims", victims),
        ("codes", codes),
        ("valid", valid),
    ):
        if t.device != ids.device:
            raise ValueError(f"{name} is on {t.device}, ids on {ids.device}: expected one device")
        if not t.is_contiguous():
            raise ValueError(f"{name} with strides {t.stride()} is not contiguous")


def plan_lru_reference(
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
    cycle: torch.Tensor | None = None,
    telemetry: Telemetry | None = None,
) -> None:
    """Plain-Python reference of `plan_lru` (same arguments, same in-place results; host-synchronizing)."""
    args = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    check_plan_arguments(
        *args, layer, num_experts, max_experts, num_rows, block_m, min_reads, cycle, telemetry
    )
    if telemetry is not None:
        count_routes_reference(ids, *telemetry[:3], layer * max_experts, num_experts, telemetry[3])
    R, EM, E = num_rows, max_experts, num_experts
    tokens = [0] * E
    for e in ids.tolist():
        if 0 <= e < E:
            tokens[e] += 1
    counts[:E] = torch.tensor(tokens, dtype=torch.int32)
    now = int(clock[0]) + 1
    clock[0] = now
    base = layer * EM
    if cycle is not None:  # cycle protection: a new cycle starts at a layer not above the previous one
        last, cur, prev = cycle.tolist()
        if last >= layer:
            prev, cur = cur, now
        cycle.copy_(torch.tensor([layer, cur, prev]))
    table = l2p[base : base + E].tolist()
    present = [e for e in range(E) if tokens[e] > 0]
    hits = [e for e in present if table[e] < R]
    for e in hits:
        row_stamp[table[e]] = now
    cands = [e for e in present if table[e] >= R and -(-tokens[e] // block_m) >= min_reads]
    stamps, owners = row_stamp[:R].tolist(), row_owner[:R].tolist()
    free_able = sorted((r for r in range(R) if stamps[r] != now), key=lambda r: (stamps[r], r))
    if cycle is not None:  # free, own layer's, or idle since before the previous cycle began
        prev = int(cycle[2])
        free_able = [r for r in free_able if owners[r] < 0 or owners[r] // EM == layer or stamps[r] < prev]
    valid.zero_()
    victims.zero_()
    codes.fill_(R)
    admitted = evicted = 0
    for i, (e, r) in enumerate(zip(cands[: victims.shape[0]], free_able)):
        old = owners[r]
        if old >= 0:
            l2p[old] = R + old % EM
            evicted += 1
        l2p[base + e] = r
        row_owner[r] = base + e
        row_stamp[r] = now
        victims[i], codes[i], valid[i] = r, R + e, 1
        admitted += 1
    misses = len(present) - len(hits)
    counters += torch.tensor([len(hits), misses, admitted, misses - admitted, evicted], dtype=torch.int64)


if triton is not None:
    from .plan_body import _plan_lru_body

    @triton.jit
    def _plan_lru_kernel(
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
    ):
        _plan_lru_body(
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
            False,  # DEFER_COMMIT: the row gather runs after this launch ends
        )


def plan_lru(
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
    cycle: torch.Tensor | None = None,
    telemetry: Telemetry | None = None,
    num_warps: int = 4,
) -> None:
    """Plan one step of `layer` in place (see module docstring). One launch of `num_warps` warps (a power of
    two <= 32), graph-safe (no host sync, no allocation). `P = victims.shape[0]` must be at least the number of
    admissions wanted (the planner passes `min(E, R, T*K)`); P and T*K may be 0 (then only the clock moves).
    `cycle [3]` int64 (last layer, clock at the current and at the previous cycle start) turns on cycle
    protection (`pooled_runner/cycle_lru.py`).
    `telemetry = (counts, routed, flags, max_count)` also records the step's route telemetry (the
    `count_routes` contract, from the counts this kernel computes anyway: no launch of its own)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("plan_lru needs Triton")
    args = (ids, l2p, row_owner, row_stamp, clock, counters, counts, victims, codes, valid)
    check_plan_arguments(
        *args, layer, num_experts, max_experts, num_rows, block_m, min_reads, cycle, telemetry
    )
    check_plan_warps(num_warps)
    kernel_args, meta = kernel_arguments(
        *args, layer, num_experts, max_experts, num_rows, block_m, min_reads, cycle, telemetry
    )
    _plan_lru_kernel[(1,)](*kernel_args, **meta, num_warps=num_warps)


def kernel_arguments(
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
) -> tuple[list[object], dict[str, object]]:
    """The arguments of `_plan_lru_body` (positional, then constexpr keywords) for checked inputs; shared with
    the one-launch plan + copy (`plan_copy.py`)."""
    assert triton is not None
    num_routed, num_pairs = ids.shape[0], victims.shape[0]
    if num_pairs > max_experts:
        raise ValueError(
            f"num_pairs={num_pairs} > max_experts={max_experts}: a step admits at most E experts"
        )
    tel_ptrs = (telemetry[0], telemetry[1].view(torch.int8), telemetry[2]) if telemetry is not None else ()
    kernel_args: list[object] = [
        ids,
        num_routed,
        l2p,
        row_owner,
        row_stamp,
        clock,
        counters,
        counts,
        victims,
        codes,
        valid,
        cycle if cycle is not None else clock,  # an unread placeholder without protection
        *(tel_ptrs if telemetry is not None else (clock, clock, clock)),  # (placeholders: unread)
        telemetry[3] if telemetry is not None else 1,
        layer,
        layer * max_experts,
        num_experts,
        max_experts,
        num_rows,
        num_pairs,
        block_m,
        min_reads,
    ]
    block_tk = min(1024, triton.next_power_of_2(max(num_routed, 1)))
    block_e = triton.next_power_of_2(max_experts)
    meta: dict[str, object] = {
        "BLOCK_TK": block_tk,
        "BLOCK_E": block_e,
        "BLOCK_R": min(ROW_BLOCK, triton.next_power_of_2(num_rows)),
        "PROTECT": cycle is not None,
        "TELEMETRY": telemetry is not None,
        "COUNT_IN_REGISTERS": block_tk >= num_routed and block_tk * block_e <= MAX_COUNT_MATRIX,
    }
    return kernel_args, meta
