"""`PooledMoE`'s boundary operations (a mixin): route telemetry's window and pinning, the host copy of the
device planner's tables, eviction, and the stats. Each runs between steps, outside any CUDA graph capture: on
CUDA the device planner's state is the truth between boundaries, so each first copies it into the pool's host
bookkeeping (`sync_tables`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pooled_runner.pool import ExpertPool, PoolStats
from pooled_runner.staging import LayerStager, StagingStats
from pooled_runner.telemetry import RouteTelemetry, capturing

if TYPE_CHECKING:
    from pooled_runner.gpu_path import GpuPath


class BoundaryOps:
    """The boundary operations of `PooledMoE` (`moe.py`), over the attributes it sets."""

    pool: ExpertPool | None
    stager: LayerStager | None
    telemetry: RouteTelemetry | None
    _gpu_path: GpuPath | None

    def _require_pool(self) -> ExpertPool:
        if self.pool is None:
            raise RuntimeError("PooledMoE used before install()")
        return self.pool

    def telemetry_boundary(self, max_pinned: int | None = None) -> int | None:
        """At a coarse boundary, outside any capture: close the route telemetry window and pin its hottest
        experts into rows (all or nothing, `residency_plan.apply_plan`), then start the next window.

        `max_pinned` defaults to half the rows (the rest stay under the LRU). Returns the rows copied, or None
        when telemetry is off, every expert is resident, or the window was discarded (poison / overflow).
        """
        from pooled_runner.residency_plan import apply_plan, plan_from_snapshot

        pool = self._require_pool()
        if self.telemetry is None:
            return None
        snapshot = self.telemetry.snapshot()
        self.telemetry.reset()
        if pool.bank is None:
            return None
        plan = plan_from_snapshot(snapshot, pool.num_rows // 2 if max_pinned is None else max_pinned)
        if plan is None:
            return None
        planner = None
        if self._gpu_path is not None:
            self._gpu_path.sync_tables_to_host()
            planner = self._gpu_path.planner
        return apply_plan(pool, plan, planner)

    def sync_tables(self) -> ExpertPool:
        """The pool, its host bookkeeping (location tables, row owners, LRU order) made current.

        On CUDA the device planner's state is the truth between boundaries (replayed graphs plan without
        Python knowing): it is copied into the pool first (syncs; RuntimeError during a CUDA graph capture).
        Elsewhere, or with every expert resident, the host bookkeeping already is the truth.
        """
        pool = self._require_pool()
        if self._gpu_path is not None and self._gpu_path.planner is not None:
            if capturing():
                raise RuntimeError(
                    "syncing the tables during a CUDA graph capture is refused: use a boundary"
                )
            self._gpu_path.sync_tables_to_host()
        return pool

    def evict_expert(self, layer: int, expert: int) -> int | None:
        """Give back the row holding (layer, expert): it is read through the host view until readmitted.

        Returns the row, or None when the expert was not in a row (nothing changes). A boundary operation, like
        `stats()`: on CUDA the device planner's state is synced to the host, changed there and loaded back, so
        the next device-planned (or replayed) step plans from it. A staged step in progress stops staging (its
        remaining layers read the bank's host view, which the staging buffers no longer match). ValueError for
        an unknown expert or when every expert is resident (no bank); RuntimeError during a CUDA graph capture.
        """
        if capturing():
            raise RuntimeError("evict_expert() during a CUDA graph capture is refused: call it at a boundary")
        pool = self.sync_tables()
        row = pool.lookup(layer, expert)
        if row >= pool.num_rows:
            return None
        pool.evict(row)
        if self.stager is not None:
            self.stager.end_step()
        if self._gpu_path is not None and self._gpu_path.planner is not None:
            self._gpu_path.planner.load_from_pool()
        return row

    def reset_stats(self) -> None:
        """Start the counters of `stats()` again: the pool's, the device planner's and the stager's. A boundary
        operation (outside capture)."""
        pool = self._require_pool()
        if capturing():
            raise RuntimeError(
                "reset_stats() during a CUDA graph capture: reset at a boundary, outside capture"
            )
        if self._gpu_path is not None:
            self._gpu_path.reset_device_counters()
        pool.reset_stats()
        if self.stager is not None:
            self.stager.stats = StagingStats()

    def stats(self) -> PoolStats:
        """Pool counters since installation or `reset_stats()`, device-planned steps included (a boundary
        operation: syncs the tables into the pool's host bookkeeping, `sync_tables()`)."""
        pool = self.sync_tables()
        stats = pool.stats()
        if self._gpu_path is not None:
            stats = self._gpu_path.add_device_counters(stats)
        if self.stager is not None:
            stats.rows_staged = self.stager.stats.rows_staged
            stats.bytes_staged = self.stager.stats.bytes_staged
        return stats
