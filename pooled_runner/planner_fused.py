"""The device planner's fused steps (`DevicePlanner.plan` on CUDA): LRU and lru-cycle in one plan + copy launch
(`kernels/plan_copy.py`) or a plan launch and the row gather (`kernels/plan_lru.py`); the adaptive policies
likewise (`kernels/plan_adaptive_copy.py`, or `kernels/plan_adaptive.py` and the row gather), with the
router's membership launch before either.
`self` is the planner; its tables are updated in place (see `planner.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.kernels.plan_adaptive import plan_adaptive
from pooled_runner.kernels.plan_adaptive_copy import plan_adaptive_copy
from pooled_runner.kernels.plan_copy import plan_lru_copy
from pooled_runner.kernels.plan_lru import plan_lru
from pooled_runner.kernels.row_gather import MAX_MULTI_OPERANDS, gather_rows_multi
from pooled_runner.policy_router import RouterAdaptivePolicy
from pooled_runner.telemetry import RouteTelemetry

if TYPE_CHECKING:
    from pooled_runner.planner import DevicePlanner


def plan_lru_fused(
    self: DevicePlanner,
    layer: int,
    topk_ids: torch.Tensor,
    E: int,
    num_pairs: int,
    telemetry: RouteTelemetry | None,
) -> bool:
    """LRU and the admitted rows' copy in one launch (`plan_lru_copy`), or in two (`plan_lru`, then
    `gather_rows_multi` per four operands). Returns whether the kernel read `topk_ids` in place."""
    prefix, in_place = _plan_prefix(self, layer, topk_ids, E, num_pairs)
    plan_args = (
        *prefix,
        self.policy.cycle if isinstance(self.policy, CycleLRUPolicy) else None,
        telemetry.fused_target(layer) if telemetry is not None else None,
    )
    return _plan_and_copy(self, layer, plan_args, in_place, plan_lru, plan_lru_copy)


def plan_adaptive_fused(
    self: DevicePlanner,
    layer: int,
    topk_ids: torch.Tensor,
    E: int,
    num_pairs: int,
    router_scores: torch.Tensor | None,
    telemetry: RouteTelemetry | None,
) -> bool:
    """The adaptive policies' fused plan (telemetry recorded inside) and the admitted rows' copy: in one launch
    (`plan_adaptive_copy`) or in two (`plan_adaptive`, then `gather_rows_multi` per four operands); with the
    router, its membership launch first. Returns whether the plan read `topk_ids` in place."""
    policy = self._adaptive
    assert policy is not None
    if router_scores is not None:  # tokens with no routed id (padding lanes) do not vote
        assert isinstance(policy, RouterAdaptivePolicy), policy.name  # `plan` drops scores for the others
        if router_scores.stride(1) != 1:
            router_scores = router_scores.contiguous()
        policy.observe_scores_fused(layer, router_scores, topk_ids, E)
    prefix, in_place = _plan_prefix(self, layer, topk_ids, E, num_pairs)
    plan_args = (
        *prefix,
        policy.kernel_state(),
        policy.kernel_rule(),
        telemetry.fused_target(layer) if telemetry is not None else None,
    )
    return _plan_and_copy(self, layer, plan_args, in_place, plan_adaptive, plan_adaptive_copy)


def gather_admitted(
    self: DevicePlanner, layer: int, victims: torch.Tensor, codes: torch.Tensor, valid: torch.Tensor
) -> None:
    """Copy the admitted experts (`codes` = R + expert, where `valid`) from the bank into their rows: one
    launch for up to four operands (`gather_rows_multi`)."""
    if self._bank_flat is None:
        return  # every expert resident: nothing is ever a miss
    offset = self.pool.bank.layer_offsets[layer]  # type: ignore[union-attr]
    force = self.fused and not self.clock.is_cuda  # the interpreter runs the gather kernel too
    names = list(self._rows_flat)
    for i in range(0, len(names), MAX_MULTI_OPERANDS):
        group = names[i : i + MAX_MULTI_OPERANDS]
        gather_rows_multi(
            [self._rows_flat[n] for n in group],
            [self._bank_flat[n] for n in group],
            victims,
            codes,
            valid,
            self.num_rows,
            offset,
            force_triton=force,
            chunk_programs=self.gather_chunks,
        )


def _plan_prefix(
    self: DevicePlanner, layer: int, topk_ids: torch.Tensor, E: int, num_pairs: int
) -> tuple[tuple[object, ...], bool]:
    """The plan kernels' arguments up to `min_reads` (ids, tables, pair buffers, sizes; `plan_lru`'s and
    `plan_adaptive`'s common head), and whether the ids are `topk_ids` itself (no temporary copy)."""
    ids = _flat_ids(topk_ids)
    victims, codes, valid = _pair_buffers(self, num_pairs)
    sizes = (layer, E, self.max_experts, self.num_rows, self.block_m, self.min_reads_to_admit)
    return (ids, *_tables(self), victims, codes, valid, *sizes), ids.data_ptr() == topk_ids.data_ptr()


def _plan_and_copy(
    self: DevicePlanner,
    layer: int,
    plan_args: tuple,
    in_place: bool,
    plan: Callable[..., None],
    plan_copy: Callable[..., None],
) -> bool:
    """The plan and the admitted rows' copy: `plan_copy` (the one launch, with the copy arguments after
    `plan_args`), or `plan` then `gather_admitted`. Returns `in_place`."""
    if not self.one_launch:
        plan(*plan_args, num_warps=self._plan_warps)
        gather_admitted(self, layer, *plan_args[7:10])  # victims, codes, valid
        return in_place
    assert self.pool.bank is not None  # the one launch needs a bank (the planner's `can_one`)
    plan_copy(
        *plan_args,
        *self._copy_operands,  # pool rows, bank rows
        self.pool.bank.layer_offsets[layer],
        self._sync32,
        self.copy_programs,
        self.gather_chunks,
        self._cooperative,
        self._pdl,
        self._plan_warps,
        # with a temporary ids the next kernel must not start beside the plan (see `plan`)
        early_trigger=self.overlap and in_place,
    )
    return in_place


def _flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """`topk_ids [T, K]` as the plan kernels read them: `[T*K]` int32 or int64, contiguous (in place if it is)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    return ids.contiguous()


def _pair_buffers(self: DevicePlanner, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first `num_pairs` of the planner's victims, codes and valid workspaces (int32)."""
    return self._victims32[:num_pairs], self._codes32[:num_pairs], self._valid32[:num_pairs]


def _tables(self: DevicePlanner) -> tuple[torch.Tensor, ...]:
    """The plan kernels' table arguments: flat l2p, row owners and stamps, clock, counters, token counts."""
    return (
        self.pool.l2p_gpu.view(-1),
        self.row_owner,
        self.row_stamp,
        self.clock,
        self.counters,
        self._counts32,
    )
