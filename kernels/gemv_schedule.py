"""GEMV decode path: the pair schedule, each program's (pair, location code) from its slot (host pairs first, so
their slow PCIe reads start first; `gemv.py` has the kernels)."""

from __future__ import annotations

import triton
import triton.language as tl

from .ids import expert_or_none
from .pdl import load_acquire, settle_code


@triton.jit
def _slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2: tl.constexpr):
    """(pair, code) of schedule slot `slot`: host pairs first, then pool pairs, each by (expert, pair); pairs
    not routed here (id -1, id >= E or code -1) last with code -1. A permutation of the pairs (a bitonic sort
    of P_POW2 keys in registers, then the slot-th key); P_POW2 = 0: pair `slot` (no sort)."""
    if P_POW2 == 0:  # (no early return: Triton's CUDA code generator refuses one in a branch)
        pair = slot
    else:
        p = tl.arange(0, P_POW2)
        e = expert_or_none(tl.load(ids_ptr + p, mask=p < num_pairs, other=-1), num_experts)
        ok = e >= 0  # masked pairs and ids outside [0, E) are -1
        codes = tl.where(ok, tl.load(l2p_ptr + e, mask=ok, other=-1), -1)
        cls = tl.where(codes >= num_rows, 0, tl.where(codes >= 0, 1, 2))
        key = (cls * (num_experts + 1) + tl.where(cls == 2, 0, e)) * P_POW2 + p
        key = tl.where(p < num_pairs, key, 2147483647)
        pair = tl.sum(tl.where(p == slot, tl.sort(key), 0), axis=0) % P_POW2
    return pair, _pair_code(ids_ptr, l2p_ptr, pair, num_experts)


@triton.jit
def _pair_code(ids_ptr, l2p_ptr, pair, num_experts):
    """The location code of `pair`'s expert (-1: not routed here)."""
    e = expert_or_none(tl.load(ids_ptr + pair), num_experts)
    ok = e >= 0  # expert_or_none: -1 outside [0, E)
    return tl.where(ok, tl.load(l2p_ptr + e, mask=ok, other=-1), -1)


@triton.jit
def _slot_pair_by_id(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    """As `_slot_pair`, for kernels that may run beside the plan (OVERLAP, `plan_copy.py`): an order that does not
    read the location table (it may change meanwhile): pairs with an id in [0, E) by (expert, pair), the rest
    last; the slot's code read once with acquire semantics (`pdl.load_acquire`) and settled (`pdl.settle_code`:
    a host code waits for the kernel before). Returns (pair, code). P_POW2 = 0: pair `slot` (no sort)."""
    if P_POW2 == 0:
        pair = slot
    else:
        p = tl.arange(0, P_POW2)
        e = expert_or_none(tl.load(ids_ptr + p, mask=p < num_pairs, other=-1), num_experts)
        ok = e >= 0  # masked pairs and ids outside [0, E) are -1
        key = tl.where(p < num_pairs, tl.where(ok, e, num_experts) * P_POW2 + p, 2147483647)
        pair = tl.sum(tl.where(p == slot, tl.sort(key), 0), axis=0) % P_POW2
    e_mine = expert_or_none(tl.load(ids_ptr + pair), num_experts)
    ok_mine = e_mine >= 0
    e_mine = tl.where(ok_mine, e_mine, 0)
    code = tl.where(ok_mine, load_acquire(l2p_ptr + e_mine, PDL), -1)
    return pair, settle_code(code, l2p_ptr, e_mine, num_rows, PDL)
