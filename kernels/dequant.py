"""In-kernel weight tile loaders: one `[BLOCK_K, BLOCK_N]` B tile of a projection row, dequantized to the
compute dtype, for every format (constexpr FMT). Offsets inside a row are int32 (a row is < 2^31 elements,
checked by the launchers); the row base pointers carry the int64 row offset.

Formats (FMT): 0 dense bf16/fp16; 1 int4 (8 per int32 along K, scale per GROUP, zero point optional);
2 fp8 e4m3 per-channel scale; 3 fp8 e4m3 with [GROUP, GROUP] block scales; 4 NVFP4 (e2m1 pairs per byte,
e4m3 scale per 16, fp32 global). Dequantization is done in fp32 in the order of the torch reference
(`pooled_runner/formats/quant.py`), then rounded to the compute dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_DENSE = 0
FMT_INT4 = 1
FMT_FP8_CHANNEL = 2
FMT_FP8_BLOCK = 3
FMT_NVFP4 = 4


@triton.jit
def e4m3_to_f32(raw, NATIVE_FP8: tl.constexpr):
    """e4m3fn -> fp32. NATIVE_FP8: `raw` is fp8e4nv (hardware convert); else uint8 bits (bit decode)."""
    if NATIVE_FP8:
        return raw.to(tl.float32)
    else:
        x = raw.to(tl.int32)
        sign = (x >> 7) << 31
        em = x & 0x7F
        # exponent field re-biased from 7 to 127; the 3 mantissa bits land at the top of fp32's fraction
        normal = (sign | ((em << 20) + (120 << 23))).to(tl.float32, bitcast=True)
        sub = (x & 7).to(tl.float32) * 0.001953125  # e == 0: m * 2^-9
        sub = tl.where(sign != 0, -sub, sub)
        return tl.where((em >> 3) == 0, sub, normal)


@triton.jit
def e2m1_to_f32(code):
    """4-bit e2m1 code (sign in bit 3) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def load_b_tile(
    w_base,
    s_base,
    z_base,
    g_base,
    offs_n,  # [BLOCK_N] row index inside the projection (N)
    offs_k,  # [BLOCK_K] column index (K, in values)
    mask_n,
    mask_k,
    w_sn,  # stride along N of the weight (elements); stride along K is 1
    s_sn,
    z_sn,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    n = offs_n[None, :]
    k = offs_k[:, None]
    mask = mask_n[None, :] & mask_k[:, None]
    if FMT == 0:
        w = tl.load(w_base + n * w_sn + k, mask=mask, other=0.0).to(COMPUTE)
    elif FMT == 1:
        word = tl.load(w_base + n * w_sn + k // 8, mask=mask, other=0)
        q = (word >> ((k % 8) * 4)) & 0xF
        s = tl.load(s_base + n * s_sn + k // GROUP, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_base + n * z_sn + k // GROUP, mask=mask, other=0).to(tl.int32)
            w = ((q - z).to(tl.float32) * s).to(COMPUTE)
        else:
            w = ((q - 8).to(tl.float32) * s).to(COMPUTE)
    elif FMT == 2:
        # fp8 loads take no `other` (an int/float -> fp8 constant cast is version-dependent): zero after decoding
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = tl.load(s_base + n, mask=mask_n[None, :], other=0.0)
        w = (q * s).to(COMPUTE)
    elif FMT == 3:
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = tl.load(s_base + (n // GROUP) * s_sn + k // GROUP, mask=mask, other=0.0)
        w = (q * s).to(COMPUTE)
    else:
        byte = tl.load(w_base + n * w_sn + k // 2, mask=mask, other=0).to(tl.int32)
        v = e2m1_to_f32((byte >> ((k % 2) * 4)) & 0xF)
        s = tl.where(mask, e4m3_to_f32(tl.load(s_base + n * s_sn + k // 16, mask=mask), NATIVE_FP8), 0.0)
        g = tl.load(g_base)
        w = (v * s * g).to(COMPUTE)
    return w


__all__ = [
    "FMT_DENSE",
    "FMT_FP8_BLOCK",
    "FMT_FP8_CHANNEL",
    "FMT_INT4",
    "FMT_NVFP4",
    "e2m1_to_f32",
    "e4m3_to_f32",
    "load_b_tile",
]
