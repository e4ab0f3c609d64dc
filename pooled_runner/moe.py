"""The pooled experts: installation of a model's experts, and the forward route -> locate -> compute -> combine.

`PooledMoE` owns the bank (host rows), the pool (device rows + location tables), the prefill stager and the
forward of every pooled layer. On CUDA (bf16/fp16) the forward runs on the Triton kernels, decode steps planned
on the device without a host sync (`gpu_path.GpuPath`); elsewhere it runs the batch-invariant torch path
(`torch_path`), planned on the host (copy-then-compute LRU with host-view fallback, `ExpertPool.plan_step`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pooled_runner import envs
from pooled_runner.bank import ExpertBank, check_expert_weights
from pooled_runner.config import PoolConfig
from pooled_runner.draft_prune import DraftPruner
from pooled_runner.formats import make_format
from pooled_runner.guard import TORCH, KernelBackend, check_tensors
from pooled_runner.lanes import takes_decode_path
from pooled_runner.moe_boundary import BoundaryOps
from pooled_runner.pool import ExpertPool
from pooled_runner.routing import check_routing
from pooled_runner.staging import LayerStager, make_stager
from pooled_runner.telemetry import RouteTelemetry, capturing
from pooled_runner.torch_path import torch_forward

if TYPE_CHECKING:
    from pooled_runner.gpu_path import GpuPath

logger = logging.getLogger("pooled_runner")

# loader(layer, expert) -> {operand name: row tensor}, in the weight format's operand layout.
ExpertLoader = Callable[[int, int], dict[str, torch.Tensor]]


class PooledMoE(BoundaryOps):
    """The routed experts of every pooled MoE layer, behind one shared pool.

    Usage: `register_layer(num_experts)` once per MoE layer, then `install(loader)`, then `forward(...)`; the
    boundary operations (`stats`, `reset_stats`, `sync_tables`, `evict_expert`, `telemetry_boundary`) come from
    `moe_boundary.BoundaryOps`.

    Args:
      config: resolved PoolConfig (`pool_rows`, device, format).
      hidden_size: H. intermediate_size: I (per rank). top_k: K, experts per token.
      dtype: compute dtype of activations and (bf16 format) weights.
    """

    def __init__(
        self,
        config: PoolConfig,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        dtype: torch.dtype = torch.bfloat16,
    ):
        if hidden_size <= 0 or intermediate_size <= 0 or top_k <= 0:
            raise ValueError(
                f"hidden_size={hidden_size}, intermediate_size={intermediate_size}, top_k={top_k} "
                "must all be positive"
            )
        self.config = config
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.top_k = top_k
        self.dtype = dtype
        self.format = make_format(config.weight_format, dtype)
        self.operands = self.format.operands(hidden_size, intermediate_size)
        self.num_experts_per_layer: list[int] = []
        self.bank: ExpertBank | None = None
        self.pool: ExpertPool | None = None
        self.stager: LayerStager | None = None
        self._storage: dict[str, torch.Tensor] | None = None  # bank tensors, or resident rows, once allocated
        # The kernel backend whose index limit the bank-size guard checks (the torch path has none).
        self.kernel_backend: KernelBackend = TORCH
        self._last_layer: int | None = None  # a call at a layer <= the last one starts a new step
        # Decode lanes (`lanes.decode_lanes`): steps of at most this many tokens (decode, verify, draft) take the
        # decode path and are never staged. None until the engine knows them (no step is a decode step then).
        self.decode_lanes: int | None = None
        # Steps seen per path ("decode" / "prefill"), keyed by step width in tokens.
        self.step_widths: dict[str, Counter[int]] = {"decode": Counter(), "prefill": Counter()}
        self.telemetry: RouteTelemetry | None = None  # route counters, when config.telemetry
        self._gpu_path: GpuPath | None = None  # kernels + device planner on CUDA, built on first use
        # MTP draft-lane pruning (`draft_prune.py`), when config.draft_pruning: verify steps marked by the caller.
        self.draft_pruner = (
            DraftPruner(config.torch_device, config.max_draft_misses) if config.draft_pruning else None
        )

    def register_layer(self, num_experts: int) -> int:
        """Register one MoE layer with `num_experts` routed experts; returns its pooled-layer index."""
        if self.pool is not None or self._storage is not None:
            # the bank (or the resident rows) is sized for the layers registered when allocate() ran
            raise RuntimeError("register_layer() after allocate()/install(): register every layer first")
        if num_experts <= 0:
            raise ValueError(f"num_experts={num_experts} must be positive")
        self.num_experts_per_layer.append(num_experts)
        return len(self.num_experts_per_layer) - 1

    def set_decode_lanes(self, lanes: int) -> None:
        """Steps of at most `lanes` tokens take the decode path from now on (never staged).

        On CUDA the device planner is sized by the lanes at the first forward: RuntimeError for more lanes than
        that afterwards (its buffers may be in captured graphs; set the lanes before the first forward)."""
        if lanes < 1:
            raise ValueError(f"decode lanes {lanes} must be >= 1")
        built_for = self._gpu_path.max_decode_tokens if self._gpu_path is not None else None
        if built_for is not None and lanes > built_for:
            raise RuntimeError(
                f"decode lanes {lanes}: the device planner was built at the first CUDA forward for steps of "
                f"<= {built_for} tokens; call set_decode_lanes({lanes}) before the first forward"
            )
        self.decode_lanes = lanes

    def begin_verify_step(self, num_spec: int) -> None:
        """The next step is an MTP verify step (`1 + num_spec` lanes per request, request-major): prune its
        draft lanes (`draft_prune.py`). Graph-safe (resets `draft_lane_alive()` with a device fill); the first
        call must be outside a capture. RuntimeError unless `config.draft_pruning` and decode lanes are set."""
        if self.draft_pruner is None or self.decode_lanes is None:
            raise RuntimeError(
                f"begin_verify_step() needs PoolConfig(draft_pruning=True) (is {self.config.draft_pruning}) "
                f"and set_decode_lanes() (lanes {self.decode_lanes})"
            )
        self.draft_pruner.arm(num_spec, self.decode_lanes)

    def draft_lane_alive(self, num_tokens: int | None = None) -> torch.Tensor:
        """`[T]` bool device view: the last verify step's live lanes (emit up to the last live lane of each
        request); T as `DraftPruner.lane_alive`. Reading it is the caller's sync, outside capture."""
        if self.draft_pruner is None:
            raise RuntimeError("draft pruning is off (PoolConfig.draft_pruning)")
        return self.draft_pruner.lane_alive(num_tokens)

    def takes_decode_path(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens is a decode-path step (within the lanes)."""
        return self.decode_lanes is not None and takes_decode_path(num_tokens, self.decode_lanes)

    @property
    def num_total_experts(self) -> int:
        return sum(self.num_experts_per_layer)

    @property
    def all_resident(self) -> bool:
        return self.config.pool_rows >= self.num_total_experts

    def install(self, loader: ExpertLoader, priority: list[tuple[int, int]] | None = None) -> None:
        """Load every expert through `loader`, one expert at a time, and fill the pool.

        With `pool_rows >= total experts` every expert goes straight to a row (no bank). Otherwise every
        expert goes to the bank, then the pool takes the first R pairs of `priority` (default layer-major).
        Equivalent to `allocate()`, writing each expert into `expert_rows()`, then `finalize(priority)`.
        """
        self.allocate()
        for layer, num_experts in enumerate(self.num_experts_per_layer):
            for expert in range(num_experts):
                weights = loader(layer, expert)
                check_expert_weights(self.operands, weights, f"loader(layer={layer}, expert={expert})")
                for name, dst in self.expert_rows(layer, expert).items():
                    dst.copy_(weights[name])
        self.finalize(priority)

    # Staged installation, for engines whose loader delivers weights piece by piece (SGLang's weight_loader
    # writes w1 and w3 of one expert in separate calls): allocate() once every layer is registered, write each
    # expert into `expert_rows(layer, expert)` in place, then finalize().
    def allocate(self) -> None:
        """Check the configuration, then allocate the storage of every registered expert.

        Storage is the host bank, or the pool rows themselves when every expert is resident. Raises
        ValueError (rows below top-k, bank-size guard) before any weight is read.
        """
        if not self.num_experts_per_layer:
            raise ValueError("install()/allocate() with no registered layer: call register_layer() first")
        if self.pool is not None or self._storage is not None:
            raise RuntimeError("allocate()/install() called twice")
        R = self.config.pool_rows
        if R < self.top_k:
            raise ValueError(
                f"pool_rows={R} is below top_k={self.top_k}: one token's experts must fit in "
                f"the rows; use --moe-expert-pool-rows >= {self.top_k}"
            )
        device = self.config.torch_device
        check_tensors(
            self.kernel_backend, self.operands, min(R, self.num_total_experts), self.num_experts_per_layer
        )
        if self.all_resident:
            total = self.num_total_experts
            self._storage = {
                spec.name: torch.empty((total, *spec.row_shape), dtype=spec.dtype, device=device)
                for spec in self.operands
            }
        else:
            self.bank = ExpertBank(self.operands, self.num_experts_per_layer, pin=device.type == "cuda")
            self._storage = self.bank.tensors_host

    @property
    def allocated(self) -> bool:
        return self._storage is not None

    def expert_rows(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Writable views `{operand: [*row_shape]}` of one expert's storage (between allocate and finalize)."""
        if self._storage is None or self.pool is not None:
            raise RuntimeError("expert_rows() is only valid between allocate() and finalize()")
        if not 0 <= layer < len(self.num_experts_per_layer):
            raise ValueError(f"layer {layer} out of range [0, {len(self.num_experts_per_layer)})")
        if not 0 <= expert < self.num_experts_per_layer[layer]:
            raise ValueError(
                f"expert {expert} out of range [0, {self.num_experts_per_layer[layer]}) for layer {layer}"
            )
        idx = sum(self.num_experts_per_layer[:layer]) + expert
        return {name: t[idx] for name, t in self._storage.items()}

    def finalize(self, priority: list[tuple[int, int]] | None = None) -> None:
        """Build the pool over the written experts: all resident, or the first R of `priority` in rows."""
        if self._storage is None:
            raise RuntimeError("finalize() before allocate()")
        if self.pool is not None:
            raise RuntimeError("finalize() called twice")
        device = self.config.torch_device
        total = self.num_total_experts
        if self.config.telemetry:
            self.telemetry = RouteTelemetry(self.num_experts_per_layer, device)
        if self.all_resident:
            self.pool = ExpertPool.all_resident(
                self.operands, self.num_experts_per_layer, device, self._storage
            )
            logger.info(
                "pool_rows=%d %s all %d experts: every expert resident, no host bank (%d rows used)",
                self.config.pool_rows,
                "holds" if self.config.pool_rows == total else ">=",
                total,
                total,
            )
            return
        assert self.bank is not None
        self.pool = ExpertPool(
            self.operands, self.num_experts_per_layer, self.config.pool_rows, device, self.bank
        )
        filled = self.pool.fill(priority)
        if self.config.prefill_staging:
            self.stager = make_stager(
                self.operands,
                self.bank,
                self.pool.num_rows,
                max(self.num_experts_per_layer),
                self.config,
                device,
            )
        logger.info(
            "expert pool: %d rows (%.3f GiB on %s), %d filled, %d layers, %d experts",
            self.pool.num_rows,
            self.pool.nbytes / (1 << 30),
            device,
            filled,
            len(self.num_experts_per_layer),
            total,
        )

    def _staged_source(self, layer: int, num_tokens: int) -> LayerStager | None:
        """The stager when this step is staged (its layers stream their non-resident experts), else None.

        A call at a layer <= the last one starts a new step: it is counted under its path, and only a step
        wider than the decode lanes may be staged (a verify step of 1 + num_spec tokens per request never is).
        """
        if self._last_layer is None or layer <= self._last_layer:
            decode = self.takes_decode_path(num_tokens)
            if not capturing():  # a capture's forward runs no step (replays run no Python: not counted)
                self.step_widths["decode" if decode else "prefill"][num_tokens] += 1
            if self.stager is not None:
                assert self.pool is not None
                if decode:
                    self.stager.end_step()
                else:
                    self.stager.begin_step(num_tokens, self.pool.l2p_gpu)
        self._last_layer = layer
        if self.stager is None:
            return None
        return self.stager if self.stager.active else None

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        admit_misses: bool = True,
        router_scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed-experts output of one pooled layer.

        Args:
          layer: pooled-layer index (from `register_layer`).
          hidden: `[T, H]` in `dtype` (T may be 0).
          topk_ids: `[T, K]` int32/int64 logical expert ids; -1 is padding and contributes nothing.
          topk_weights: `[T, K]` floating combine weights.
          admit_misses: copy missed experts into rows (LRU) before computing; False reads them in place.
          router_scores: `[T, >= E]` floating, the scores the top-k was taken on (logit units), for a device
            planner policy that reads them (`planner_policy` "adaptive-router" or "adaptive-router-duel"); ignored
            otherwise.
        Returns:
          `[T, H]` in `dtype`: `sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])`.
        """
        pool = self._require_pool()
        if not 0 <= layer < len(self.num_experts_per_layer):
            raise ValueError(f"layer {layer} out of range [0, {len(self.num_experts_per_layer)})")
        kernels = self._use_kernels(pool)
        # The kernel path checks shapes only: reading id values back would sync (and break capture); the planner
        # and the kernels treat ids outside [0, E) as not routed.
        check_routing(
            hidden,
            topk_ids,
            topk_weights,
            self.hidden_size,
            self.dtype,
            self.num_experts_per_layer[layer],
            check_values=not kernels,
        )
        staged = self._staged_source(layer, hidden.shape[0])
        if self.draft_pruner is not None:  # dead draft lanes become padding before planning and telemetry
            E = self.num_experts_per_layer[layer]
            topk_ids, topk_weights = self.draft_pruner.prune(
                layer, topk_ids, topk_weights, pool.l2p_gpu[layer], pool.num_rows, E
            )
        if kernels:  # the GPU path records telemetry (inside the fused planner where it can)
            return self._gpu().forward(
                layer, hidden, topk_ids, topk_weights, staged, admit_misses, self.telemetry, router_scores
            )
        if self.telemetry is not None:
            self.telemetry.record(layer, topk_ids)
        return torch_forward(pool, self.format, layer, hidden, topk_ids, topk_weights, staged, admit_misses)

    def _use_kernels(self, pool: ExpertPool) -> bool:
        """The Triton kernel path on a CUDA pool with a bf16/fp16 dtype, unless forced to the torch path."""
        from pooled_runner.kernel_path import kernels_supported

        return kernels_supported(pool.device, self.dtype) and not envs.force_torch_path()

    def _gpu(self) -> GpuPath:
        from pooled_runner.gpu_path import GpuPath

        if self._gpu_path is None:
            self._gpu_path = GpuPath(self)
        return self._gpu_path
