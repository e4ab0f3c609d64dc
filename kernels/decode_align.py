"""Decode-only parts of the pooled MoE GEMMs (`moe_gemm.py`): the align computed inside each program (`inline`,
<= INLINE_MAX_PAIRS routed pairs, `align._align_tiny_kernel`'s register math) and the combine fused into gemm2
(one arrival per routed-here pair at (token, N block); the last arriver sums in k order, as `combine`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .align import AlignOutput, max_blocks_for
from .gemm_args import interpreting
from .ids import expert_or_none
from .pdl import load_acquire, settle_code

INLINE_MAX_PAIRS = 32  # `inline` decode steps (align computed in every gemm program) up to this many pairs


@triton.jit
def _inline_layout(ids_ptr, num_pairs, num_experts, BLOCK_M: tl.constexpr, P_POW2: tl.constexpr):
    """The M-blocks of `align_blocks` from the ids alone (register math over N <= P_POW2 pairs): pair index
    `i`, expert `e`, routed `valid`, rank within its expert, first pair of each expert, the expert's blocks'
    first slot `start` and padded size, and the total of padded slots. Block b holds slots b * BLOCK_M on."""
    i = tl.arange(0, P_POW2)
    e = expert_or_none(tl.load(ids_ptr + i, mask=i < num_pairs, other=-1), num_experts)
    valid = e >= 0  # masked pairs and ids outside [0, E) are -1
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]  # [i, j]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    first = valid & (rank == 0)
    padded = tl.where(first, tl.cdiv(count, BLOCK_M) * BLOCK_M, 0)
    start = tl.sum(tl.where(first[None, :] & (e[None, :] < e[:, None]), padded[None, :], 0), axis=1)
    total = tl.sum(padded, axis=0)
    return i, e, valid, rank, first, padded, start, total


@triton.jit
def _block_pairs(blk, i, valid, rank, start, num_pairs, BLOCK_M: tl.constexpr):
    """`[BLOCK_M]` pairs of block `blk`'s slots (`num_pairs` for padding)."""
    slot = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = ((start + rank)[None, :] == slot[:, None]) & valid[None, :]  # [row, pair]
    return tl.where(
        tl.sum(hit.to(tl.int32), axis=1) > 0, tl.sum(tl.where(hit, i[None, :], 0), axis=1), num_pairs
    )


@triton.jit
def _inline_block(pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows,
                  BLOCK_M: tl.constexpr, P_POW2: tl.constexpr):  # fmt: skip
    """The pid_m-th scheduled M-block of `align_blocks`, computed inside the program for decode widths
    (N <= P_POW2 pairs; `align._align_tiny_kernel`'s register math): (block index, location code, or -1 when
    there is no such block, pairs `[BLOCK_M]` with `num_pairs` for padding). Same blocks, slots, codes and
    host-first order as the align kernels, so act rows of gemm1 and gemm2 meet at the same slots."""
    i, e, valid, rank, first, padded, start, total = _inline_layout(
        ids_ptr, num_pairs, num_experts, BLOCK_M, P_POW2
    )
    code = tl.load(l2p_ptr + e, mask=valid, other=-1)
    pos = i * BLOCK_M  # block b = i
    used = pos < total
    owner = first[None, :] & (start[None, :] <= pos[:, None]) & (pos[:, None] < (start + padded)[None, :])
    bcode = tl.where(used, tl.sum(tl.where(owner, code[None, :], 0), axis=1), -1)
    is_host = used & (bcode >= num_rows)
    is_other = used & (bcode < num_rows)
    num_host = tl.sum(is_host.to(tl.int32), axis=0)
    order_pos = tl.where(
        is_host,
        tl.cumsum(is_host.to(tl.int32), axis=0) - 1,
        num_host + tl.cumsum(is_other.to(tl.int32), axis=0) - 1,
    )
    mine = used & (order_pos == pid_m)
    found = tl.sum(mine.to(tl.int32), axis=0) > 0
    blk = tl.sum(tl.where(mine, i, 0), axis=0)
    blk_code = tl.where(found, tl.sum(tl.where(mine, bcode, 0), axis=0), -1)
    return blk, blk_code, _block_pairs(blk, i, valid, rank, start, num_pairs, BLOCK_M)


@triton.jit
def _inline_block_by_id(pid_m, ids_ptr, l2p_ptr, num_pairs, num_experts, num_rows,
                        BLOCK_M: tl.constexpr, P_POW2: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """As `_inline_block`, for kernels that may run beside the plan (OVERLAP): block pid_m is block pid_m (an
    order that does not read the location table, which may change meanwhile), its expert's code read once with
    acquire semantics (`pdl.load_acquire`) and settled (`pdl.settle_code`: a host code waits for the kernel
    before). Returns (block, code or -1 when there is no such block, pairs `[BLOCK_M]`); the same slots as
    `_inline_block`."""
    i, e, valid, rank, first, padded, start, total = _inline_layout(
        ids_ptr, num_pairs, num_experts, BLOCK_M, P_POW2
    )
    pos = pid_m * BLOCK_M
    found = pos < total
    owner = first & (start <= pos) & (pos < start + padded)  # [pair]: the first pair of the block's expert
    expert = tl.sum(tl.where(owner, e, 0), axis=0)
    code = tl.where(found, load_acquire(l2p_ptr + expert, PDL), -1)
    code = settle_code(code, l2p_ptr, expert, num_rows, PDL)
    return pid_m, code, _block_pairs(pid_m, i, valid, rank, start, num_pairs, BLOCK_M)


@triton.jit
def _aligned_block_by_id(pid_m, sorted_ptr, experts_ptr, num_post_ptr, l2p_ptr, num_rows,
                         BLOCK_M: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """As `_inline_block_by_id`, from `align_blocks` outputs computed before the plan (`AlignOutput.before_plan`:
    their layout reads only the ids; their codes and order are the old table's and are not read): block pid_m
    is block pid_m, its expert (`block_experts`) located once with acquire semantics and settled."""
    found = pid_m * BLOCK_M < tl.load(num_post_ptr)
    expert = tl.load(experts_ptr + pid_m, mask=found, other=-1)
    found = found & (expert >= 0)
    code = tl.where(found, load_acquire(l2p_ptr + tl.maximum(expert, 0), PDL), -1)
    code = settle_code(code, l2p_ptr, expert, num_rows, PDL)
    return pid_m, code, tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))


@triton.jit
def _routed_here(ids_ptr, l2p_ptr, pairs, mask, num_experts):
    """Whether each pair (`pairs` any shape) is routed to an expert located here (id in [0, E), code >= 0)."""
    e = expert_or_none(tl.load(ids_ptr + pairs, mask=mask, other=-1), num_experts)
    ok = e >= 0  # masked pairs and ids outside [0, E) are -1
    return ok & (tl.load(l2p_ptr + e, mask=ok, other=-1) >= 0)


@triton.jit
def _zero_unrouted_tokens(out_ptr, ids_ptr, l2p_ptr, num_tokens, pid_n, H, stride_out, num_experts,
                          TOP_K: tl.constexpr, K_POW2: tl.constexpr, T_POW2: tl.constexpr,
                          BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):  # fmt: skip
    """Fused combine: tokens with no pair routed here get no arrival; write their `out` block (zeros)."""
    t = tl.arange(0, T_POW2)
    k = tl.arange(0, K_POW2)
    m = (t < num_tokens)[:, None] & (k < TOP_K)[None, :]
    need = tl.sum(
        _routed_here(ids_ptr, l2p_ptr, t[:, None] * TOP_K + k[None, :], m, num_experts).to(tl.int32), 1
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    zero = (t < num_tokens) & (need == 0)
    ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(ptrs, tl.zeros((T_POW2, BLOCK_N), dtype=COMPUTE), mask=zero[:, None] & (offs_n < H)[None, :])


@triton.jit
def _arrive_and_combine(y_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr, pair, row_ok, offs_n, n_ok, pid_n,
                        num_nb, num_experts, stride_y, stride_out,
                        TOP_K: tl.constexpr, K_POW2: tl.constexpr, COMPUTE: tl.constexpr):  # fmt: skip
    """Fused combine after a block's y rows are stored: one arrival per row at (token, N block); a row whose
    arrival completes its token's count of routed-here pairs sums `w[t, k] * y[t*K + k]` in k order in fp32
    (as `combine`) into `out` and resets the counter. Rows of one M-block are distinct tokens (one expert)."""
    tok = pair // TOP_K
    k = tl.arange(0, K_POW2)
    km = row_ok[:, None] & (k < TOP_K)[None, :]
    need = tl.sum(
        _routed_here(ids_ptr, l2p_ptr, tok[:, None] * TOP_K + k[None, :], km, num_experts).to(tl.int32), 1
    )
    tl.debug_barrier()  # every thread's y stores happen before the (release) arrivals
    cptr = cnt_ptr + tok * num_nb + pid_n
    arrived = tl.atomic_add(cptr, 1, mask=row_ok, sem="acq_rel", scope="gpu")
    # the acquire is made by the thread owning the row's atomic; the barrier extends it to the threads that
    # load that row's y below (the memory model does not order their loads otherwise)
    tl.debug_barrier()
    last = row_ok & (arrived == need - 1)
    if tl.sum(last.to(tl.int32), axis=0) > 0:
        tl.store(cptr, 0, mask=last)  # ready for the next launch
        acc = tl.zeros((pair.shape[0], offs_n.shape[0]), dtype=tl.float32)
        for kk in tl.static_range(TOP_K):
            pk = tok * TOP_K + kk
            routed = _routed_here(ids_ptr, l2p_ptr, pk, last, num_experts)
            wk = tl.load(tw_ptr + pk, mask=routed, other=0.0).to(tl.float32)
            yk = tl.load(y_ptr + pk.to(tl.int64)[:, None] * stride_y + offs_n[None, :],
                         mask=routed[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)  # fmt: skip
            acc += tl.where(routed[:, None], wk[:, None] * yk, 0.0)
        optrs = out_ptr + tok.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
        tl.store(optrs, acc.to(COMPUTE), mask=last[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class DecodeRouting:
    """What the decode-only options of `gemm1`/`gemm2` read instead of (or beside) the align outputs."""

    topk_ids: torch.Tensor  # [T, K] contiguous
    l2p: torch.Tensor  # [E_max] int32
    num_experts: int
    topk_weights: torch.Tensor | None = None  # [T, K] contiguous (the fused combine)
    # the step's plan + copy may still run beside gemm1 (`DevicePlanner.overlap`, kernels/plan_copy.py): the
    # inline GEMMs then read codes with acquire and wait for it on host codes (OVERLAP in moe_gemm.py)
    after_plan: bool = False

    def p_pow2(self) -> int:
        return max(16, triton.next_power_of_2(self.topk_ids.numel()))


def overlap_mode(align: AlignOutput | None, routing: DecodeRouting | None, use_pdl: bool) -> bool:
    """Whether the GEMMs run in OVERLAP mode (`moe_gemm.py`): the routing says the plan + copy may still be
    running (`after_plan`), the blocks are inline or aligned before the plan (`AlignOutput.before_plan`), and
    PDL launches the GEMMs (or the interpreter tests it). Raises where the blocks were aligned before the plan
    and the mode cannot hold (their codes are the old table's)."""
    overlap = routing is not None and routing.after_plan and (align is None or align.before_plan)
    overlap = overlap and (use_pdl or interpreting())
    if align is not None and align.before_plan and not overlap:
        raise ValueError(
            "blocks aligned before the plan (their codes are the old table's) need the OVERLAP mode: decode "
            f"routing with after_plan (routing given: {routing is not None}) and PDL (use_pdl={use_pdl})"
        )
    return overlap


def _inline_args(align: AlignOutput | None, routing: DecodeRouting | None, num_pairs: int, num_experts_max: int,
                 block_m: int) -> tuple[list[torch.Tensor], int]:  # fmt: skip
    """(sorted, codes, order, num_post tensors or stand-ins, max_blocks) for the gemm kernels."""
    if align is not None:  # before the plan, the codes' place holds the block experts (OVERLAP locates them)
        return [
            align.sorted_pairs,
            align.block_experts if align.before_plan else align.block_codes,
            align.block_order,
            align.num_post_padded,
        ], align.max_blocks
    if routing is None:
        raise ValueError("gemm: give the align outputs or the decode routing (inline align)")
    if num_pairs > INLINE_MAX_PAIRS:
        raise ValueError(f"inline align: {num_pairs} pairs > INLINE_MAX_PAIRS={INLINE_MAX_PAIRS}")
    ids = routing.topk_ids
    return [ids, ids, ids, ids], max_blocks_for(num_pairs, num_experts_max, block_m)
