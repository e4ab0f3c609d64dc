"""GEMV decode path, torch references with the launchers' signatures (`gemv.py`)."""

from __future__ import annotations

import torch

from .gemv import GemvConfig, gemv_configs
from .operands import KernelFormat, Projection


def _dense_f32(proj: Projection, fmt: KernelFormat, code: int) -> torch.Tensor:
    """The `[N, K]` weight at location `code` dequantized in fp32 (not rounded to the compute dtype)."""
    from .fused_moe import dense_row

    return dense_row(proj, fmt, code, torch.float32)


def _pair_codes(topk_ids: torch.Tensor, l2p: torch.Tensor, num_experts: int) -> list[int]:
    ids = topk_ids.reshape(-1).long().cpu()
    l2p_cpu = l2p.cpu()
    return [int(l2p_cpu[e]) if 0 <= e < num_experts else -1 for e in ids.tolist()]


def gemv_gate_up_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    fmt: KernelFormat,
    config: GemvConfig,
) -> torch.Tensor:
    """Reference of `gemv_gate_up` (rows of pairs not routed here are 0)."""
    T, K = topk_ids.shape
    I = w13.weight.shape[1] // 2
    act = torch.zeros((max(T * K, 1), I), dtype=hidden.dtype)
    x = hidden.cpu()
    for pair, code in enumerate(_pair_codes(topk_ids, l2p, num_experts)):
        if code < 0:
            continue
        gu = (x[pair // K].float() @ _dense_f32(w13, fmt, code).T).to(hidden.dtype).float()
        act[pair] = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(hidden.dtype)
    return act.to(hidden.device)


def gemv_down_combine_ref(
    act: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w2: Projection,
    fmt: KernelFormat,
    config: GemvConfig,
) -> torch.Tensor:
    """Reference of `gemv_down_combine`."""
    T, K = topk_ids.shape
    H = w2.weight.shape[1]
    acc = torch.zeros((T, H), dtype=torch.float32)
    a, w = act.cpu(), topk_weights.cpu().float()
    for pair, code in enumerate(_pair_codes(topk_ids, l2p, num_experts)):
        if code < 0:
            continue
        y = (a[pair].float() @ _dense_f32(w2, fmt, code).T).to(act.dtype).float()
        acc[pair // K] += w[pair // K, pair % K] * y
    return acc.to(act.dtype).to(act.device)


def gemv_moe_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Reference of `gemv_moe`."""
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    cfg = config or gemv_configs(H, I, fmt.fmt, topk_ids.numel(), fmt.group)
    act = gemv_gate_up_ref(hidden, topk_ids, l2p, num_experts, w13, fmt, cfg)
    return gemv_down_combine_ref(act, topk_ids, topk_weights, l2p, num_experts, w2, fmt, cfg)
