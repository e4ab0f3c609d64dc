"""L2 prefetch of the down projection from gemm1 (decode steps).

Why: in a decode step gemm1 runs at ~60% of HBM (few programs per SM, latency-bound) and gemm2 starts with an
empty L2, so its programs wait on DRAM while their pipeline fills (Qwen3-like M=1 on the H200, ncu: gemm1 62%,
gemm2 35% of DRAM). The down weights do not depend on gemm1's output, only on the routing, which gemm1 already
has. So every gemm1 program of a pool-row expert asks L2 for its share of that expert's w2 bytes
(`prefetch.global.L2::evict_last`, no registers, nothing waits on it) while it streams its own tiles; gemm2
then reads them from L2. The prefetch reads only bytes gemm2 would read anyway; it changes no value.

Budget: at most `PREFETCH_L2_BYTES` per step, split over the step's routed pairs (an upper bound on its
distinct experts, known without a sync): each program prefetches the first `pf_bytes` of its slice. Host-view
experts are not prefetched (their bytes cross PCIe; gemm2 reads them in place).
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE = 128  # bytes per L2 line asked for
# bytes of w2 prefetched per decode step at most (H200 L2: 60 MB; gemm1's own stream shares it)
PREFETCH_L2_BYTES = 24 << 20
PREFETCH_MAX_PAIRS = 64  # steps with more routed pairs than this (prefill widths) never prefetch


@triton.jit
def _prefetch_lines(ptrs):
    """Ask L2 for the 128-byte line at each pointer (evict_last: gemm1's streaming reads go first)."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_slice(row_ptr, pid_n, num_pid_n, row_bytes, pf_bytes, LINES: tl.constexpr):
    """Prefetch the first `pf_bytes` of slice `pid_n` of `num_pid_n` of one expert's w2 bytes at `row_ptr`
    (an int8 pointer to the expert's row), LINES lines per instruction round; addresses are clamped into the
    row (a repeated line is harmless)."""
    slice_bytes = tl.cdiv(tl.cdiv(row_bytes, num_pid_n), 128) * 128
    start = pid_n * slice_bytes
    stop = tl.minimum(start + tl.minimum(pf_bytes, slice_bytes), row_bytes)
    for off in range(start, stop, LINES * 128):
        o = off + tl.arange(0, LINES) * 128
        _prefetch_lines(row_ptr + tl.minimum(o, row_bytes - 1))


def prefetch_bytes_per_program(
    num_pairs: int, row_bytes: int, num_pid_n: int, budget: int | None = None
) -> int:
    """Bytes each gemm1 program prefetches (0: off): its slice of `row_bytes / num_pid_n`, cut so that
    `num_pairs` experts stay within the budget (default `PREFETCH_L2_BYTES`); a multiple of a line. Off above
    PREFETCH_MAX_PAIRS pairs (wider steps re-read each expert's tiles from L2 anyway)."""
    budget = PREFETCH_L2_BYTES if budget is None else budget
    if budget <= 0 or num_pairs <= 0 or num_pairs > PREFETCH_MAX_PAIRS:
        return 0
    slice_bytes = -(-row_bytes // num_pid_n)
    share = min(slice_bytes, budget // (num_pairs * num_pid_n))
    return (share // LINE) * LINE


__all__ = ["LINE", "PREFETCH_L2_BYTES", "PREFETCH_MAX_PAIRS", "prefetch_bytes_per_program", "prefetch_slice"]
