"""Route counting for telemetry: one launch accumulates a layer's routed (token, slot) pairs per expert.

For every id `e` of `ids [N]`: `0 <= e < E` adds 1 to `counts[base + e]` (saturating at `max_count`, which sets
`flags[1]`, the sticky overflow bit) and sets `routed[base + e]`; `e < -1` or `e >= E` sets `flags[0]` (the
sticky poison bit) and counts nothing; `-1` is padding. Integer atomics only, so the result does not depend on
their order, and it replaces the eight torch ops of `RouteTelemetry.record` (one launch each in a graph).

Saturation: each add that reaches `max_count` is followed by an atomic min back to `max_count`; the last
operation on a counter is then either such a min or an add that stayed below, so the final value is
`min(old + adds, max_count)` in any interleaving.
"""

from __future__ import annotations

import torch

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

BLOCK = 1024


def count_routes_check(
    ids: torch.Tensor,
    counts: torch.Tensor,
    routed: torch.Tensor,
    flags: torch.Tensor,
    base: int,
    num_experts: int,
    max_count: int,
) -> None:
    """ValueError naming the argument unless the shapes, dtypes, range and devices fit (before any launch)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(
            f"ids: shape {tuple(ids.shape)} dtype {ids.dtype}; expected contiguous 1-d int32/int64"
        )
    if counts.dim() != 1 or counts.dtype != torch.int64:
        raise ValueError(f"counts: shape {tuple(counts.shape)} dtype {counts.dtype}; expected 1-d int64")
    if routed.shape != counts.shape or routed.dtype != torch.bool:
        raise ValueError(
            f"routed: shape {tuple(routed.shape)} dtype {routed.dtype}; expected {tuple(counts.shape)} bool"
        )
    if flags.shape != (2,) or flags.dtype != torch.int32:
        raise ValueError(f"flags: shape {tuple(flags.shape)} dtype {flags.dtype}; expected [2] int32")
    if base < 0 or num_experts < 1 or base + num_experts > counts.shape[0]:
        raise ValueError(
            f"base={base}, num_experts={num_experts} outside counts of {counts.shape[0]} entries"
        )
    if max_count < 1:
        raise ValueError(f"max_count={max_count} must be >= 1")
    for name, t in (("counts", counts), ("routed", routed), ("flags", flags)):
        if t.device != ids.device or not t.is_contiguous():
            raise ValueError(
                f"{name}: on {t.device} with strides {t.stride()}; expected contiguous on {ids.device}"
            )


def count_routes_reference(
    ids: torch.Tensor,
    counts: torch.Tensor,
    routed: torch.Tensor,
    flags: torch.Tensor,
    base: int,
    num_experts: int,
    max_count: int,
) -> None:
    """Torch reference of `count_routes` (same arguments, same in-place result)."""
    count_routes_check(ids, counts, routed, flags, base, num_experts, max_count)
    E = num_experts
    ids = ids.to(torch.int64)
    ok = (ids >= 0) & (ids < E)
    adds = torch.bincount(ids[ok], minlength=E)[:E]
    layer = counts[base : base + E]
    new = layer + adds
    if bool(((adds > 0) & (new >= max_count)).any()):
        flags[1] = 1
    layer.copy_(torch.where(adds > 0, new.clamp(max=max_count), layer))
    routed[base : base + E] |= adds > 0
    if bool(((ids < -1) | (ids >= E)).any()):
        flags[0] = 1


if triton is not None:

    @triton.jit
    def _count_routes_kernel(
        ids_ptr, n, counts_ptr, routed_ptr, flags_ptr, base, E, max_count, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int64)
        ok = in_range & (ids >= 0) & (ids < E)
        bad = in_range & ((ids < -1) | (ids >= E))
        ptr = counts_ptr + base + tl.where(ok, ids, 0)
        old = tl.atomic_add(ptr, tl.full([BLOCK], 1, tl.int64), mask=ok)
        over = ok & (old + 1 >= max_count)
        tl.atomic_min(ptr, tl.full([BLOCK], 0, tl.int64) + max_count, mask=over)
        tl.store(routed_ptr + base + tl.where(ok, ids, 0), tl.full([BLOCK], 1, tl.int8), mask=ok)
        num_bad = tl.sum(bad.to(tl.int32), 0)
        num_over = tl.sum(over.to(tl.int32), 0)
        tl.atomic_max(flags_ptr + 0, 1, mask=num_bad > 0)
        tl.atomic_max(flags_ptr + 1, 1, mask=num_over > 0)


def count_routes(
    ids: torch.Tensor,
    counts: torch.Tensor,
    routed: torch.Tensor,
    flags: torch.Tensor,
    base: int,
    num_experts: int,
    max_count: int,
) -> None:
    """Accumulate one layer step (see module docstring): `ids [N]` (N may be 0), `counts [S]` int64,
    `routed [S]` bool, `flags [2]` int32 (poison, overflow); the layer's counters are `[base, base + E)`.
    Graph-safe: no host sync, no allocation."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("count_routes needs Triton")
    count_routes_check(ids, counts, routed, flags, base, num_experts, max_count)
    n = ids.shape[0]
    if n == 0:
        return
    _count_routes_kernel[(triton.cdiv(n, BLOCK),)](
        ids, n, counts, routed.view(torch.int8), flags, base, num_experts, max_count, BLOCK=BLOCK, num_warps=4
    )
