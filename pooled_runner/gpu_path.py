"""The pooled forward on CUDA: device-planned decode steps (graph-safe) and host-planned wider steps.

Decode steps (at most `max_decode_tokens` tokens, not staged, admitting misses) are planned by the
`DevicePlanner` on the device and run on the kernels with no host sync, so they can be captured in a CUDA
graph and replayed with other routing. Wider steps (prefill, or host-view-only reads) are planned on the host
(`ExpertPool.plan_step`, one sync) and may be staged (`LayerStager.layer_passes`: the resident experts, then
the chunks of routed non-resident experts streamed through the stager's ring, `KernelPath.forward_staged`).
The device planner's state is the truth between steps (a replayed graph plans without Python knowing): a
host-planned step first copies it into the pool's host bookkeeping (`store_to_pool`), plans, then loads the
result back (`load_from_pool`), so a graph replayed afterwards plans from current tables.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pooled_runner.kernel_path import KernelPath
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import policy_for_pool
from pooled_runner.pool import PoolStats
from pooled_runner.staging import LayerStager
from pooled_runner.telemetry import RouteTelemetry

if TYPE_CHECKING:
    from pooled_runner.moe import PooledMoE

logger = logging.getLogger("pooled_runner")

# Decode tokens per step served by the device planner when the engine has not set decode lanes.
DEFAULT_DECODE_TOKENS = 64


class GpuPath:
    """Kernels + device planner of one installed `PooledMoE` on CUDA."""

    def __init__(self, moe: PooledMoE):
        pool = moe.pool
        assert pool is not None, "GpuPath needs an installed PooledMoE"
        self.moe = moe
        self.pool = pool
        self.kernels = KernelPath(moe.format, pool, moe.bank, moe.hidden_size, moe.intermediate_size)
        self.max_decode_tokens = moe.decode_lanes or DEFAULT_DECODE_TOKENS
        # Every expert resident: nothing to plan, every code is a row.
        policy_name = moe.config.planner_policy
        self.planner = (
            DevicePlanner(
                pool,
                policy_for_pool(policy_name, pool.num_rows),
                max_routed=self.max_decode_tokens * moe.top_k,
            )
            if pool.bank is not None
            else None
        )
        if self.planner is not None and not self.planner.fused:
            logger.warning(
                "planner policy %s runs on the torch-ops planner: a few dozen small kernels per layer, several "
                "times the MoE's own time per decode step on an H200 (docs/BENCHMARKS.md); lru-cycle and lru "
                "plan in one fused launch per layer, as do adaptive and adaptive-router",
                policy_name,
            )
        logger.info(
            "GPU path: device planner (policy %s) for steps of <= %d tokens%s",
            policy_name,
            self.max_decode_tokens,
            "" if self.planner is not None else " (not needed: every expert resident)",
        )

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        staged: LayerStager | None,
        admit_misses: bool,
        telemetry: RouteTelemetry | None = None,
        router_scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[T, H]` output of `layer`; see the module docstring for which planner runs. `telemetry` records
        the step's routes (inside the fused plan kernel on device-planned steps). `staged`: the stager when
        this step is staged (active). `router_scores [T, >= E]`: for a device planner policy that reads them."""
        T = hidden.shape[0]
        capturing = torch.cuda.is_current_stream_capturing()
        device_planned = self.planner is not None and staged is None and admit_misses
        device_planned = device_planned and T <= self.max_decode_tokens
        if telemetry is not None and not device_planned:
            telemetry.record(layer, topk_ids)
        if self.planner is not None and device_planned:
            return self.kernels.planned_forward(
                self.planner, layer, hidden, topk_ids, topk_weights, telemetry, router_scores
            )
        if self.planner is not None:
            if capturing:
                raise RuntimeError(
                    f"a step of {T} tokens (staged={staged is not None}, admit_misses={admit_misses}) cannot "
                    f"be captured: only decode steps of <= {self.max_decode_tokens} tokens are device-planned "
                    "(set_decode_lanes(>= T) before the first forward sizes the planner)"
                )
            self.planner.store_to_pool()
            ids = topk_ids.long()  # [T, K]
            experts = torch.unique(ids[(ids >= 0) & (ids < self.pool.num_experts_per_layer[layer])]).tolist()
            self.pool.plan_step(layer, experts, admit_misses=admit_misses, staged=staged is not None)
            self.planner.load_from_pool()
            if staged is not None:
                passes = staged.layer_passes(layer, experts, with_tables=True)
                return self.kernels.forward_staged(layer, hidden, topk_ids, topk_weights, passes)
        return self.kernels.forward(layer, hidden, topk_ids, topk_weights)

    def sync_tables_to_host(self) -> None:
        """Make the pool's host bookkeeping current (after device-planned steps). Syncs; not during capture."""
        if self.planner is not None:
            self.planner.store_to_pool()

    def reset_device_counters(self) -> None:
        """Zero the device planner's counters in place (outside capture; captured steps keep adding to them)."""
        if self.planner is not None:
            self.planner.counters.zero_()

    def add_device_counters(self, stats: PoolStats) -> PoolStats:
        """`stats` plus the device planner's counters (hits, misses, admissions, evictions, host-view reads)."""
        if self.planner is None:
            return stats
        c = self.planner.counter_values()
        row_bytes = self.pool.row_bytes
        stats.hits += c["hits"]
        stats.misses += c["misses"]
        stats.admissions += c["admissions"]
        stats.evictions += c["evictions"]
        stats.bytes_copied_to_rows += c["admissions"] * row_bytes
        stats.bytes_read_host_view += c["host_reads"] * row_bytes
        return stats
