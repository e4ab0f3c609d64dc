"""Router-score membership of one planned step in one launch: the `RouterAdaptivePolicy` statistic
(`pooled_runner/policy_router.py`, "Membership") added to a layer's `member` counters.

For each token whose routed ids are not all padding and whose scores hold no NaN: `d = score - the token's
k-th largest score` (float64: exact for scores of similar magnitude, and rounded the same way in every form
else; k = min(top-k, E)), and each expert gets
`clamp(floor(d * scale) + RAMP / 2, 0, RAMP) * unit` (inf - inf adds 0). The torch form
(`membership_units`) is about twenty small kernels (a float64 top-k among them); this is one program per token:
the k-th largest by counting (the smallest score with fewer than k scores above it, compared in blocks), the
ramp, and integer atomics into `member` (exact in any order).

Shapes: `scores [T, >= E]` floating, unit stride along experts (columns past E are ignored); `ids [T, K]`
integer (the step's routed ids: a token votes when one of them is in [0, E)); `member [>= E]` int64 (the
layer's slice, added to in place), or `[C, >= E]` with unit stride along the experts (C copies that each get
the same units: the duel policy's two memberships); `scale [1]` float64 (RAMP / width: a tensor so the product stays float64).
T = 0 launches nothing. The torch reference with the same signature is `add_membership_reference`.
"""

from __future__ import annotations

import math

import torch

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

RAMP = 64  # ramp steps of a token `width / 2` or more above its k-th score (`policy_router.py`)
RANK_BLOCK = 16  # scores compared per pass of the k-th-largest count


def _check(
    scores: torch.Tensor,
    ids: torch.Tensor,
    member: torch.Tensor,
    num_experts: int,
    scale: torch.Tensor,
    unit: int,
) -> None:
    if (
        scores.dim() != 2
        or not scores.is_floating_point()
        or scores.shape[1] < num_experts
        or num_experts < 1
    ):
        raise ValueError(
            f"scores: shape {tuple(scores.shape)} dtype {scores.dtype}; expected [T, >= {num_experts}] floating"
        )
    if scores.shape[0] > 0 and scores.stride(1) != 1:
        raise ValueError(f"scores: stride {scores.stride()}; expected unit stride along the experts")
    if ids.dim() != 2 or ids.shape[0] != scores.shape[0] or ids.shape[1] < 1 or ids.dtype.is_floating_point:
        raise ValueError(
            f"ids: shape {tuple(ids.shape)} dtype {ids.dtype}; expected [{scores.shape[0]}, K >= 1] integer"
        )
    if (
        member.dim() not in (1, 2)
        or member.dtype != torch.int64
        or member.shape[-1] < num_experts
        or member.stride(-1) != 1
        or member.shape[0] < 1
    ):
        raise ValueError(
            f"member: shape {tuple(member.shape)} stride {member.stride()} dtype {member.dtype}; expected "
            f"[>= {num_experts}] or [C >= 1, >= {num_experts}] int64, unit stride along the experts"
        )
    if scale.shape != (1,) or scale.dtype != torch.float64 or unit < 1:
        raise ValueError(
            f"scale: shape {tuple(scale.shape)} dtype {scale.dtype}, unit={unit}; expected [1] float64, unit >= 1"
        )
    devices = {t.device for t in (scores, ids, member, scale)}
    if len(devices) != 1:
        raise ValueError(
            f"scores, ids, member and scale must share a device, got {sorted(map(str, devices))}"
        )


def add_membership(
    scores: torch.Tensor,
    ids: torch.Tensor,
    member: torch.Tensor,
    num_experts: int,
    scale: torch.Tensor,
    unit: int,
) -> None:
    """`member[..., :E] += membership units x unit` of the step (see module docstring; a 2-D `member` gets them
    in every row). One launch of T programs, graph-safe; ValueError for bad shapes."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("add_membership needs Triton")
    _check(scores, ids, member, num_experts, scale, unit)
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    copies = member.shape[0] if member.dim() == 2 else 1
    _membership_kernel[(num_tokens,)](
        scores, scores.stride(0), ids, ids.stride(0), top_k, member, member.stride(0) if copies > 1 else 0,
        scale, num_experts, min(top_k, num_experts), unit, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_J=RANK_BLOCK, RAMP_STEPS=RAMP, NUM_COPIES=copies,
        num_warps=4,
    )  # fmt: skip


def add_membership_reference(
    scores: torch.Tensor,
    ids: torch.Tensor,
    member: torch.Tensor,
    num_experts: int,
    scale: torch.Tensor,
    unit: int,
) -> None:
    """`add_membership` in torch ops (a float64 top-k)."""
    _check(scores, ids, member, num_experts, scale, unit)
    valid = ((ids >= 0) & (ids < num_experts)).any(1)  # [T]
    units = ramp_units(scores[:, :num_experts], valid, ids.shape[1], float(scale.item()))
    member[..., :num_experts] += units * unit


def ramp_units(scores: torch.Tensor, valid: torch.Tensor, top_k: int, scale: float) -> torch.Tensor:
    """`scores [T, E]` floating, `valid [T]` bool -> `[E]` int64 ramp steps summed over the voting tokens (valid,
    no NaN score), in torch ops. T = 0 gives zeros."""
    num_tokens, num_experts = scores.shape
    k = min(top_k, num_experts)
    if num_tokens == 0 or k < 1:
        return torch.zeros(num_experts, dtype=torch.int64, device=scores.device)
    s = scores.to(
        torch.float64
    )  # every fp32/bf16/fp16 value is a float64; differences round as in the kernel
    votes = valid & ~torch.isnan(s).any(1)  # [T] a token with a NaN score has no k-th score to speak of
    s = torch.nan_to_num(s, nan=0.0, posinf=math.inf, neginf=-math.inf)
    kth = torch.topk(s, k, dim=1).values[:, k - 1 : k]  # [T, 1]
    inc = torch.floor((s - kth) * scale) + RAMP // 2  # [T, E]
    inc = torch.nan_to_num(inc.clamp(0, RAMP), nan=0.0)  # inf - inf: 0
    inc = torch.where(votes[:, None], inc, 0.0)
    return inc.sum(0).to(torch.int64)  # integers below 2**53: the sum is exact in any order


if triton is not None:
    _INF = tl.constexpr(float("inf"))

    @triton.jit
    def _membership_kernel(
        scores_ptr, stride_t, ids_ptr, stride_ids, top_k, member_ptr, stride_copy, scale_ptr, E, k, unit,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr, RAMP_STEPS: tl.constexpr,
        NUM_COPIES: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e_offs = tl.arange(0, BLOCK_E)
        e_in = e_offs < E
        k_offs = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + t * stride_ids + k_offs, mask=k_offs < top_k, other=-1).to(tl.int64)
        routed = tl.sum(((ids >= 0) & (ids < E)).to(tl.int32), 0) > 0
        s = tl.load(scores_ptr + t * stride_t + e_offs, mask=e_in, other=0.0).to(tl.float64)
        clean = tl.sum((e_in & (s != s)).to(tl.int32), 0) == 0  # no NaN score
        # k-th largest: the smallest score with fewer than k scores above it
        above = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j_start in range(0, E, BLOCK_J):
            j_offs = j_start + tl.arange(0, BLOCK_J)
            j_in = j_offs < E
            s_j = tl.load(scores_ptr + t * stride_t + j_offs, mask=j_in, other=0.0).to(tl.float64)
            above += tl.sum(((s_j[None, :] > s[:, None]) & j_in[None, :]).to(tl.int32), 1)
        kth = tl.min(tl.where(e_in & (above < k), s, _INF), 0)
        d = (s - kth) * tl.load(scale_ptr)
        ramp = tl.floor(d) + RAMP_STEPS // 2
        ramp = tl.minimum(tl.maximum(ramp, 0.0), RAMP_STEPS * 1.0)
        votes = e_in & routed & clean & (d == d)  # inf - inf: NaN, adds nothing
        units = tl.where(votes, ramp, 0.0).to(tl.int64) * unit
        for c in tl.static_range(NUM_COPIES):
            tl.atomic_add(member_ptr + c * stride_copy + e_offs, units, mask=votes & (units > 0))
