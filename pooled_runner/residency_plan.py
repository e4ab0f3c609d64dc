"""Coarse-boundary residency plans: pin the hottest experts of a telemetry window into rows, all or nothing.

Built from a valid `TelemetrySnapshot` (a poisoned or overflowed window is refused), applied outside capture.
`apply_plan` first decides every (row, expert) assignment without touching anything, backs up the rows it will
overwrite and the bookkeeping (pool tables, owners, LRU order, the device planner's state), then copies. If any
copy fails, the backed-up rows and state are restored exactly and `PlanApplyError` says so; the tables are only
switched after every copy succeeded. The pinned experts become the most recently used rows, hottest last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pooled_runner.planner import DevicePlanner
from pooled_runner.pool import ExpertPool
from pooled_runner.telemetry import TelemetrySnapshot

logger = logging.getLogger("pooled_runner")

# copy_row(index of the copy, row, weights): writes one row (default `pool.write_row`); a test hook for faults.
RowCopy = Callable[[int, int, dict[str, torch.Tensor]], None]


class PlanApplyError(RuntimeError):
    """A plan failed midway; rows, tables and LRU state were restored to exactly what they were."""


@dataclass(frozen=True)
class ResidencyPlan:
    """(layer, expert) pairs to pin, hottest first, from the window of `epoch`."""

    epoch: int
    pinned: tuple[tuple[int, int], ...]


def plan_from_snapshot(snapshot: TelemetrySnapshot, max_pinned: int) -> ResidencyPlan | None:
    """The `max_pinned` most routed experts of the window (count > 0; ties by layer, expert), or None for a
    window that must be discarded (poison / overflow; the reason is logged)."""
    if max_pinned < 0:
        raise ValueError(f"max_pinned={max_pinned} must be >= 0")
    if not snapshot.valid:
        logger.warning("no residency plan from epoch %d: %s", snapshot.epoch, "; ".join(snapshot.problems()))
        return None
    EM = snapshot.counts.shape[1]
    flat = snapshot.counts.reshape(-1)
    order = sorted(range(flat.numel()), key=lambda i: (-int(flat[i]), i))
    pinned = tuple(divmod(i, EM) for i in order[:max_pinned] if int(flat[i]) > 0)
    return ResidencyPlan(snapshot.epoch, pinned)


def _assign(pool: ExpertPool, pinned: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """(row, layer, expert) for every pinned expert not yet resident: free rows first (lowest first), then
    least recently used rows whose owner is not pinned."""
    wanted = set(pinned)
    free = [r for r in range(pool.num_rows) if pool.row_owner[r] is None]
    reusable = [r for r in pool.lru_rows() if pool.row_owner[r] not in wanted]
    rows = iter(free + reusable)
    return [(next(rows), layer, expert) for layer, expert in pinned if not pool.is_resident(layer, expert)]


def apply_plan(
    pool: ExpertPool,
    plan: ResidencyPlan,
    planner: DevicePlanner | None = None,
    copy_row: RowCopy | None = None,
) -> int:
    """Make every pinned expert resident and most recently used, all or nothing (outside capture).

    Returns the number of rows copied. Raises ValueError (nothing changed) for a bad plan, PlanApplyError
    (everything restored) when a copy fails. With `planner`, its device state follows the pool.
    """
    pinned = plan.pinned
    if len(set(pinned)) != len(pinned):
        raise ValueError(f"plan of epoch {plan.epoch} pins an expert twice")
    if len(pinned) > pool.num_rows:
        raise ValueError(f"plan pins {len(pinned)} experts but the pool has {pool.num_rows} rows")
    for layer, expert in pinned:
        pool._check_expert(layer, expert)
    if pool.bank is None:
        return 0  # every expert is already resident
    assignment = _assign(pool, pinned)
    copy = copy_row if copy_row is not None else (lambda _i, row, w: pool.write_row(row, w))

    # Back up what the copies and the bookkeeping will change.
    rows_idx = torch.tensor([row for row, _, _ in assignment], dtype=torch.int64, device=pool.device)
    saved_rows = {name: t.index_select(0, rows_idx) for name, t in pool.rows_gpu.items()}
    saved_owner, saved_lru = list(pool.row_owner), pool.lru_rows()
    saved_planner = _planner_state(planner)
    try:
        for i, (row, layer, expert) in enumerate(assignment):
            copy(i, row, pool.bank.row(layer, expert))
    except Exception as exc:
        for name, t in pool.rows_gpu.items():
            t.index_copy_(0, rows_idx, saved_rows[name])
        pool.load_residency(saved_owner, saved_lru)
        _restore_planner(planner, saved_planner)
        raise PlanApplyError(
            f"residency plan of epoch {plan.epoch} failed at copy {i + 1}/{len(assignment)} "
            f"(row {row}, layer {layer}, expert {expert}): {exc}; rows, tables and LRU state restored"
        ) from exc

    owner = list(saved_owner)
    for row, layer, expert in assignment:
        owner[row] = (layer, expert)
    location = {o: r for r, o in enumerate(owner) if o is not None}
    pinned_rows = [location[p] for p in reversed(pinned)]  # hottest last = most recently used
    # every row in use is in saved_lru or newly filled, and a newly filled row holds a pinned expert
    rest = [r for r in saved_lru if r not in set(pinned_rows)]
    pool.load_residency(owner, rest + pinned_rows)
    counters = pool.stats_counters  # the plan's copies count as the planner's would (PoolStats)
    counters.admissions += len(assignment)
    counters.evictions += sum(saved_owner[row] is not None for row, _, _ in assignment)
    counters.bytes_copied_to_rows += len(assignment) * pool.row_bytes
    if planner is not None:
        planner.load_from_pool()
    logger.info(
        "residency plan of epoch %d: %d pinned, %d rows copied", plan.epoch, len(pinned), len(assignment)
    )
    return len(assignment)


def _planner_state(planner: DevicePlanner | None) -> dict[str, torch.Tensor]:
    if planner is None:
        return {}
    state = {"row_owner": planner.row_owner, "row_stamp": planner.row_stamp, "clock": planner.clock}
    state.update(planner.policy.state_tensors())
    return {k: v.clone() for k, v in state.items()}


def _restore_planner(planner: DevicePlanner | None, saved: dict[str, torch.Tensor]) -> None:
    if planner is None:
        return
    live = {"row_owner": planner.row_owner, "row_stamp": planner.row_stamp, "clock": planner.clock}
    live.update(planner.policy.state_tensors())
    for k, v in live.items():
        v.copy_(saved[k])
