"""Programmatic dependent launch (PDL, sm_90+) between gemm1 and gemm2.

Why: at decode widths a layer is a few microseconds of DRAM time, and every kernel boundary costs a launch, a
ramp-up and gemm1's tail, where DRAM sits partly idle (Qwen3-like bf16 M=1 on the H200: ~30 µs per layer against
a 17 µs bound). With PDL, gemm1 lets gemm2 launch as soon as all of gemm1's programs run (`trigger`); gemm2's
programs then find their block and expert, ask L2 for the first bytes of their weight tile (weights do not
depend on gemm1) and only then wait for gemm1's writes (`wait`) before reading `act`. Every gemm2 program waits,
including those that leave early, so that gemm2's completion still implies gemm1's (kernels after it rely on the
stream order). Values are unchanged.

Off under the interpreter, off the GPU and where Triton lacks the GDC intrinsics (they came with Triton 3.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_args import interpreting

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton
    _HAVE_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


LINE = tl.constexpr(128)  # bytes per L2 line asked for


@triton.jit
def trigger(PDL: tl.constexpr):
    """In gemm1, first thing: the dependent gemm2 may launch once every gemm1 program has passed here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """In gemm2, before reading anything gemm1 writes (and before any early exit): gemm1 done and visible."""
    if PDL:
        gdc_wait()


@triton.jit
def _prefetch_lines(ptrs):
    """Ask L2 for the 128-byte line at each pointer (no register result waits on it)."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_tile(w_base, offs_n0, w_sn, num_n, BLOCK_N: tl.constexpr, PF_BYTES: tl.constexpr):
    """Ask L2 for up to PF_BYTES of the weight rows `[offs_n0, offs_n0 + BLOCK_N)` (each `w_sn` elements; rows
    past `num_n` are not asked for): the first lines of every row, the part gemm2's first K tiles read."""
    ELEM: tl.constexpr = w_base.dtype.element_ty.primitive_bitwidth // 8
    row_bytes = w_sn * ELEM
    per_row = tl.minimum(tl.cdiv(PF_BYTES // BLOCK_N, LINE) * LINE, row_bytes)
    base = (w_base + offs_n0 * w_sn).to(tl.pointer_type(tl.int8))
    rows = tl.minimum(BLOCK_N, num_n - offs_n0)
    for off in range(0, per_row, LINE):
        r = tl.arange(0, BLOCK_N)
        _prefetch_lines(base + tl.minimum(r, rows - 1).to(tl.int64) * row_bytes + off)


# gemm2 launched as a programmatic dependent of gemm1 (decided by the H200 measurement in BENCHMARKS.md)
PDL_GEMM2 = True
# bytes of its weight tile each gemm2 program asks L2 for before waiting (0: none)
PDL_PREFETCH_BYTES = 16384


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether the GEMMs on `t`'s device launch gemm2 with PDL: PDL_GEMM2, compiled (not interpreted), on a
    CUDA device of compute capability >= 9.0, with a Triton that has the GDC intrinsics."""
    if not (PDL_GEMM2 and _HAVE_GDC and t.is_cuda) or interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


__all__ = ["PDL_GEMM2", "PDL_PREFETCH_BYTES", "pdl_enabled", "prefetch_tile", "trigger", "wait"]
