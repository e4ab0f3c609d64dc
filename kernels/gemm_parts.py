"""Shared parts of the pooled MoE GEMMs (`moe_gemm.py`, `decode.py`, the GEMV tiles): the tile config, the MMA
step, the grouped program order and the operands' row bases (pool row or host row, int64 offsets)."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # swapped operands: each program computes `acc^T [block_n, block_m] = W_tile [block_n, block_k] @ x^T`, so
    # the (dequantized) weight tile is the left operand, which the MMA can take from registers, and only the
    # few token rows pass through shared memory (decode tiles; same values, fp32 sums in another order)
    swap_ab: bool = False


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc += a @ b. DOT_F32: in fp32 (the interpreter's bf16 dot is wrong; bf16 products are exact in fp32)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _block_of(pid, num_pid_n, max_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering (GROUP_M M-blocks share their N sweep, for L2 reuse of a block's B)."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _row_bases(
    code,
    num_rows,
    wp,
    sp,
    zp,
    gp,
    wb,
    sb,
    zb,
    gb,
    w_se,
    s_se,
    z_se,
    g_se,
):
    """Base pointers of one expert's operands: pool row `code` or host row `code - R`; int64 row offsets."""
    if code >= num_rows:
        r = (code - num_rows).to(tl.int64)
        w_base = wb + r * w_se
        s_base = sb + r * s_se
        z_base = zb + r * z_se
        g_base = gb + r * g_se
    else:
        r = code.to(tl.int64)
        w_base = wp + r * w_se
        s_base = sp + r * s_se
        z_base = zp + r * z_se
        g_base = gp + r * g_se
    return w_base, s_base, z_base, g_base
