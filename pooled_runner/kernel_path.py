"""The pooled forward on CUDA through `pooled_runner.kernels`: pool rows and the pinned host view read in place.

`KernelPath` binds one `PooledMoE`'s pool (`rows_gpu[op] [R, ...]`, `l2p_gpu[layer] [E_max]`) and bank
(`bank.layer(layer)[op] [E, ...]`, page-locked) to the kernels, validating each layer's operands once.
The location codes are read on the device; the caller plans residency first (`ExpertPool.plan_step` today).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pooled_runner.bank import ExpertBank
from pooled_runner.kernels.align import AlignOutput, align_blocks
from pooled_runner.kernels.combine import combine
from pooled_runner.kernels.fused_moe import (
    align_before_plan,
    make_projections,
    pick_configs,
    pooled_fused_moe,
)
from pooled_runner.kernels.moe_gemm import gemm1, gemm2
from pooled_runner.kernels.operands import KernelFormat, Projection, kernel_format
from pooled_runner.pool import ExpertPool
from pooled_runner.staging import StagedPass

if TYPE_CHECKING:
    from pooled_runner.planner import DevicePlanner
    from pooled_runner.telemetry import RouteTelemetry

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def kernels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel path can run: a CUDA pool and a bf16/fp16 compute dtype."""
    return device.type == "cuda" and dtype in KERNEL_DTYPES


class KernelPath:
    """Kernel forward of every pooled layer of one pool.

    Args:
      weight_format: the `pooled_runner.formats` object of the pool's rows.
      pool: the installed `ExpertPool`. bank: its `ExpertBank` (None when every expert is resident).
      hidden_size, intermediate_size: H, I.
    """

    def __init__(
        self,
        weight_format: object,
        pool: ExpertPool,
        bank: ExpertBank | None,
        hidden_size: int,
        intermediate_size: int,
    ):
        self.fmt: KernelFormat = kernel_format(weight_format)
        self.pool = pool
        self.bank = bank
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self._projections: dict[tuple[int, int | None], tuple[Projection, Projection]] = {}

    def projections(
        self, layer: int, host_view: dict[str, torch.Tensor] | None = None
    ) -> tuple[Projection, Projection]:
        """(w13, w2) of one layer: pool rows + the source of host codes, validated on first use.

        `host_view` replaces the source of host codes `R + i` (a prefill staging chunk buffer `[C, ...]` on the
        device, read at slot i through the pass's location table); None reads the pinned bank in place (host
        row e of the layer at code R + e).
        """
        if host_view is None and self.bank is not None:
            host_view = self.bank.layer(layer)
        key = (layer, None if host_view is None else next(iter(host_view.values())).data_ptr())
        if key not in self._projections:
            self._projections[key] = make_projections(
                self.fmt, self.pool.rows_gpu, host_view, self.hidden_size, self.intermediate_size
            )
        return self._projections[key]

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        host_view: dict[str, torch.Tensor] | None = None,
        after_plan: bool = False,
        long_plan: bool = False,
        aligned: AlignOutput | None = None,
    ) -> torch.Tensor:
        """`[T, H]` routed-experts output of `layer` with the current location codes (no host sync).
        `after_plan`: the step was just planned by a `DevicePlanner` with `overlap` (its plan + copy may still
        run beside the first kernel: `pooled_fused_moe`); `long_plan`: that planner's `long_plan`; `aligned`:
        `align_before_plan`'s output for this step. A device-planned step: `planned_forward`."""
        w13, w2 = self.projections(layer, host_view)
        return pooled_fused_moe(
            hidden,
            topk_ids,
            topk_weights,
            self.pool.l2p_gpu[layer],
            self.pool.num_experts_per_layer[layer],
            w13,
            w2,
            self.fmt,
            after_plan=after_plan,
            long_plan=long_plan,
            aligned=aligned,
        )

    def align_before_plan(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, overlap: bool, long_plan: bool
    ) -> AlignOutput | None:
        """The step's align launch before its plan, where the MoE will take the align path beside the plan
        (`overlap`, `long_plan`: the planner's; `kernels.fused_moe.align_before_plan`); None (nothing launched)
        elsewhere."""
        w13, w2 = self.projections(layer)
        return align_before_plan(
            hidden,
            topk_ids,
            self.pool.l2p_gpu[layer],
            self.pool.num_experts_per_layer[layer],
            w13,
            w2,
            self.fmt,
            overlap,
            long_plan,
        )

    def planned_forward(
        self,
        planner: DevicePlanner,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        telemetry: RouteTelemetry | None = None,
        router_scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A device-planned decode step of `layer` (graph-safe): the align of an align-path step beside the plan,
        `planner.plan`, then the MoE, its first GEMM the plan's programmatic dependent. `topk_weights` must be
        ready before the call (nothing may launch between the plan and the MoE)."""
        # non-contiguous weights are copied after the plan, which then does not overlap the MoE: no align before
        aligned = None
        if topk_weights.is_contiguous():
            aligned = self.align_before_plan(layer, hidden, topk_ids, planner.overlap, planner.long_plan)
        after_plan = planner.plan(layer, topk_ids, telemetry, router_scores)
        return self.forward(
            layer,
            hidden,
            topk_ids,
            topk_weights,
            after_plan=after_plan,
            long_plan=planner.long_plan,
            aligned=aligned,
        )

    def forward_staged(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        passes: Iterable[StagedPass],
    ) -> torch.Tensor:
        """`[T, H]` output of a staged `layer`: align + gemm1 + gemm2 per pass (the resident pass, then one per
        chunk buffer), each writing only its pairs' rows of one per-pair output, then one combine over top-k in
        k order with the layer's full location table. Every routed pair is computed by exactly one pass with
        the tiles `pooled_fused_moe` uses for T tokens on the align path, so the output is bitwise that of the
        unstaged step wherever that step takes the align path: always above GEMV_MAX_PAIRS (128) routed pairs;
        smaller int4 / NVFP4 steps may take the GEMV path unstaged, and dense ones of up to 16 pairs the
        one-launch split path (`default_variant`), which round differently (~1e-3 relative), so a
        `staging_min_tokens` that small trades bitwise equality for staging.
        `passes` is consumed lazily (each is enqueued before the next is requested: the stager's ring).
        """
        T, K = topk_ids.shape
        H = hidden.shape[1]
        num_experts = self.pool.num_experts_per_layer[layer]
        ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
        if T == 0:
            for _ in passes:  # nothing routed: no pass computes, but the ring must move on
                pass
            return torch.empty((0, H), dtype=hidden.dtype, device=hidden.device)
        cfg1, cfg2 = pick_configs(T, K, num_experts, H, self.intermediate_size, self.fmt.fmt)
        y = torch.empty((T * K, H), dtype=hidden.dtype, device=hidden.device)  # [T*K, H] per pair
        for p in passes:
            assert p.l2p_gpu is not None, "kernel passes need their location tables (with_tables=True)"
            w13, w2 = self.projections(layer, p.rows)
            align = align_blocks(ids, p.l2p_gpu, num_experts, w13.num_rows, cfg1.block_m)
            act = gemm1(hidden, align, w13, self.fmt, K, cfg1)
            gemm2(act, align, w2, self.fmt, T * K, cfg2, y=y)
        return combine(y, ids, weights, self.pool.l2p_gpu[layer], num_experts)
