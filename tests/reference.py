"""Independent dense references for tests: no pool, no grouping, weights by logical expert id."""

from __future__ import annotations

import torch


def reference_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP of one token `x [H]`: fp32 dot products, gate/up and activation rounded to x's dtype."""
    inter = w13.shape[0] // 2
    gate_up = (w13.float() * x.float()[None, :]).sum(-1).to(x.dtype)  # [2I]
    act = (torch.nn.functional.silu(gate_up[:inter].float()) * gate_up[inter:].float()).to(x.dtype)  # [I]
    return (w2.float() * act.float()[None, :]).sum(-1).to(x.dtype)  # [H]


def random_expert_weights(
    num_layers: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(num_layers):
        for expert in range(num_experts):
            w13 = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
            w2 = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype)
            out[(layer, expert)] = {"w13": w13, "w2": w2}
    return out


def dense_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: dict[int, dict[str, torch.Tensor]],
) -> torch.Tensor:
    """Per-token loop over its K experts; fp32 sum in k order; padding (-1) skipped."""
    T, H = hidden.shape
    out = torch.empty((T, H), dtype=hidden.dtype)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            y = reference_mlp(hidden[t], weights[e]["w13"], weights[e]["w2"])
            acc += topk_weights[t, k].float() * y.float()
        out[t] = acc.to(hidden.dtype)
    return out


def random_routing(T: int, K: int, E: int, g: torch.Generator, pad_prob: float = 0.15):
    """Distinct ids per token (as a router gives) with some padding -1, and random positive weights."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.long().reshape(T, K)
    pad = torch.rand(T, K, generator=g) < pad_prob
    ids[pad] = -1
    weights = torch.rand(T, K, generator=g) + 0.05
    return ids, weights
