"""Launcher-side helpers of the pooled GEMMs (`moe_gemm.py`, `gemv.py`): whether the kernels run under Triton's
interpreter, the compute dtypes, the projections' pointer and stride arguments, and the activation checks."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .dequant import FMT_NVFP4
from .operands import KernelFormat, Projection

# Decided when the kernels are imported (that is when triton.jit picks the interpreter), not per call.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether these kernels were imported under TRITON_INTERPRET=1 (CPU tests)."""
    return _INTERPRETING


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

NATIVE_FP8_CAPABILITY = (8, 9)  # Triton's fp8e4nv (hardware e4m3 converts): Ada, Hopper and newer


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def native_fp8(device: torch.device) -> bool:
    """Whether the kernels on `device` convert e4m3 (fp8 weights, NVFP4 scales) in hardware: CUDA cards of
    compute capability 8.9 and newer. Elsewhere (sm_80 / sm_86, where Triton refuses the type with "type fp8e4nv
    not supported in this architecture", and the interpreter) the kernels read the bytes and decode the bits
    (`dequant.e4m3_to_f32`): the same values."""
    if _INTERPRETING or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= NATIVE_FP8_CAPABILITY


# kernel -> {(device, stages asked, launch options): the stages that fit}; empty until a card refuses a tile
_FITTED_STAGES: dict[Any, dict[tuple[object, ...], int]] = {}
_log = logging.getLogger(__name__)


def _fit_key(num_stages: int, options: dict[str, Any]) -> tuple[object, ...]:
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return (device, num_stages, *((k, repr(v)) for k, v in options.items()))


def launch_fitting(kernel: Any, grid: Any, *args: Any, num_stages: int, **options: Any) -> Any:
    """`kernel[grid](*args, num_stages=num_stages, **options)`, with fewer software-pipeline stages where the
    card's blocks cannot hold `num_stages` stages' shared memory (Triton raises OutOfResources when it loads the
    compiled kernel, before anything runs): the most that fit, found once per kernel, device and options, then
    remembered. The tiles are chosen per shape and format (`fused_moe.pick_configs`), not per card; this keeps a
    tile sized on sm_90 (227 KiB a block) running on a card with less (sm_86 / sm_89 / sm_120: 99 KiB), where
    it runs slower than a tile sized for it would (not measured there). A kernel no card refused costs one dict
    lookup per launch; one that was refused, the key of its options (the call sites pass them in one order)."""
    fitted = _FITTED_STAGES.get(kernel)
    key = _fit_key(num_stages, options) if fitted is not None else None
    stages = fitted.get(key, num_stages) if fitted is not None and key is not None else num_stages
    while True:
        try:
            return kernel[grid](*args, num_stages=stages, **options)
        except OutOfResources as e:
            if e.name != "shared memory" or stages <= 1:
                raise
            key = key if key is not None else _fit_key(num_stages, options)
            _log.warning("%s: %d stages need %d bytes of shared memory, this card gives %d; trying %d",
                         getattr(kernel, "__name__", kernel), stages, e.required, e.limit, stages - 1)  # fmt: skip
            stages -= 1
            _FITTED_STAGES.setdefault(kernel, {})[key] = stages


def _as_kernel_tensor(t: torch.Tensor, native_fp8: bool) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn and not native_fp8:
        return t.view(torch.uint8)
    return t


def _launch_args(proj: Projection, fmt: KernelFormat) -> tuple[list[torch.Tensor], list[int], bool]:
    native = native_fp8(proj.weight.device)
    ptrs = [_as_kernel_tensor(t, native) for t in proj.pointers()]
    strides = proj.row_strides()
    if fmt.fmt == FMT_NVFP4:
        # the packed bytes read as int32 words (8 values each; K % 16 == 0, rows 4-byte aligned): one load per
        # word in the kernel, the same nibble order as int4
        ptrs[0], ptrs[4] = ptrs[0].view(torch.int32), ptrs[4].view(torch.int32)
        strides[0] //= 4
        strides[4] //= 4
    return ptrs, strides, native


def _check_act_inputs(x: torch.Tensor, dtype: torch.dtype, name: str, k: int) -> None:
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype}, expected bf16 or fp16")
    if x.dtype != dtype:
        raise ValueError(f"{name}: dtype {x.dtype} differs from the compute dtype {dtype}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name}: shape {tuple(x.shape)} strides {x.stride()}, expected [*, {k}] row-major")


def _check_dense_dtype(fmt: KernelFormat, proj: Projection, dtype: torch.dtype) -> None:
    if fmt.fmt == 0 and proj.weight.dtype != dtype:
        raise ValueError(f"dense weights are {proj.weight.dtype}, activations {dtype}: expected one dtype")


def _check_proj_shape(fmt: KernelFormat, proj: Projection, n: int, k: int, name: str) -> None:
    """ValueError unless `proj`'s rows are `[n, k]` values. The launchers take n and k from the activations
    (or the other projection), and the kernels read rows with the weights' strides: a K wider than the rows
    reads into the next row and past the last one, a narrower K silently uses part of each row."""
    vpe = fmt.values_per_element()
    got = tuple(proj.weight.shape[1:])
    if k % vpe or got != (n, k // vpe):
        raise ValueError(
            f"{name}: weight rows {got} ({vpe} values per element along K), expected the [{n}, {k}] projection "
            f"of the activations ([{n}, {k // vpe}] elements)"
        )
