"""The plain torch path of the pooled experts (CPU serving, and the reference the kernels are tested against).

Batch-invariant: a token's output does not depend on which other tokens share its step, because every dot
product is one fp32 reduction over the same elements in the same order (a dense GEMM's blocking depends on M
and would change the last bits). So a pool holding every expert and one holding only top_k rows give
bit-identical outputs, and so does a per-token dense loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pooled_runner.formats.base import WeightFormat
    from pooled_runner.pool import ExpertPool
    from pooled_runner.staging import LayerStager

# Elements of the largest temporary product in `batch_invariant_linear` (bounds its memory).
_MAX_PRODUCT_NUMEL = 1 << 22


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ weight[N, K].T -> [M, N]` in fp32, each output one fp32 sum over K, independent of M."""
    x32, w32 = x.float(), weight.float()
    M, N = x32.shape[0], w32.shape[0]
    out = torch.empty((M, N), dtype=torch.float32, device=x.device)
    rows_per_chunk = max(1, _MAX_PRODUCT_NUMEL // max(1, N * w32.shape[1]))
    for start in range(0, M, rows_per_chunk):
        chunk = x32[start : start + rows_per_chunk]
        out[start : start + chunk.shape[0]] = (chunk[:, None, :] * w32[None, :, :]).sum(-1)
    return out


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU-gated MLP: `x [M, H]`, `w13 [2I, H]` (gate rows then up rows), `w2 [H, I]` -> [M, H].

    fp32 accumulation; the gate/up output and the activation are rounded to x's dtype, as a GEMM storing
    its output in that dtype would.
    """
    intermediate = w13.shape[0] // 2
    gate_up = batch_invariant_linear(x, w13).to(x.dtype)
    gate, up = gate_up[:, :intermediate].float(), gate_up[:, intermediate:].float()
    act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return batch_invariant_linear(act, w2).to(x.dtype)


def combine(expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`expert_out [T, K, H]`, ids/weights `[T, K]` -> `[T, H]`: fp32 sum over k in order; padding adds 0."""
    T, K, H = expert_out.shape
    acc = torch.zeros((T, H), dtype=torch.float32, device=expert_out.device)
    for k in range(K):
        routed = (topk_ids[:, k] >= 0)[:, None]  # [T, 1]
        term = topk_weights[:, k, None].float() * expert_out[:, k].float()  # [T, H]
        acc += torch.where(routed, term, torch.zeros_like(term))
    return acc.to(expert_out.dtype)


def torch_forward(
    pool: ExpertPool,
    fmt: WeightFormat,
    layer: int,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    staged: LayerStager | None,
    admit_misses: bool,
) -> torch.Tensor:
    """`PooledMoE.forward` off the kernel path: plan on the host (`ExpertPool.plan_step`), then each routed
    expert's MLP from its row, its host row, or (staged steps) its staging slot; `[T, H]` as `combine`."""
    T, K = topk_ids.shape
    expert_out = torch.zeros((T, K, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)  # [T, K, H]
    ids = topk_ids.long()  # [T, K]
    experts = torch.unique(ids[ids >= 0]).tolist()
    codes = pool.plan_step(layer, experts, admit_misses=admit_misses, staged=staged is not None)
    if staged is not None:  # resident experts from their rows, then chunk by chunk from the ring
        for p in staged.layer_passes(layer, experts, with_tables=False):
            for expert, slot in p.slots.items():
                rows = (
                    pool.weights_at(layer, slot)
                    if p.rows is None
                    else {n: t[slot] for n, t in p.rows.items()}
                )
                _expert_out(expert_out, hidden, ids, expert, fmt.expert_weights(rows))
    else:
        for expert, code in zip(experts, codes):
            _expert_out(expert_out, hidden, ids, expert, fmt.expert_weights(pool.weights_at(layer, code)))
    return combine(expert_out, topk_ids, topk_weights)


def _expert_out(
    expert_out: torch.Tensor,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    expert: int,
    weights: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Fill `expert_out [T, K, H]` at the (token, slot) pairs routed to `expert`; weights = (w13, w2) dense."""
    token_idx, slot_idx = (ids == expert).nonzero(as_tuple=True)
    w13, w2 = weights
    x = hidden[token_idx]
    expert_out[token_idx, slot_idx] = expert_mlp(x, w13.to(x.device), w2.to(x.device))
