"""Checks of the routing inputs of a pooled forward (shapes, dtypes, devices, expert id values)."""

from __future__ import annotations

import torch


def check_routing(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    H: int,
    dtype: torch.dtype,
    num_experts: int,
    check_values: bool = True,
) -> None:
    """ValueError naming the first problem with a pooled forward's inputs: `hidden [T, H]` in `dtype`,
    `topk_ids [T, K]` int32/int64 in [-1, num_experts) (values only when `check_values`: reading them syncs),
    `topk_weights [T, K]` floating, all on one device."""
    if hidden.dim() != 2 or hidden.shape[1] != H:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}, expected [T, {H}]")
    if hidden.dtype != dtype:
        raise ValueError(f"hidden has dtype {hidden.dtype}, expected {dtype}")
    T = hidden.shape[0]
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != hidden.device:
            raise ValueError(
                f"{name} is on {t.device} but hidden is on {hidden.device}; put them on one device"
            )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected [{T}, K]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids has dtype {topk_ids.dtype}, expected torch.int32 or torch.int64")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_ids.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights has dtype {topk_weights.dtype}, expected a floating dtype")
    if check_values and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_ids values in [{lo}, {hi}], expected -1 (padding) or [0, {num_experts})")


def check_router_scores(
    router_scores: torch.Tensor, num_tokens: int, num_experts: int, device: torch.device
) -> None:
    """ValueError unless `router_scores` is `[num_tokens, >= num_experts]`, floating, on `device` (the
    planner's and its host twin's check of the scores a policy may read)."""
    if (
        router_scores.dim() != 2
        or router_scores.shape[0] != num_tokens
        or router_scores.shape[1] < num_experts
    ):
        raise ValueError(
            f"router_scores has shape {tuple(router_scores.shape)}; expected [T={num_tokens}, >= {num_experts}] "
            "(one score per expert of the layer for each token of topk_ids)"
        )
    if not router_scores.is_floating_point() or router_scores.device != device:
        raise ValueError(
            f"router_scores is {router_scores.dtype} on {router_scores.device}; expected a floating dtype on {device}"
        )
