"""GEMV decode path, NVFP4's and int4's word dots in packed half math (`GemvConfig.half_dot`, `@triton.jit` parts;
int4's operations are described at `_INT4_HFMA_ASM`).

Why: at one token the NVFP4 GEMV spends, per 8-value word, 11 integer operations on the decode, 8 fp16 -> fp32
converts and 8 FFMA (570 loop instructions per 16 words per thread, Triton 3.6, sm_90), about as long to issue as
the word takes to stream at the HBM rate. The decode already yields each word's values as four fp16x2 pairs
(`gemv_words._e2m1_pairs`: codes (j, j + 4) as the halves, `value / 2^14`), so one `fma.rn.f16x2` multiplies a
pair by an fp16x2 pair of x values and adds it to a packed accumulator: 4 HFMA2 per word instead of 8 converts and
8 FFMA. The two words of a scale (16 values, 8 per half) are one chain; its two halves are widened and added in
fp32 and times the scale, as the fp32 form does.

x in fp16: each program scales its token's x row by one power of two, `2^(140 - e)` with `e` the fp32 exponent
field of `max |x|` (at least 14), so that `max |x'|` lies in [2^13, 2^14): a product `value / 2^14 * x'` is at most
6 and a half's chain of 8 at most 48 (fp16's largest is 65504); x values down to `max |x| * 2^-37` stay nonzero
(fp16 subnormals; `fma.rn.f16x2` keeps them). The row's sum is multiplied back by `2^(e - 140)` at the end (exact:
powers of two). Rounding: x' is exact (a bf16 value has 8 significant bits, fp16 11) unless below fp16's normal
range; each HFMA2 rounds its half's running sum to 11 bits (fp32 form: 24), so a scale's sum carries a relative
error of about 2^-11 sqrt(8) of its largest partial sums; the output is rounded to bf16 (2^-9) after.

The interpreter cannot run PTX: there (ASM false) the same sums run in fp32 with each step rounded to fp16, the
HFMA2's single rounding emulated by an exact fp32 product (3 x 11 significant bits) and an fp32 add before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dequant import _fp16_hi, _fp16_lo
from .gemv_words import _e2m1_pairs, _halves, _ldx, _pair_first, _x_split8, e2m1_ptx

# largest x row loaded at once for the row's scale (values; the loop takes more in chunks of this many)
X_SCALE_CHUNK = 8192
# words of x (8 values each) `x_half_pack` scales and packs at once: 8 values per thread of 4 warps
X_PACK_CHUNK_WORDS = tl.constexpr(128)
# x' = x times the row scale has its largest value in [2^TOP, 2^(TOP + 1)): NVFP4 (products value / 2^14 * x',
# |value| <= 6: at most 6, a half's 8 at most 48) and int4 (|q - z| <= 15: 8 products below 61440 < 65504)
NVFP4_TOP = tl.constexpr(13)
INT4_TOP = tl.constexpr(8)

# one word's 8 e2m1 codes decoded as `gemv_words._E2M1_ASM` does (codes (0, 4), (1, 5), (2, 6), (3, 7) as fp16x2
# `value / 2^14`), each pair times x' pair `$2..$5` and added to the packed accumulator `$6` -> `$0`
_E2M1_HFMA_ASM = tl.constexpr(
    "{\n.reg .b32 r, ev, od, t;\n"
    + e2m1_ptx("$1", lambda j: [f"fma.rn.f16x2 $0, t, ${2 + j}, {'$6' if j == 0 else '$0'};"])
    + "\n}"
)


@triton.jit
def x_half_scale(x_row, lo, hi, X_CG: tl.constexpr, CHUNK: tl.constexpr, TOP: tl.constexpr):
    """(`2^(TOP + 127 - e)`, `2^(e - TOP - 127)`) fp32 for `e` the biased exponent field of `max |x_row[lo:hi]|`
    (the values this program's K share reads), at least TOP + 1 (so both are normal floats: x of zeros or fp32
    subnormals takes 2^126), i.e. x times the first has its largest value in [2^TOP, 2^(TOP + 1)); an inf or NaN
    maximum gives a tiny scale (its products stay inf / NaN). CHUNK: values loaded at once (a power of two)."""
    offs = tl.arange(0, CHUNK)
    m = tl.zeros((CHUNK,), dtype=tl.float32)
    for k0 in range(lo, hi, CHUNK):
        m = tl.maximum(m, tl.abs(_ldx(x_row + k0 + offs, offs + k0 < hi, False, X_CG)))
    e = (tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 255
    # a tensor first: `constexpr - tensor` stays a constexpr in the interpreter
    d = tl.maximum(e, TOP + 1) - TOP
    return ((254 - d) << 23).to(tl.float32, bitcast=True), (d << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pack_half2(lo, hi):
    """int32 fp16x2 of fp32 `lo` (low half) and `hi` (high half), each rounded to nearest."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _rnd16(v):
    """fp32 `v` rounded to fp16 (to nearest), back in fp32."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _scaled_x(x_row, k0, K_WORDS, KW: tl.constexpr, xscale, EVEN_K: tl.constexpr, X_CG: tl.constexpr):
    """x' = x * xscale of a tile of KW words as two 8-tuples of `[KW / 2]` fp32: value j of each pair's first
    word (columns 2c) and of its second (2c + 1)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_split8(x_row, k0, K_WORDS, KW, EVEN_K, X_CG)
    a0, b0 = _halves(x0 * xscale)
    a1, b1 = _halves(x1 * xscale)
    a2, b2 = _halves(x2 * xscale)
    a3, b3 = _halves(x3 * xscale)
    a4, b4 = _halves(x4 * xscale)
    a5, b5 = _halves(x5 * xscale)
    a6, b6 = _halves(x6 * xscale)
    a7, b7 = _halves(x7 * xscale)
    return (a0, a1, a2, a3, a4, a5, a6, a7), (b0, b1, b2, b3, b4, b5, b6, b7)


@triton.jit
def _pack_half2_rounded(lo, hi):
    """The interpreter's `_pack_half2`: int32 fp16x2 of fp32 `lo` (low half) and `hi`, each rounded to nearest."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (hi16 << 16) | lo16


@triton.jit
def _x_pairs(x, ASM: tl.constexpr):
    """A word's x' (8-tuple, value j of each word) as its four fp16x2 pairs (0, 4), (1, 5), (2, 6), (3, 7), int32
    of the same shape: `cvt.rn.f16x2.f32` (ASM) or its interpreter form."""
    if ASM:
        return (_pack_half2(x[0], x[4]), _pack_half2(x[1], x[5]), _pack_half2(x[2], x[6]),
                _pack_half2(x[3], x[7]))  # fmt: skip
    else:
        return (_pack_half2_rounded(x[0], x[4]), _pack_half2_rounded(x[1], x[5]), _pack_half2_rounded(x[2], x[6]),
                _pack_half2_rounded(x[3], x[7]))  # fmt: skip


@triton.jit
def x_half_pack(x_row, xp_row, lo_w, hi_w, xscale, X_CG: tl.constexpr, CHUNK_W: tl.constexpr,
                ASM: tl.constexpr):  # fmt: skip
    """Writes x' = x * xscale of the words `[lo_w, hi_w)` (8 values each) to `xp_row` as each word's four fp16x2
    pairs (0, 4), (1, 5), (2, 6), (3, 7) (int32 `xp_row[4 w + j]`, pair j), `CHUNK_W` words at a time; then a
    barrier, so that every thread of the program reads the pairs any thread wrote (`GemvConfig.half_x_pack`:
    the K loop loads them instead of preparing x' per tile and thread). Every program with the same x row and
    K share writes the same values (a race of equal bytes)."""
    offs = tl.arange(0, CHUNK_W)
    for w0 in range(lo_w, hi_w, CHUNK_W):
        w = w0 + offs
        ok = w < hi_w
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_split8(x_row, w0, hi_w, CHUNK_W, False, X_CG)
        p0, p1, p2, p3 = _x_pairs((x0 * xscale, x1 * xscale, x2 * xscale, x3 * xscale, x4 * xscale, x5 * xscale,
                                   x6 * xscale, x7 * xscale), ASM)  # fmt: skip
        pairs = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [c, b, d]: pair 2b + d (join adds the last axis)
        dst = (
            xp_row
            + w[:, None, None] * 4
            + tl.arange(0, 2)[None, :, None] * 2
            + tl.arange(0, 2)[None, None, :]
        )
        tl.store(dst, pairs, mask=ok[:, None, None])
    tl.debug_barrier()


@triton.jit
def _loaded_pairs(xp_row, k0, K_WORDS, KW: tl.constexpr, EVEN_K: tl.constexpr):
    """The x' pairs `x_half_pack` wrote for the tile of KW words at word k0: for the pair's first words (2c)
    and its second (2c + 1), the four fp16x2 pairs j (values j, j + 4) as int32 `[1, KW / 2]` (0 past K)."""
    offs = k0 * 4 + tl.arange(0, KW * 4)
    if EVEN_K:  # noqa: SIM108 (constexpr branch)
        t = tl.load(xp_row + offs)
    else:
        t = tl.load(xp_row + offs, mask=offs < K_WORDS * 4, other=0)
    # pair j = 2b + d of word 2c + h at [c, h, b, d]
    t0, t1 = tl.split(tl.reshape(t, (KW // 2, 2, 2, 2)))  # d = 0, 1
    j0, j2 = tl.split(t0)  # b = 0, 1
    j1, j3 = tl.split(t1)
    a0, b0 = tl.split(j0)  # h = 0, 1
    a1, b1 = tl.split(j1)
    a2, b2 = tl.split(j2)
    a3, b3 = tl.split(j3)
    return ((a0[None, :], a1[None, :], a2[None, :], a3[None, :]),
            (b0[None, :], b1[None, :], b2[None, :], b3[None, :]))  # fmt: skip


@triton.jit
def _pairs_as_x(p):
    """Four fp16x2 pairs (0, 4) .. (3, 7) as a word's eight x' values in fp32 (what the interpreter's HFMA2
    emulation takes)."""
    return (_fp16_lo(p[0]), _fp16_lo(p[1]), _fp16_lo(p[2]), _fp16_lo(p[3]), _fp16_hi(p[0]), _fp16_hi(p[1]),
            _fp16_hi(p[2]), _fp16_hi(p[3]))  # fmt: skip


@triton.jit
def _half_x_inputs(x_row, xp_row, k0, K_WORDS, KW: tl.constexpr, xscale, EVEN_K: tl.constexpr,
                   X_CG: tl.constexpr, X_PACK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The x' of a tile's first words (2c) and second words (2c + 1) as the word dots take them: fp16x2 pairs
    (ASM) or fp16-rounded fp32 8-tuples (the interpreter); loaded from `x_half_pack`'s pairs (X_PACK) or
    prepared from x here."""
    if X_PACK:
        pa, pb = _loaded_pairs(xp_row, k0, K_WORDS, KW, EVEN_K)
    else:
        xa, xb = _scaled_x(x_row, k0, K_WORDS, KW, xscale, EVEN_K, X_CG)
        pa, pb = _row_vectors(_x_pairs(xa, ASM)), _row_vectors(_x_pairs(xb, ASM))
    if ASM:
        return pa, pb
    else:
        return _pairs_as_x(pa), _pairs_as_x(pb)


@triton.jit
def _row_vectors(p):
    """Four `[KW / 2]` pairs as `[1, KW / 2]` (broadcast over a tile's rows)."""
    return p[0][None, :], p[1][None, :], p[2][None, :], p[3][None, :]


@triton.jit
def _hfma_emulated(lo, hi, words, x):
    """The interpreter's `_E2M1_HFMA_ASM`: the fp32 sums of the halves `(lo, hi)` (fp16 values) plus each of the
    word's pairs times its x' pair (`x`: `_pairs_as_x`), rounded to fp16 each step."""
    b04, b15, b26, b37 = _e2m1_pairs(words)
    lo = _rnd16(_fp16_lo(b04) * x[0] + lo)
    hi = _rnd16(_fp16_hi(b04) * x[4] + hi)
    lo = _rnd16(_fp16_lo(b15) * x[1] + lo)
    hi = _rnd16(_fp16_hi(b15) * x[5] + hi)
    lo = _rnd16(_fp16_lo(b26) * x[2] + lo)
    hi = _rnd16(_fp16_hi(b26) * x[6] + hi)
    lo = _rnd16(_fp16_lo(b37) * x[3] + lo)
    hi = _rnd16(_fp16_hi(b37) * x[7] + hi)
    return lo, hi


@triton.jit
def nvfp4_half_dot(acc, words, s, x_row, xp_row, k0, K_WORDS, xscale, EVEN_K: tl.constexpr, X_CG: tl.constexpr,
                   X_PACK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """`gemv_words._word_dot` of NVFP4 in packed half math: `acc [BN, KW / 2]` plus, per pair of words (2c,
    2c + 1: one scale `s [BN, KW / 2]`), `s * sum (value / 2^14) * x * xscale` over its 16 values, the sum of
    each half (8 products) in fp16. `xscale`: `x_half_scale`'s first value for this x row. X_PACK: x' from
    `x_half_pack`'s pairs at `xp_row` (the same values)."""
    xa, xb = _half_x_inputs(x_row, xp_row, k0, K_WORDS, words.shape[1], xscale, EVEN_K, X_CG, X_PACK, ASM)
    wa, wb = _halves(words)
    if ASM:
        p = tl.inline_asm_elementwise(
            _E2M1_HFMA_ASM, "=r,r,r,r,r,r,r", [wa, xa[0], xa[1], xa[2], xa[3], tl.zeros(wa.shape, dtype=tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        p = tl.inline_asm_elementwise(
            _E2M1_HFMA_ASM, "=r,r,r,r,r,r,r", [wb, xb[0], xb[1], xb[2], xb[3], p], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
        lo, hi = _fp16_lo(p), _fp16_hi(p)
    else:
        lo = tl.zeros(wa.shape, dtype=tl.float32)
        lo, hi = _hfma_emulated(lo, lo, wa, xa)
        lo, hi = _hfma_emulated(lo, hi, wb, xb)
    return acc + s * (lo + hi)


# int4 (value j of a word at bits 4j..4j+3): pairs (0, 4) and (2, 6) as fp16x2 `1024 + q` (one LOP3: the nibbles
# under fp16's 1024.0, whose unit is 1) plus `$6` = -(1024 + z); pairs (1, 5) and (3, 7) masked in place as
# `1024 + 16 q` and taken to `q - z` by one FMA with `$9` = 1/16 and `$7` = -(64 + z) (both exact: no shift for
# them); each pair times its x' pair `$2..$5`, added to the packed accumulator `$8` -> `$0`. 13 operations a word.
_INT4_HFMA_ASM = tl.constexpr(
    """{
.reg .b32 t, v, u;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
add.rn.f16x2 v, t, $6;
fma.rn.f16x2 $0, v, $2, $8;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 v, t, $9, $7;
fma.rn.f16x2 $0, v, $3, $0;
shr.u32 u, $1, 8;
lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA;
add.rn.f16x2 v, t, $6;
fma.rn.f16x2 $0, v, $4, $0;
lop3.b32 t, u, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 v, t, $9, $7;
fma.rn.f16x2 $0, v, $5, $0;
}"""
)
_SIXTEENTH_X2 = tl.constexpr(0x2C002C00)  # fp16x2 (1/16, 1/16)


@triton.jit
def _int4_hfma_emulated(lo, hi, words, z, x):
    """The interpreter's `_INT4_HFMA_ASM`: `(lo, hi)` plus each of the word's values `q - z` (exact) times its x'
    (`x`: `_pairs_as_x`), each step rounded to fp16."""
    lo = _rnd16(((words & 15) - z) * x[0] + lo)
    hi = _rnd16((((words >> 16) & 15) - z) * x[4] + hi)
    lo = _rnd16((((words >> 4) & 15) - z) * x[1] + lo)
    hi = _rnd16((((words >> 20) & 15) - z) * x[5] + hi)
    lo = _rnd16((((words >> 8) & 15) - z) * x[2] + lo)
    hi = _rnd16((((words >> 24) & 15) - z) * x[6] + hi)
    lo = _rnd16((((words >> 12) & 15) - z) * x[3] + lo)
    hi = _rnd16((((words >> 28) & 15) - z) * x[7] + hi)
    return lo, hi


@triton.jit
def int4_half_dot(acc, words, s, z, x_row, xp_row, k0, K_WORDS, xscale, HAS_ZERO: tl.constexpr,
                  EVEN_K: tl.constexpr, X_CG: tl.constexpr, X_PACK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """`gemv_words._int4_word_dot` in packed half math: `acc [BN, KW / 2]` plus, per pair of words (2c, 2c + 1:
    one group), `s * sum (q - z) * x * xscale` over its 16 values (z = 8 without zero points), each half's 8
    products summed in fp16. `s`, `z`: per word `[BN, KW]` or per row `[BN, 1]`. `xscale`: `x_half_scale`'s
    first value at TOP = INT4_TOP (|q - z| <= 15: a half's 8 products stay below 2^16). X_PACK: x' from
    `x_half_pack`'s pairs at `xp_row` (the same values)."""
    xa, xb = _half_x_inputs(x_row, xp_row, k0, K_WORDS, words.shape[1], xscale, EVEN_K, X_CG, X_PACK, ASM)
    wa, wb = _halves(words)
    if HAS_ZERO:  # noqa: SIM108 (constexpr branch)
        zp = _pair_first(z)
    else:
        zp = tl.full((1, 1), 8.0, dtype=tl.float32)
    if ASM:
        off = _pack_half2(-1024.0 - zp, -1024.0 - zp)
        off16 = _pack_half2(-64.0 - zp, -64.0 - zp)
        sixteenth = tl.full(wa.shape, _SIXTEENTH_X2, dtype=tl.int32)
        p = tl.inline_asm_elementwise(
            _INT4_HFMA_ASM, "=r,r,r,r,r,r,r,r,r,r", [wa, xa[0], xa[1], xa[2], xa[3], off, off16,
            tl.zeros(wa.shape, dtype=tl.int32), sixteenth], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        p = tl.inline_asm_elementwise(
            _INT4_HFMA_ASM, "=r,r,r,r,r,r,r,r,r,r", [wb, xb[0], xb[1], xb[2], xb[3], off, off16, p, sixteenth],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        lo, hi = _fp16_lo(p), _fp16_hi(p)
    else:
        lo = tl.zeros(wa.shape, dtype=tl.float32)
        lo, hi = _int4_hfma_emulated(lo, lo, wa, zp, xa)
        lo, hi = _int4_hfma_emulated(lo, hi, wb, zp, xb)
    return acc + _pair_first(s) * (lo + hi)
