"""Programmatic dependent launch (PDL, sm_90+): the one home of the grid-dependency controls (`trigger`, `wait`)
and of the check whether this Triton has them; used between gemm1 and gemm2, between the GEMV path's gate_up and
down, and by the one-launch plan + copy.

Why between the GEMMs: at decode widths a layer is a few microseconds of DRAM time, and every kernel boundary
costs a launch, a ramp-up and gemm1's tail, where DRAM sits partly idle (Qwen3-like bf16 M=1 on the H200: ~30 µs
per layer against a 17 µs bound). With PDL, gemm1 lets gemm2 launch as soon as all of gemm1's programs run
(`trigger`); gemm2's programs then find their block and expert and only then wait for gemm1's writes (`wait`)
before reading `act`: the launch and the programs' start overlap gemm1's tail. Every gemm2 program waits,
including those that leave early, so that gemm2's completion still implies gemm1's (kernels after it rely on the
stream order). Values are unchanged.

gemm1 is itself PDL-launched after the kernel before it (the previous layer's gemm2, the plan + copy, the align
kernel), and waits for it first thing, before its own trigger (gemm2 reads the location table before its own
wait, so it must not launch before the kernel that writes the table is complete). None of those kernels
triggers (except the plan + copy in OVERLAP, below), so gemm1 still launches only at their end; measured on the H200 (2026-11-30, commit fdfa2b0,
bench/planner.py --quick, 6 Qwen3-like bf16 layers, M=1, graph replay), the MoE went from 184.7 to 166.5 µs, and
with the device planner from 205.3 to 190.5 µs (183.4 with the plan + copy itself PDL-launched as a plain grid).
Letting the plan + copy trigger at its start (so that gemm1 launches during the plan) was slower: 194.5-199.0 µs
-- with every gemm1 program waiting for the plan first thing, so gemm1 ran no sooner and its waiting programs
held SM slots; OVERLAP below is the variant that does not wait.

The GEMV decode path (`gemv.py`) does the same with its two kernels: gate_up waits first thing, then triggers;
down finds its pair and location, then waits before it reads act or an arrival counter (`gemv_pdl_enabled`).

OVERLAP (`DevicePlanner.overlap`, the default with PDL, `envs.plan_overlap`): the one-launch plan + copy triggers
at its start, so the first GEMM (inline gemm1, gemm1 on blocks aligned before the plan (`fused_moe.align_before_plan`),
GEMV gate_up or the split path's one kernel) runs beside the plan. Its programs then take
their blocks in an order that does not read the location table, read their code once with acquire semantics
(`load_acquire`), wait for the plan only on a host code (`settle_code`: the expert may be being copied in) and
wait before they end; the second GEMM settles host codes the same way after its wait. `plan_copy.py` gives the
plan's half: it publishes an admitted expert's row only after the copy. It hides the plan of an
all-hit step under gemm1: on the H200 (2026-12-02, 6 Qwen3-like bf16 layers, M=1, graph replay) with the plan +
copy PDL-launched as a plain grid, the planner's share of the step fell from 12.2% (cooperative, no PDL, no
overlap: 3.4 µs per layer) to 2.5-2.7% in three runs (8.1% in a fourth; docs/BENCHMARKS.md); overlap with the
cooperative launch alone had not paid. The first GEMM must be the plan's programmatic dependent: nothing
launched in between (`DevicePlanner.plan` and `pooled_fused_moe` turn `after_plan` off where they would copy the
ids or weights first).

Off under the interpreter, on ROCm, below sm_90, for the formats in PDL_SKIP_FORMATS (MMA path only) and where Triton lacks the
GDC intrinsics or `launch_pdl` (both came with Triton 3.4).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pooled_runner import envs

from .dequant import FMT_NVFP4
from .gemm_args import interpreting

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


def pdl_supported() -> bool:
    """Whether this Triton has programmatic dependent launch (`launch_pdl`, `gdc_wait`; Triton >= 3.4)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_HAVE_GDC = pdl_supported()


@triton.jit
def trigger(PDL: tl.constexpr):
    """The dependent kernel may launch once every program of this one has passed here: in gemm1 (after its
    wait; first thing in OVERLAP), in GEMV gate_up likewise, in the plan + copy with `early_trigger`."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """In gemm2, before reading anything gemm1 writes (and before any early exit): gemm1 done and visible.
    In gemm1 and the plan + copy, first thing: the kernel before it done and visible."""
    if PDL:
        gdc_wait()


@triton.jit
def load_acquire(ptr, ASM: tl.constexpr):
    """`*ptr` (int32, any shape of pointers) with acquire semantics at GPU scope where ASM (compiled for
    sm_70+): every load after it sees what the writer released before the value was written (a location
    code published by the plan + copy after its rows' copy: `plan_copy.py`). Without ASM (the interpreter) a
    volatile load: the interpreter runs one program at a time, so there is no race to order."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        return tl.load(ptr, volatile=True)


@triton.jit
def settle_code(code, l2p_ptr, expert, num_rows, PDL: tl.constexpr):
    """OVERLAP kernels (they may run beside the plan + copy, `plan_copy.py`): a host code read before the plan
    ended may since have become a row (an admission): wait for the kernel before (the plan, or for the second
    GEMM the first, whose programs all wait for the plan before they end), then read the code again. A row code
    is final: a hit's row cannot be evicted by this step, and an admission's code is written after its copy."""
    if code >= num_rows:
        wait(PDL)
        code = tl.load(l2p_ptr + expert, volatile=True)
    return code


# gemm2 launched as a programmatic dependent of gemm1, except for NVFP4. Measured on the H200 (2026-11-30,
# commit d1274c4, bench/kernel_pdl.py, one layer, graph replay, plain -> PDL): Qwen3-like bf16 M=1 30.6 -> 28.7
# µs, M=4 92.6 -> 89.8, M=16 200.4 -> 198.7, M=512 337.7 -> 334.2; Qwen3-like int4 M=8 116.0 -> 113.8;
# DeepSeek-like int4 M=1 163.4 -> 161.7, fp8 M=8 892.1 -> 888.5; the rest within 0.7% (Qwen3-like int4 M=1
# 34.1 -> 34.3) -- but DeepSeek-like NVFP4 M=1 226.0 -> 246.8 (in both runs). Asking L2 for the first 16 or 64
# KiB of each gemm2 program's weight tile before the wait gained nothing over PDL alone (64 KiB lost up to 7%):
# not kept.
PDL_GEMM2 = envs.moe_pdl()  # POOLED_RUNNER_MOE_PDL=0 turns it off
PDL_SKIP_FORMATS = (FMT_NVFP4,)


def pdl_available(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device can use PDL at all: compiled (not interpreted), on an NVIDIA (not ROCm)
    device of compute capability >= 9.0, with a Triton that has the GDC intrinsics and `launch_pdl`."""
    if not (_HAVE_GDC and t.is_cuda) or interpreting():
        return False
    if torch.version.hip is not None:  # griddepcontrol is PTX
        return False
    return _capability_major(t.device) >= 9


def gemv_pdl_enabled(t: torch.Tensor) -> bool:
    """Whether the GEMV decode path's kernels on `t`'s device are PDL-launched (down after gate_up, gate_up after
    the kernel before it): PDL_GEMM2 and `pdl_available(t)`, for every format. PDL_SKIP_FORMATS is the MMA path's
    measurement, not the GEMV's: on the H200 (2026-12-01, bench/kernel_pdl.py, one layer, graph replay, plain ->
    PDL, commit fb18c06) the DeepSeek-like NVFP4 GEMV went 101.0 -> 99.6 µs at M=1 and 649.3 -> 648.1 at M=8,
    int4 76.3 -> 74.7 and 508.7 -> 507.5; Qwen3-like int4 M=8 73.8 -> 72.5, M=1 15.9 -> 16.0 (the one loss)."""
    return PDL_GEMM2 and pdl_available(t)


def pdl_enabled(t: torch.Tensor, weight_fmt: int) -> bool:
    """Whether the GEMMs on `t`'s device are PDL-launched for weights of format `weight_fmt` (gemm2 after gemm1,
    gemm1 after the kernel before it): PDL_GEMM2, not in PDL_SKIP_FORMATS, and `pdl_available(t)`."""
    return PDL_GEMM2 and weight_fmt not in PDL_SKIP_FORMATS and pdl_available(t)


@functools.cache
def _capability_major(device: torch.device) -> int:
    """The device's compute capability major, asked once per device (the launchers ask on every call)."""
    return torch.cuda.get_device_capability(device)[0]


__all__ = [
    "PDL_GEMM2",
    "PDL_SKIP_FORMATS",
    "gemv_pdl_enabled",
    "load_acquire",
    "pdl_available",
    "pdl_enabled",
    "pdl_supported",
    "settle_code",
    "trigger",
    "wait",
]
