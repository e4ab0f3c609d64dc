"""Locate: logical expert ids -> location codes through one layer's `l2p` table (a gather; -1 stays -1).

`align_blocks` already fuses this gather into its block-table pass; this standalone kernel serves callers that
hold per-block (or per-pair) logical ids from elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _locate_kernel(experts_ptr, l2p_ptr, codes_ptr, n, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    expert = tl.load(experts_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (expert >= 0) & (expert < num_experts)
    code = tl.load(l2p_ptr + expert, mask=valid, other=-1)
    tl.store(codes_ptr + offs, code, mask=in_range)


def _check(experts: torch.Tensor, l2p: torch.Tensor, num_experts: int) -> None:
    if experts.dtype != torch.int32 or not experts.is_contiguous():
        raise ValueError(
            f"experts: dtype {experts.dtype}, strides {experts.stride()}; expected contiguous int32"
        )
    if l2p.dim() != 1 or l2p.dtype != torch.int32 or l2p.shape[0] < num_experts:
        raise ValueError(
            f"l2p: shape {tuple(l2p.shape)} dtype {l2p.dtype}; expected [>= {num_experts}] int32"
        )
    if experts.device != l2p.device:
        raise ValueError(f"experts on {experts.device}, l2p on {l2p.device}: expected one device")


def locate(experts: torch.Tensor, l2p: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`codes[i] = l2p[experts[i]]` for `0 <= experts[i] < num_experts`, else -1. Any shape, int32."""
    _check(experts, l2p, num_experts)
    codes = torch.empty_like(experts)
    n = experts.numel()
    if n:
        _locate_kernel[(triton.cdiv(n, BLOCK),)](experts, l2p, codes, n, num_experts, BLOCK=BLOCK)
    return codes


def locate_ref(experts: torch.Tensor, l2p: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Torch reference of `locate`."""
    _check(experts, l2p, num_experts)
    valid = (experts >= 0) & (experts < num_experts)
    return torch.where(valid, l2p[experts.clamp(0, num_experts - 1).long()], -1).to(torch.int32)
