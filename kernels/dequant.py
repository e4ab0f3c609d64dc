"""In-kernel weight tile loaders: one tile of a projection row dequantized to the compute dtype, for every format
(constexpr FMT): K-major `[BLOCK_K, BLOCK_N]` B tiles (`load_b_tile`) or N-major `[BLOCK_N, BLOCK_K]` tiles for the
swapped-operand GEMMs (`load_w_tile`). Offsets inside a row are int32 (a row is < 2^31 elements,
checked by the launchers); the row base pointers carry the int64 row offset.

Packed formats (int4, NVFP4) load their packed words once per tile and expand them in registers.

Formats (FMT): 0 dense bf16/fp16; 1 int4 (8 per int32 along K, scale per GROUP, zero point optional);
2 fp8 e4m3 per-channel scale; 3 fp8 e4m3 with [GROUP, GROUP] block scales; 4 NVFP4 (e2m1 pairs per byte, read
as int32 words, e4m3 scale per 16, fp32 global). Dequantization is done in fp32 in the order of the torch reference
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
def _interleave8(q0, q1, q2, q3, q4, q5, q6, q7):
    """Eight `[BN, KW]` tensors -> `[BN, 8 * KW]` with element `8 * kw + j` from `q_j` (joins keep each new
    axis inside the thread, so the final reshape moves no data)."""
    a0, a1, a2, a3 = tl.join(q0, q4), tl.join(q2, q6), tl.join(q1, q5), tl.join(q3, q7)
    c = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [BN, KW, 2, 2, 2]: [a, b, c] = q_{4a + 2b + c}
    return tl.reshape(c, (q0.shape[0], q0.shape[1] * 8))


@triton.jit
def _int4_tile(w_base, s_base, z_base, offs_n, mask_n, k0, K, w_sn, s_sn, z_sn,
               BLOCK_K: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):  # fmt: skip
    """`[BLOCK_N, BLOCK_K]` fp32 of an int4 tile: the packed words `[BLOCK_N, BLOCK_K/8]` loaded once (contiguous
    along K), one scale per word (a word never straddles a group), nibbles expanded in registers."""
    KW: tl.constexpr = BLOCK_K // 8
    kw = k0 // 8 + tl.arange(0, KW)
    wmask = mask_n[:, None] & (kw < K // 8)[None, :]
    words = tl.load(w_base + offs_n[:, None] * w_sn + kw[None, :], mask=wmask, other=0)
    kg = (kw * 8) // GROUP
    if GROUP % BLOCK_K == 0:
        # the tile lies in one group (K is a multiple of GROUP, so of BLOCK_K: no partial tile): one scale
        # (and zero point) per row instead of one load per word
        g1 = k0 // GROUP
        s = tl.load(s_base + offs_n * s_sn + g1, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    else:
        s = tl.load(s_base + offs_n[:, None] * s_sn + kg[None, :], mask=wmask, other=0.0).to(tl.float32)
    # value = (2^23 + q) - (2^23 + zero point), exact in fp32, with no int -> float convert
    if HAS_ZERO:
        if GROUP % BLOCK_K == 0:
            z = tl.load(z_base + offs_n * z_sn + g1, mask=mask_n, other=0).to(tl.float32)[:, None]
        else:
            z = tl.load(z_base + offs_n[:, None] * z_sn + kg[None, :], mask=wmask, other=0).to(tl.float32)
        zf = z + 8388608.0
    else:
        zf = 8388616.0
    q0 = (((words >> 0) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q1 = (((words >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q2 = (((words >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q3 = (((words >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q4 = (((words >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q5 = (((words >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q6 = (((words >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    q7 = (((words >> 28) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return _interleave8(
        (q0 - zf) * s, (q1 - zf) * s, (q2 - zf) * s, (q3 - zf) * s,
        (q4 - zf) * s, (q5 - zf) * s, (q6 - zf) * s, (q7 - zf) * s,
    )  # fmt: skip


@triton.jit
def _int4_tile_h(w_base, s_base, z_base, offs_n, mask_n, k0, K, w_sn, s_sn, z_sn,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 COMPUTE: tl.constexpr):  # fmt: skip
    """`_int4_tile` computed in the compute dtype (bf16/fp16), packed two values per register: nibbles j and
    j + 4 of a word land in the low/high halves of `(w >> 4j) & 0x000F000F | MAGIC`, which read as two
    half-precision `M + q` (bf16 M = 128, fp16 M = 1024: integer ulp); `(M + q) - (M + zero)` is exact and one
    multiply by the scale rounds once, as the reference's fp32 `(q - zero) * s` rounded to the compute dtype:
    the same values, with packed half ops (HADD2/HMUL2) and no fp32 -> half convert."""
    KW: tl.constexpr = BLOCK_K // 8
    kw = k0 // 8 + tl.arange(0, KW)
    wmask = mask_n[:, None] & (kw < K // 8)[None, :]
    words = tl.load(w_base + offs_n[:, None] * w_sn + kw[None, :], mask=wmask, other=0)
    kg = (kw * 8) // GROUP
    if COMPUTE == tl.bfloat16:
        MAGIC: tl.constexpr = 0x43004300
        MAGIC_F: tl.constexpr = 128.0
    else:
        MAGIC: tl.constexpr = 0x64006400
        MAGIC_F: tl.constexpr = 1024.0
    if GROUP % BLOCK_K == 0:  # the tile lies in one group: one scale (and zero point) per row
        g1 = k0 // GROUP
        s = tl.load(s_base + offs_n * s_sn + g1, mask=mask_n, other=0.0).to(COMPUTE)[:, None]
    else:
        s = tl.load(s_base + offs_n[:, None] * s_sn + kg[None, :], mask=wmask, other=0.0).to(COMPUTE)
    if HAS_ZERO:
        if GROUP % BLOCK_K == 0:
            z = tl.load(z_base + offs_n * z_sn + g1, mask=mask_n, other=0).to(tl.float32)[:, None]
        else:
            z = tl.load(z_base + offs_n[:, None] * z_sn + kg[None, :], mask=wmask, other=0).to(tl.float32)
        zm = (z + MAGIC_F).to(COMPUTE)  # exact
    else:
        # typed: a float literal may promote the half math to fp32
        zm = tl.full((1, 1), MAGIC_F + 8.0, COMPUTE)
    t0 = (words & 0x000F000F) | MAGIC
    t1 = ((words >> 4) & 0x000F000F) | MAGIC
    t2 = ((words >> 8) & 0x000F000F) | MAGIC
    t3 = ((words >> 12) & 0x000F000F) | MAGIC
    return _interleave8(
        (_half16(t0, COMPUTE) - zm) * s, (_half16(t1, COMPUTE) - zm) * s,
        (_half16(t2, COMPUTE) - zm) * s, (_half16(t3, COMPUTE) - zm) * s,
        (_half16(t0 >> 16, COMPUTE) - zm) * s, (_half16(t1 >> 16, COMPUTE) - zm) * s,
        (_half16(t2 >> 16, COMPUTE) - zm) * s, (_half16(t3 >> 16, COMPUTE) - zm) * s,
    )  # fmt: skip


@triton.jit
def _half16(bits, COMPUTE: tl.constexpr):
    """The low 16 bits of each int32 as a `COMPUTE` (bf16/fp16) value."""
    return bits.to(tl.int16).to(COMPUTE, bitcast=True)


@triton.jit
def _e2m1_pair(word, J: tl.constexpr):
    """e2m1 codes J and J + 4 of `word` (bits 4J and 4J + 16) as fp16 bits in the low/high halves of an int32
    (value / 16384, subnormals exact): `_e2m1_scaled` for two values at once."""
    if J * 4 <= 9:  # noqa: SIM108 (constexpr branch)
        em = word << (9 - 4 * J)
    else:
        em = word >> (4 * J - 9)
    return (em & 0x0E000E00) | ((word << (12 - 4 * J)) & -2147450880)  # sign bits: 0x80008000 as int32


@triton.jit
def _fp16_lo(bits):
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp16_hi(bits):
    return (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_scaled(word, SHIFT: tl.constexpr):
    """The e2m1 code at bits SHIFT..SHIFT+3 of `word` -> value / 16384 in fp32: its bits placed in an fp16
    (subnormals exact), converted."""
    code = word >> SHIFT
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nvfp4_tile(w_base, s_base, g_base, offs_n, mask_n, k0, K, w_sn, s_sn,
                BLOCK_K: tl.constexpr, NATIVE_FP8: tl.constexpr):  # fmt: skip
    """`[BLOCK_N, BLOCK_K]` fp32 of an NVFP4 tile. The launcher hands the packed bytes as int32 words (4 bytes,
    even k in each low nibble, so value `8 * kw + j` sits at bits 4j, as int4); one e4m3 scale per word (a
    word never straddles a 16-group); `(e2m1 * scale) * global` in the reference's order."""
    KW: tl.constexpr = BLOCK_K // 8
    kw = k0 // 8 + tl.arange(0, KW)
    wmask = mask_n[:, None] & (kw < K // 8)[None, :]
    words = tl.load(w_base + offs_n[:, None] * w_sn + kw[None, :], mask=wmask, other=0)
    # one scale per two words, loaded once and repeated in registers (join: a new in-thread axis)
    kg = k0 // 16 + tl.arange(0, KW // 2)
    gmask = mask_n[:, None] & (kg < K // 16)[None, :]
    raw_s = tl.load(s_base + offs_n[:, None] * s_sn + kg[None, :], mask=gmask)
    s2 = tl.where(gmask, e4m3_to_f32(raw_s, NATIVE_FP8) * 16384.0, 0.0)  # exact (a power of two)
    s = tl.reshape(tl.join(s2, s2), (s2.shape[0], KW))
    g = tl.load(g_base)
    # e2m1 * scale is exact; then one rounding by the global, as the reference. Codes j and j + 4 are decoded
    # together (`_e2m1_pair`: the same fp16 bits as `_e2m1_scaled`, half the integer ops)
    p0, p1, p2, p3 = _e2m1_pair(words, 0), _e2m1_pair(words, 1), _e2m1_pair(words, 2), _e2m1_pair(words, 3)
    return _interleave8(
        (_fp16_lo(p0) * s) * g, (_fp16_lo(p1) * s) * g, (_fp16_lo(p2) * s) * g, (_fp16_lo(p3) * s) * g,
        (_fp16_hi(p0) * s) * g, (_fp16_hi(p1) * s) * g, (_fp16_hi(p2) * s) * g, (_fp16_hi(p3) * s) * g,
    )  # fmt: skip


@triton.jit
def _fp8_block_scales(s_base, offs_n, mask_n, k0, K, s_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_MAJOR: tl.constexpr):  # fmt: skip
    """fp8 block scales over a weight tile: `[BLOCK_N, BLOCK_K]` fp32 (`[BLOCK_K, BLOCK_N]` K_MAJOR), or one
    column (row) that broadcasts to it where a group spans the tile's K. Loads only the tile's `[BLOCK_N,
    BLOCK_K // GROUP]` scales and widens them in registers: the software pipeliner keeps what the K loop loads in
    shared memory, and a scale per weight (as loaded before) cost 4 bytes there per fp8 weight byte: the
    DeepSeek-like swapped decode gemm1 tile then needed 264,192 bytes on sm_90 (limit 232,448; Triton 3.6). The
    same values as one load per weight, so the same bits."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    KB: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1  # scale columns of the tile
    kb = k0 // GROUP + tl.arange(0, KB)
    in_k = kb * GROUP < K
    rows = (offs_n // GROUP) * s_sn
    if K_MAJOR:
        s = tl.load(s_base + rows[None, :] + kb[:, None], mask=mask_n[None, :] & in_k[:, None], other=0.0)
        if KB > 1:
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (KB, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
    else:
        s = tl.load(s_base + rows[:, None] + kb[None, :], mask=mask_n[:, None] & in_k[None, :], other=0.0)
        if KB > 1:
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, KB, GROUP)), (BLOCK_N, BLOCK_K))
    return s


@triton.jit
def load_w_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, mask_n, mask_k, k0, K, w_sn, s_sn, z_sn,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
                COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr, HALF_INT4: tl.constexpr = False):  # fmt: skip
    """The weight tile N-major, `[BLOCK_N, BLOCK_K]` in the compute dtype: `load_b_tile` transposed (the
    left operand of the swapped-operand GEMMs, `GemmConfig.swap_ab`). Arguments as `load_b_tile`."""
    n = offs_n[:, None]
    k = offs_k[None, :]
    mask = mask_n[:, None] & mask_k[None, :]
    if FMT == 0:
        w = tl.load(w_base + n * w_sn + k, mask=mask, other=0.0).to(COMPUTE)
    elif FMT == 1:
        if HALF_INT4:
            w = _int4_tile_h(w_base, s_base, z_base, offs_n, mask_n, k0, K, w_sn, s_sn, z_sn,
                             BLOCK_K, GROUP, HAS_ZERO, COMPUTE)  # fmt: skip
        else:
            w = _int4_tile(w_base, s_base, z_base, offs_n, mask_n, k0, K, w_sn, s_sn, z_sn,
                           BLOCK_K, GROUP, HAS_ZERO).to(COMPUTE)  # fmt: skip
    elif FMT == 2:
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = tl.load(s_base + n, mask=mask_n[:, None], other=0.0)
        w = (q * s).to(COMPUTE)
    elif FMT == 3:
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = _fp8_block_scales(s_base, offs_n, mask_n, k0, K, s_sn, GROUP, BLOCK_K, False)
        w = (q * s).to(COMPUTE)
    else:
        w = _nvfp4_tile(w_base, s_base, g_base, offs_n, mask_n, k0, K, w_sn, s_sn, BLOCK_K, NATIVE_FP8).to(
            COMPUTE
        )
    return w


@triton.jit
def load_b_tile(
    w_base,
    s_base,
    z_base,
    g_base,
    offs_n,  # [BLOCK_N] row index inside the projection (N)
    offs_k,  # [BLOCK_K] column index (K, in values) = k0 + arange(BLOCK_K)
    mask_n,
    mask_k,
    k0,  # first K value of the tile (a multiple of BLOCK_K)
    K,  # K of the projection (values)
    w_sn,  # stride along N of the weight (elements); stride along K is 1
    s_sn,
    z_sn,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF_INT4: tl.constexpr = False,
):
    """The `[BLOCK_K, BLOCK_N]` B tile in the compute dtype. HALF_INT4: int4 through `_int4_tile_h` (the same
    values in packed half-precision ops) instead of fp32 math and a convert. Packed formats are expanded
    N-major (`load_w_tile`) and transposed; the others load K-major."""
    n = offs_n[None, :]
    k = offs_k[:, None]
    mask = mask_n[None, :] & mask_k[:, None]
    if FMT == 1 or FMT == 4:
        w = tl.trans(load_w_tile(w_base, s_base, z_base, g_base, offs_n, offs_k, mask_n, mask_k, k0, K, w_sn,
                                 s_sn, z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, BLOCK_K, HALF_INT4))  # fmt: skip
    elif FMT == 0:
        w = tl.load(w_base + n * w_sn + k, mask=mask, other=0.0).to(COMPUTE)
    elif FMT == 2:
        # fp8 loads take no `other` (an int/float -> fp8 constant cast is version-dependent): zero after decoding
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = tl.load(s_base + n, mask=mask_n[None, :], other=0.0)
        w = (q * s).to(COMPUTE)
    else:
        q = tl.where(mask, e4m3_to_f32(tl.load(w_base + n * w_sn + k, mask=mask), NATIVE_FP8), 0.0)
        s = _fp8_block_scales(s_base, offs_n, mask_n, k0, K, s_sn, GROUP, BLOCK_K, True)
        w = (q * s).to(COMPUTE)
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
    "load_w_tile",
]
