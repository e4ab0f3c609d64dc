"""Torch references of the pooled MoE forward (`fused_moe.py`), with the kernels' signatures: per-stage
(`gemm1_ref`, `gemm2_ref`) and whole (`pooled_fused_moe_ref`), on the formats' reference dequant (`dense_row`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .dequant import FMT_DENSE, FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4
from .operands import KernelFormat, Projection

if TYPE_CHECKING:
    from .align import AlignOutput
    from .gemm_parts import GemmConfig
    from .gemv import GemvConfig


def dense_row(proj: Projection, fmt: KernelFormat, code: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense `[N, K]` weight at location `code` (pool row or host row), by the formats' reference dequant."""
    from pooled_runner.formats import quant

    src = proj.pool if code < proj.num_rows else proj.bank
    r = code if code < proj.num_rows else code - proj.num_rows
    w, s, z, g = (t[r].cpu() if t is not None else None for t in src)
    assert w is not None
    if fmt.fmt == FMT_DENSE:
        return w.to(dtype)
    assert s is not None
    if fmt.fmt == FMT_INT4:
        return quant.dequantize_int4(w, s, z, dtype)
    if fmt.fmt in (FMT_FP8_CHANNEL, FMT_FP8_BLOCK):
        return quant.dequantize_fp8(w, s, fmt.group if fmt.fmt == FMT_FP8_BLOCK else None, dtype)
    assert g is not None
    return quant.dequantize_nvfp4(w, s, g, dtype)


def gemm1_ref(
    x: torch.Tensor, align: AlignOutput, w13: Projection, fmt: KernelFormat, top_k: int, config: GemmConfig
) -> torch.Tensor:
    """Reference of `gemm1`: only the slots of routed pairs are defined (others 0)."""
    from pooled_runner.torch_path import batch_invariant_linear

    I = w13.weight.shape[1] // 2
    act = torch.zeros((align.max_blocks * align.block_m, I), dtype=x.dtype)
    sorted_pairs, codes = align.sorted_pairs.cpu(), align.block_codes.cpu()
    xc = x.cpu()
    for b in range(int(align.num_post_padded.item()) // align.block_m):
        code = int(codes[b])
        slots = torch.arange(b * align.block_m, (b + 1) * align.block_m)
        pairs = sorted_pairs[slots]
        keep = pairs < xc.shape[0] * top_k
        if code < 0 or not keep.any():
            continue
        w = dense_row(w13, fmt, code, x.dtype)
        gate_up = batch_invariant_linear(xc[pairs[keep].long() // top_k], w).to(x.dtype)
        gate, up = gate_up[:, :I].float(), gate_up[:, I:].float()
        act[slots[keep]] = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return act.to(x.device)


def gemm2_ref(
    act: torch.Tensor,
    align: AlignOutput,
    w2: Projection,
    fmt: KernelFormat,
    num_pairs: int,
    config: GemmConfig,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `gemm2` (align path): rows of pairs not computed are 0, or, with `y` given, left as they
    are in `y` (computed rows written into it, as `gemm2(..., y=y)` does)."""
    from pooled_runner.torch_path import batch_invariant_linear

    H = w2.weight.shape[1]
    out = y
    y = torch.zeros((max(num_pairs, 1), H), dtype=act.dtype) if out is None else out.cpu().clone()
    sorted_pairs, codes, ac = align.sorted_pairs.cpu(), align.block_codes.cpu(), act.cpu()
    for b in range(int(align.num_post_padded.item()) // align.block_m):
        code = int(codes[b])
        slots = torch.arange(b * align.block_m, (b + 1) * align.block_m)
        pairs = sorted_pairs[slots]
        keep = pairs < num_pairs
        if code < 0 or not keep.any():
            continue
        w = dense_row(w2, fmt, code, act.dtype)
        y[pairs[keep].long()] = batch_invariant_linear(ac[slots[keep]], w).to(act.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y.to(act.device)


def pooled_fused_moe_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    decode: bool | None = None,
    variant: str | None = None,
    gemv_config: GemvConfig | None = None,
    after_plan: bool = False,
    long_plan: bool = False,
    aligned: AlignOutput | None = None,
) -> torch.Tensor:
    """Reference of `pooled_fused_moe`: per distinct expert, the torch path's `expert_mlp` and `combine`."""
    from pooled_runner.torch_path import combine as torch_combine
    from pooled_runner.torch_path import expert_mlp

    T, K = topk_ids.shape
    H = hidden.shape[1]
    ids = topk_ids.long().cpu()
    l2p_cpu = l2p.cpu()
    x = hidden.cpu()
    expert_out = torch.zeros((T, K, H), dtype=hidden.dtype)
    for e in torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist():
        code = int(l2p_cpu[e])
        if code < 0:
            continue
        t_idx, k_idx = (ids == e).nonzero(as_tuple=True)
        expert_out[t_idx, k_idx] = expert_mlp(
            x[t_idx], dense_row(w13, fmt, code, hidden.dtype), dense_row(w2, fmt, code, hidden.dtype)
        )
    routed = ids.clone()
    not_here = (ids >= 0) & (ids < num_experts)
    not_here &= l2p_cpu[ids.clamp(0, num_experts - 1)] < 0
    routed[not_here] = -1
    return torch_combine(expert_out, routed, topk_weights.cpu()).to(hidden.device)
