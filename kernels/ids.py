"""Routed expert ids as the GEMM kernels read them: `topk_ids` may be int32 or int64, -1 pads, and an id outside
[0, E) is not routed here. The range is checked at the width the ids were loaded with, before the cast to int32
that indexes `l2p`: an int64 id of 2^32 + e must not become expert e."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_or_none(raw, num_experts):
    """`raw` ids (any shape, int32 or int64, as loaded) as int32 experts, -1 where outside [0, num_experts)."""
    return tl.where((raw >= 0) & (raw < num_experts), raw, -1).to(tl.int32)
