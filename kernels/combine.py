"""Weighted combine: `out[t] = sum_k w[t, k] * y[t*K + k]`, fp32 in k order, pairs with id -1 or location
code -1 (not routed here) add exactly 0 (their `y` rows may hold anything). Every element of `out` is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ids import expert_or_none


@triton.jit
def _combine_kernel(
    y_ptr, ids_ptr, w_ptr, l2p_ptr, out_ptr, H, num_experts, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(TOP_K):
        pair = t * TOP_K + k
        e = expert_or_none(tl.load(ids_ptr + pair), num_experts)
        routed = e >= 0  # expert_or_none: -1 outside [0, E)
        code = tl.load(l2p_ptr + e, mask=routed, other=-1)
        routed = routed & (code >= 0)
        wk = tl.load(w_ptr + pair).to(tl.float32)
        y = tl.load(y_ptr + pair * stride_y + offs, mask=h_ok & routed, other=0.0).to(tl.float32)
        acc += tl.where(routed, wk * y, 0.0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _check(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, l2p: torch.Tensor) -> None:
    T, K = topk_ids.shape
    if topk_weights.shape != (T, K) or not topk_weights.is_contiguous() or not topk_ids.is_contiguous():
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)}: expected one "
            "contiguous [T, K] shape"
        )
    if y.dim() != 2 or y.shape[0] < T * K or y.stride(1) != 1:
        raise ValueError(
            f"y: shape {tuple(y.shape)} strides {y.stride()}, expected [>= {T * K}, H] row-major"
        )
    if l2p.dtype != torch.int32 or l2p.dim() != 1:
        raise ValueError(f"l2p: shape {tuple(l2p.shape)} dtype {l2p.dtype}, expected [E_max] int32")


def combine(
    y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, l2p: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """`y [>= T*K, H]` per-pair outputs, ids/weights `[T, K]`, `l2p [E_max]` -> `[T, H]` in y's dtype."""
    _check(y, topk_ids, topk_weights, l2p)
    T, K = topk_ids.shape
    H = y.shape[1]
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](
        y,
        topk_ids,
        topk_weights,
        l2p,
        out,
        H,
        num_experts,
        y.stride(0),
        out.stride(0),
        TOP_K=K,
        BLOCK_H=block_h,
    )
    return out


def combine_ref(
    y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, l2p: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Torch reference of `combine` (same signature)."""
    _check(y, topk_ids, topk_weights, l2p)
    T, K = topk_ids.shape
    ids = topk_ids.long()
    routed = (ids >= 0) & (ids < num_experts)
    routed &= l2p[ids.clamp(0, num_experts - 1)] >= 0
    acc = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
    ys = y[: T * K].reshape(T, K, -1).float()
    for k in range(K):
        term = topk_weights[:, k, None].float() * ys[:, k]
        acc += torch.where(routed[:, k, None], term, torch.zeros_like(term))
    return acc.to(y.dtype)
