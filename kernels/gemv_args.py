"""The GEMV path's launch arguments (`gemv.py`, `gemv_one.py`): which formats and shapes it takes, the weight
pointers as int32 words with their strides and bit masks, and the kernels' shape-derived constexprs."""

from __future__ import annotations

import torch
import triton

from .dequant import FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4, FMT_NVFP4
from .gemm_args import native_fp8
from .gemv_config import _VALUES_PER_WORD, GemvConfig
from .gemv_half import X_SCALE_CHUNK
from .operands import KernelFormat, Projection

# Bit constants passed as kernel arguments rather than literals: with both masks in registers ptxas emits one
# three-input LOP3 per value for `(t & mask) | bits` (with two immediates it needs two).
_INT4_BITS = (0x0000F000, 0x45000000)  # nibble field at bits 12..15; exponent of 2048.0 (gemv_tiles)
_FP8_BITS = (0x3F803F80, 0x80008000)  # e4m3 e/m bits -> fp16 bits 7..13; sign -> bit 15 (both halves)


def gemv_supported(fmt: KernelFormat, H: int, I: int) -> bool:
    """Whether the GEMV path takes this format and shape (K of both projections whole `_k_unit`s)."""
    if fmt.fmt not in _VALUES_PER_WORD:
        return False
    unit = _k_unit(fmt.fmt)
    return H % unit == 0 and I % unit == 0


def _k_unit(fmt_code: int) -> int:
    """Values that K and every K tile hold whole: one int32 word; NVFP4 one e4m3 scale (two words; its tiles
    load their scales as `[BN, KW / 2]`); int4 a pair of words (its tiles sum each pair, one group, before the
    scale: `gemv_words._int4_word_dot`)."""
    return 16 if fmt_code in (FMT_NVFP4, FMT_INT4) else _VALUES_PER_WORD[fmt_code]


def _word_args(proj: Projection, fmt: KernelFormat) -> tuple[list[torch.Tensor], list[int], bool, int, int]:
    """Kernel pointers with the weight (pool and host view) as int32 words, row/N strides in words, bit masks."""
    native = native_fp8(proj.weight.device)
    ptrs = list(proj.pointers())
    strides = proj.row_strides()
    vpe = fmt.values_per_element()  # weight values per stored element
    per_word = _VALUES_PER_WORD[fmt.fmt] // vpe  # stored elements per word
    for i in (0, 4):
        w = ptrs[i]
        if w.dtype == torch.float8_e4m3fn:
            w = w.view(torch.uint8)
        ptrs[i] = w.view(torch.int32) if w.dtype != torch.int32 else w
    strides[0] //= per_word
    strides[4] //= per_word
    for i in (1, 5):  # scales
        if ptrs[i].dtype == torch.float8_e4m3fn and not native:
            ptrs[i] = ptrs[i].view(torch.uint8)
    if fmt.fmt == FMT_INT4:
        c0, c1 = _INT4_BITS
    elif fmt.fmt in (FMT_FP8_CHANNEL, FMT_FP8_BLOCK):
        c0, c1 = _FP8_BITS
    else:
        c0, c1 = 0, 0
    return (
        ptrs,
        strides,
        native,
        c0 - (1 << 32) if c0 >= 1 << 31 else c0,
        c1 - (1 << 32) if c1 >= 1 << 31 else c1,
    )


def _check_gemv(fmt: KernelFormat, k: int, block_k: int) -> None:
    if fmt.fmt not in _VALUES_PER_WORD:
        raise ValueError(f"GEMV path: no kernel for format {fmt.fmt}")
    unit = _k_unit(fmt.fmt)
    if k % unit:
        what = {FMT_NVFP4: "one e4m3 scale", FMT_INT4: "two int32 words"}.get(fmt.fmt, "one int32 word")
        raise ValueError(f"GEMV path: K={k} is not a multiple of {unit} values ({what})")
    if block_k < unit or block_k & (block_k - 1):
        raise ValueError(f"GEMV path: block_k={block_k} must be a power of two >= {unit}")


def _host_wide(wanted: bool, k: int, block_k: int, block_n: int, split: int) -> bool:
    """The kernels' HOST_WIDE (`GemvConfig.host_wide`): where wanted, K is whole tiles of twice `block_k`, the
    block has two rows at least and K is not split; elsewhere host rows take the pool rows' tiles."""
    return bool(wanted) and k % (2 * block_k) == 0 and block_n >= 2 and split == 1


def _host_tall(wanted: bool, split: int, host_wide: bool) -> bool:
    """down's HOST_TALL (`GemvConfig.host_tall`): where wanted, K is not split and the host rows do not take
    host_wide's tiles (`_host_wide`, which wins); elsewhere host rows take the pool rows' tiles."""
    return bool(wanted) and split == 1 and not host_wide


def _half_x(config: GemvConfig, fmt: KernelFormat, k: int) -> int:
    """The kernels' HALF_X for a projection over K = `k`: 0 for the fp32 word dot; with `config.half_dot`, the
    x values its row scale loads at once (`gemv_half`). ValueError for a format other than NVFP4 and int4."""
    if not config.half_dot:
        return 0
    if fmt.fmt not in (FMT_NVFP4, FMT_INT4):
        raise ValueError(
            f"GEMV path: half_dot is NVFP4's and int4's word dot; format {fmt.fmt} has none (use half_dot=False)"
        )
    return min(triton.next_power_of_2(max(k, 1)), X_SCALE_CHUNK)
