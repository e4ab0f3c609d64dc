"""A stand-in for stock SGLang 0.5.23's CUDA `moe_align_block_size` (sgl_kernel), which the GPU image lacks.

Stock runs the CUDA align kernel wherever its single-launch Triton align does not apply: more than 64 (token,
expert) pairs, or at most 64 buckets (E + 1 <= 64, e.g. Mixtral's 8 experts). This is its output in plain torch
(sorts and a `repeat_interleave`: a host sync, so it is not graph-capturable): `bench/stock_compare.py` computes it
once per routing, outside the timed graph, so those rows time stock without its align launch (a lower bound).

Semantics (`moe_align_block_size(topk_ids, block, E)`, the "+1 offset" convention with padded sorted ids):
bucket = expert id + 1 (an id of -1, filtered by expert parallelism, is bucket 0); every bucket's pairs are padded
to a multiple of `block`, buckets laid out in order; `sorted_ids[p]` is a pair index (token * top_k + slot) or
`numel` for padding, every entry written; `expert_ids[b]` is block b's bucket - 1, for the blocks below
`num_post`; `num_post` [1] int32 the padded total. Pairs keep their index order within a bucket (stock's CUDA
kernel orders them by its atomics; no consumer depends on the order: each pair writes its own output row).
"""

from __future__ import annotations

import torch


def max_padded_tokens(numel: int, num_experts: int, block: int) -> int:
    """Stock's sorted-ids buffer length (`moe_align_block_size`): an upper bound on the padded total."""
    size = numel * block if numel < num_experts + 1 else numel + (num_experts + 1) * (block - 1)
    return (size + 3) // 4 * 4


def align_stand_in(
    topk_ids: torch.Tensor, block: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, expert_ids [cdiv(max_padded, block)] int32, num_post [1] int32) of
    `topk_ids [M, K]` (int32, ids in -1..num_experts-1) for M-blocks of `block`, on topk_ids' device (module
    docstring). Expert ids of the blocks at and past `num_post` are -1 (never read)."""
    assert topk_ids.dtype == torch.int32 and topk_ids.dim() == 2, (topk_ids.dtype, topk_ids.shape)
    assert block >= 1 and num_experts >= 1, (block, num_experts)
    device, numel = topk_ids.device, topk_ids.numel()
    bucket = topk_ids.reshape(-1).long() + 1  # [P]
    assert numel == 0 or (int(bucket.min()) >= 0 and int(bucket.max()) <= num_experts), (
        f"expert ids outside -1..{num_experts - 1}"
    )
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block - 1) // block * block  # [E + 1]
    starts = torch.cumsum(padded, 0) - padded  # where each bucket's blocks begin
    first = torch.cumsum(counts, 0) - counts  # each bucket's first pair in sorted order
    order = torch.sort(bucket, stable=True).indices  # pair indices by bucket, index order within one
    in_bucket = torch.arange(numel, device=device) - first[bucket[order]]
    size = max_padded_tokens(numel, num_experts, block)
    sorted_ids = torch.full((size,), numel, dtype=torch.int32, device=device)
    sorted_ids[starts[bucket[order]] + in_bucket] = order.int()
    expert_ids = torch.full(((size + block - 1) // block,), -1, dtype=torch.int32, device=device)
    block_experts = torch.repeat_interleave(torch.arange(-1, num_experts, device=device), padded // block)
    expert_ids[: block_experts.numel()] = block_experts.int()
    num_post = padded.sum().reshape(1).int()
    return sorted_ids, expert_ids, num_post
