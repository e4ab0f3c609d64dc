"""Plain torch reference of `align.align_blocks` (the tests' oracle)."""

from __future__ import annotations

import torch

from .align import AlignOutput, _check_align_inputs, max_blocks_for


def align_blocks_ref(
    topk_ids: torch.Tensor, l2p: torch.Tensor, num_experts: int, num_rows: int, block_m: int
) -> AlignOutput:
    """Plain torch reference of `align_blocks` (same signature, same outputs; host syncs allowed)."""
    _check_align_inputs(topk_ids, l2p, num_experts, block_m)
    ids = topk_ids.reshape(-1).long().cpu()
    num_pairs = ids.numel()
    max_blocks = max_blocks_for(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32)
    block_experts = torch.full((max_blocks,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        pairs = (ids == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        sorted_pairs[pos : pos + pairs.numel()] = pairs.int()
        n_blocks = -(-pairs.numel() // block_m)
        block_experts[pos // block_m : pos // block_m + n_blocks] = e
        pos += n_blocks * block_m
    l2p_cpu = l2p.cpu()
    block_codes = torch.where(block_experts >= 0, l2p_cpu[block_experts.clamp(min=0).long()], -1).int()
    used = block_experts >= 0
    host = (used & (block_codes >= num_rows)).nonzero().flatten()
    other = (used & (block_codes < num_rows)).nonzero().flatten()
    block_order = torch.full((max_blocks,), -1, dtype=torch.int32)
    order = torch.cat([host, other]).int()
    block_order[: order.numel()] = order
    dev = topk_ids.device
    return AlignOutput(
        sorted_pairs.to(dev),
        block_experts.to(dev),
        block_codes.to(dev),
        block_order.to(dev),
        torch.tensor([pos], dtype=torch.int32, device=dev),
        block_m,
    )
