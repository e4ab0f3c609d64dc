"""GEMV decode path, the per-format word dot products (`@triton.jit`): a tile's packed int32 words times x,
dequantized in registers (bf16 / fp16 pairs, int4 nibbles, NVFP4 e2m1 codes, fp8); `gemv_tiles.py` loads the
words and their scales and sums the rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# fp32 of the fp16 in the low / high half of each int32
from .dequant import _fp16_hi as _half_hi
from .dequant import _fp16_lo as _half_lo
from .gemm_args import interpreting


@triton.jit
def _sh(w, S: tl.constexpr):
    """`w << S` for S >= 0, `w >> -S` otherwise (callers mask the bits they keep)."""
    if S >= 0:
        return w << S
    else:
        return w >> (-S)


@triton.jit
def _ldx(ptr, xm, EVEN_K: tl.constexpr, X_CG: tl.constexpr):
    """x values in fp32 (masked past K unless EVEN_K). X_CG: from L2 (x written by other CTAs of this launch)."""
    if X_CG:
        if EVEN_K:
            return tl.load(ptr, cache_modifier=".cg").to(tl.float32)
        else:
            return tl.load(ptr, mask=xm, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        if EVEN_K:
            return tl.load(ptr).to(tl.float32)
        else:
            return tl.load(ptr, mask=xm, other=0.0).to(tl.float32)


@triton.jit
def _word_dot(acc, words, s, z, x_row, kcol, k0, K_WORDS, c0, c1, FMT: tl.constexpr, HAS_ZERO: tl.constexpr,
              COMPUTE: tl.constexpr, VPW: tl.constexpr, EVEN_K: tl.constexpr, X_CG: tl.constexpr,
              ASM: tl.constexpr):  # fmt: skip
    """`acc [BN, KW]` plus, per word, the sum over its VPW values of weight * x (times the word's scale where
    the format has group scales; per-row and global factors are applied by `_row_scale` at the end); int4 and
    NVFP4: `acc [BN, KW / 2]` plus, per pair of words (one group / one scale), their sums times the scale. `k0`: the
    tile's first word column. Dense and fp8 read x through `[BN, KW]` pointers equal along the rows (the words'
    layout, no layout conversion); int4 and NVFP4 (8 values a word) load the tile's x once, contiguous, and
    split it in registers (`_x_split8`): on the H200 that halved the DeepSeek-like int4 GEMV at M=1. ASM
    (compiled, not the interpreter): NVFP4 decodes its words in PTX (`_e2m1_values`)."""
    if EVEN_K:  # noqa: SIM108 (constexpr branch)
        xm = None
    else:
        xm = kcol < K_WORDS
    xp = x_row + kcol * VPW
    if FMT == 0:
        x0 = _ldx(xp, xm, EVEN_K, X_CG)
        x1 = _ldx(xp + 1, xm, EVEN_K, X_CG)
        if COMPUTE == tl.bfloat16:
            acc += (words << 16).to(tl.float32, bitcast=True) * x0
            acc += (words & -65536).to(tl.float32, bitcast=True) * x1
        else:
            acc += _half_lo(words) * x0
            acc += _half_hi(words) * x1
    elif FMT == 1:
        acc = _int4_word_dot(acc, words, s, z, x_row, k0, K_WORDS, c0, c1, HAS_ZERO, EVEN_K, X_CG)
    elif FMT == 4:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_split8(x_row, k0, K_WORDS, words.shape[1], EVEN_K, X_CG)
        # the two words of a scale (columns 2c, 2c + 1) one FFMA chain of 16 products (`p += a * x` one value
        # at a time: a sum of two products per step cost an extra FMUL and FADD per pair; a chain per word, an
        # FMUL and an FADD per pair of words: 578 -> 570 loop instructions per 16 words), scaled once:
        # `acc [BN, KW / 2]`
        wa, wb = _halves(words)
        xs = (x0, x1, x2, x3, x4, x5, x6, x7)
        p = _e2m1_chain(None, wa, [_halves(x)[0] for x in xs], ASM)
        p = _e2m1_chain(p, wb, [_halves(x)[1] for x in xs], ASM)
        acc += s * p
    elif FMT == 3:
        p = tl.zeros(words.shape, dtype=tl.float32)
        for j in tl.static_range(2):
            bits = (_sh(words, 7 - 8 * j) & c0) | (_sh(words, 8 - 8 * j) & c1)
            p += _half_lo(bits) * _ldx(xp + j, xm, EVEN_K, X_CG)
            p += _half_hi(bits) * _ldx(xp + j + 2, xm, EVEN_K, X_CG)
        acc += s * p
    else:
        for j in tl.static_range(2):
            bits = (_sh(words, 7 - 8 * j) & c0) | (_sh(words, 8 - 8 * j) & c1)
            acc += _half_lo(bits) * _ldx(xp + j, xm, EVEN_K, X_CG)
            acc += _half_hi(bits) * _ldx(xp + j + 2, xm, EVEN_K, X_CG)
    return acc


@triton.jit
def _e2m1_pairs(words):
    """A word's eight e2m1 codes (code j at bits 4j..4j+3, sign at the top) as four int32 fp16 pairs,
    codes (0, 4), (1, 5), (2, 6), (3, 7) in (low, high) half: each code's 3 value bits at bits 9..11 of its
    half and its sign at bit 15, i.e. the fp16 of value / 16384 (exact: the values 0 and 0.5 are subnormals).

    11 integer operations a word (16 before): one rotate copies every sign 3 bits up (into the next code's
    field, or past bit 31 to bit 2); two selects build `ev`, whose bytes hold the even codes' value bits at
    0..2 and their sign copies at 6, and `od`, which holds the odd codes' value bits at 4..6 of each byte and
    their sign copies at 2 of the next byte (the last one's wrapped to byte 0); each pair is then one shift
    (a rotate for (3, 7)) and one mask."""
    u = words.to(tl.uint32, bitcast=True)
    r = (u << 3) | (u >> 29)  # rotate left by 3
    ev = (u & 0x0F0F0F0F) | (r & 0xF0F0F0F0)
    od = (u & 0xF0F0F0F0) | (r & 0x0F0F0F0F)
    m = 0x8E008E00  # bits 9..11 and 15 of each half
    b04 = (ev << 9) & m
    b15 = (od << 5) & m
    b26 = (ev << 1) & m
    b37 = ((od >> 3) | (od << 29)) & m  # rotate right by 3
    return (b04.to(tl.int32, bitcast=True), b15.to(tl.int32, bitcast=True), b26.to(tl.int32, bitcast=True),
            b37.to(tl.int32, bitcast=True))  # fmt: skip


def e2m1_ptx(word: str, use_pair: Callable[[int], list[str]]) -> str:
    """`_e2m1_pairs` of the 32-bit register `word` as PTX lines: the pair of codes (j, j + 4) of j = 0..3 lands
    in register `t` as fp16x2 `value / 2^14`, and `use_pair(j)` gives the lines that consume it (they must not
    write `ev`, `od` or `t`). The selects are one `lop3` each (from Triton's ops the compiler made two of each).
    Shared by the fp32 word dot's decode (`_E2M1_ASM`) and the half dot's (`gemv_half._E2M1_HFMA_ASM`)."""
    pairs = ("shl.b32 t, ev, 9;", "shl.b32 t, od, 5;", "shl.b32 t, ev, 1;", "shf.r.wrap.b32 t, od, od, 3;")
    lines = [
        f"shf.l.wrap.b32 r, {word}, {word}, 3;",
        f"lop3.b32 ev, {word}, r, 0x0F0F0F0F, 0xE4;",
        f"lop3.b32 od, r, {word}, 0x0F0F0F0F, 0xE4;",
    ]
    for j, shift in enumerate(pairs):
        lines += [shift, "and.b32 t, t, 0x8E008E00;", *use_pair(j)]
    return "\n".join(lines)


def _cvt_pair(j: int) -> list[str]:
    """Pair j's halves converted to fp32 outputs `$j` (code j) and `$(j + 4)` (code j + 4)."""
    return ["mov.b32 {l, h}, t;", f"cvt.f32.f16 ${j}, l;", f"cvt.f32.f16 ${j + 4}, h;"]


# `_e2m1_pairs` in PTX, each pair's halves converted one `cvt` each (from Triton's casts the compiler first
# repacked halves of different registers: 64 PRMT per 16 words in the NVFP4 GEMV's loop; Triton 3.6, sm_90).
_E2M1_ASM = tl.constexpr("{\n.reg .b32 r, ev, od, t;\n.reg .b16 l, h;\n" + e2m1_ptx("$8", _cvt_pair) + "\n}")


@triton.jit
def _e2m1_values(words, ASM: tl.constexpr):
    """A word's eight e2m1 codes as eight fp32 `value / 16384` (`_e2m1_pairs`, each half converted). ASM
    (compiled, not the interpreter): the same operations in PTX (`_E2M1_ASM`)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1
        )
    else:
        b04, b15, b26, b37 = _e2m1_pairs(words)
        return (_half_lo(b04), _half_lo(b15), _half_lo(b26), _half_lo(b37), _half_hi(b04), _half_hi(b15),
                _half_hi(b26), _half_hi(b37))  # fmt: skip


@triton.jit
def _e2m1_chain(p, words, xs, ASM: tl.constexpr):
    """`p` (None: 0) plus the sum over each word's eight values of value * x, one FFMA each."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _e2m1_values(words, ASM)
    if p is None:
        p = v0 * xs[0][None, :]
    else:
        p += v0 * xs[0][None, :]
    p += v4 * xs[4][None, :]
    p += v1 * xs[1][None, :]
    p += v5 * xs[5][None, :]
    p += v2 * xs[2][None, :]
    p += v6 * xs[6][None, :]
    p += v3 * xs[3][None, :]
    p += v7 * xs[7][None, :]
    return p


@triton.jit
def _x_split8(x_row, k0, K_WORDS, KW: tl.constexpr, EVEN_K: tl.constexpr, X_CG: tl.constexpr):
    """The x values of a tile of KW 8-value words starting at word k0, as eight fp32 `[KW]` vectors (vector j:
    value j of each word): one contiguous load, split in registers (one small layout change per tile instead of
    a load per value and row)."""
    offs = k0 * 8 + tl.arange(0, KW * 8)
    if EVEN_K:  # noqa: SIM108 (constexpr branch)
        xm = None
    else:
        xm = offs < K_WORDS * 8
    # value 8c + 4a + 2b + d of the tile at [c, a, b, d]; each split takes the last axis apart
    xt = tl.reshape(_ldx(x_row + offs, xm, EVEN_K, X_CG), (KW, 2, 2, 2))
    xa0, xa1 = tl.split(xt)  # d = 0, 1
    x0, x4 = tl.split(tl.split(xa0)[0])  # (b, d) = (0, 0): a = 0, 1 -> values 0, 4
    x2, x6 = tl.split(tl.split(xa0)[1])
    x1, x5 = tl.split(tl.split(xa1)[0])
    x3, x7 = tl.split(tl.split(xa1)[1])
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_word_dot(acc, words, s, z, x_row, k0, K_WORDS, c0, c1, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                   X_CG: tl.constexpr):  # fmt: skip
    """int4 `_word_dot`. Weights: nibbles 2i and 2i + 1 of a word are shifted together (by 12, 4, -4, -12 bits)
    to bits 12..15 and 16..19, where one LOP3 each (`& mask | exponent`) makes the fp32 `2048 + q` and
    `128 + q` (the nibble is the low bits of the integer part: exact); a word costs 4 shifts, 8 LOP3 and 8 FMA
    for its 8 values. x: the tile's `8 * KW` values in one contiguous load, split in registers into the eight
    `[KW]` vectors of value j of each word (one small layout change per tile instead of a load per value);
    the two words of a pair (2c, 2c + 1: one group, as groups are whole multiples of 4 words) are one FFMA chain,
    started from minus their offsets and zero point, `p = -(2048 sum_even x + 128 sum_odd x) - z sum x` (sums
    per pair column, shared by the thread's rows), and scaled once: 16 products per FFMA of the scale, and no
    FADD per word (Triton 3.6, sm_90: 482 -> 458 instructions per 16 words). The products are exact in fp32
    (bf16 x times a 12-bit integer); a pair's sum rounds at ~2^-24 of 2^15 |x|."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_split8(x_row, k0, K_WORDS, words.shape[1], EVEN_K, X_CG)
    # adjacent words (2c, 2c + 1) share a group: one chain of 16 products each, `acc [BN, KW / 2]`
    wa, wb = _halves(words)
    x0a, x0b = _halves(x0)
    x1a, x1b = _halves(x1)
    x2a, x2b = _halves(x2)
    x3a, x3b = _halves(x3)
    x4a, x4b = _halves(x4)
    x5a, x5b = _halves(x5)
    x6a, x6b = _halves(x6)
    x7a, x7b = _halves(x7)
    x_even = ((x0a + x2a) + (x4a + x6a)) + ((x0b + x2b) + (x4b + x6b))
    x_odd = ((x1a + x3a) + (x5a + x7a)) + ((x1b + x3b) + (x5b + x7b))
    # the chain starts from minus the offsets (and the zero point): its first product is an FFMA, and no FADD
    # takes them off afterwards
    if HAS_ZERO:
        p = -(x_even * 2048.0 + x_odd * 128.0)[None, :] - _pair_first(z) * (x_even + x_odd)[None, :]
    else:  # symmetric: the zero point 8 folded into the offsets
        p = tl.broadcast_to(-(x_even * 2056.0 + x_odd * 136.0)[None, :], wa.shape)
    p = _int4_chain(p, wa, c0, c1, x0a, x1a, x2a, x3a, x4a, x5a, x6a, x7a)
    p = _int4_chain(p, wb, c0, c1, x0b, x1b, x2b, x3b, x4b, x5b, x6b, x7b)
    return acc + _pair_first(s) * p


@triton.jit
def _halves(t):
    """Columns 2c and 2c + 1 of `t [..., W]` as two `[..., W / 2]` (in the thread's registers)."""
    if len(t.shape) == 1:
        return tl.split(tl.reshape(t, (t.shape[0] // 2, 2)))
    else:
        return tl.split(tl.reshape(t, (t.shape[0], t.shape[1] // 2, 2)))


@triton.jit
def _pair_first(t):
    """`t [BN, KW]` per word -> `[BN, KW / 2]` (the first word's of each pair); `[BN, 1]` unchanged."""
    if t.shape[1] == 1:
        return t
    else:
        return _halves(t)[0]


@triton.jit
def _int4_chain(p, words, c0, c1, x0, x1, x2, x3, x4, x5, x6, x7):
    """`p + sum_j (2048 + q_2i or 128 + q_2i+1) x_j` over a word's 8 values, one FFMA each."""
    m_hi = c0 << 4  # nibble field at bits 16..19
    e_hi = c1 - 33554432  # exponent of 128.0 (c1: of 2048.0)
    t = words << 12
    p += ((t & c0) | c1).to(tl.float32, bitcast=True) * x0[None, :]
    p += ((t & m_hi) | e_hi).to(tl.float32, bitcast=True) * x1[None, :]
    t = words << 4
    p += ((t & c0) | c1).to(tl.float32, bitcast=True) * x2[None, :]
    p += ((t & m_hi) | e_hi).to(tl.float32, bitcast=True) * x3[None, :]
    t = words >> 4
    p += ((t & c0) | c1).to(tl.float32, bitcast=True) * x4[None, :]
    p += ((t & m_hi) | e_hi).to(tl.float32, bitcast=True) * x5[None, :]
    t = words >> 12
    p += ((t & c0) | c1).to(tl.float32, bitcast=True) * x6[None, :]
    p += ((t & m_hi) | e_hi).to(tl.float32, bitcast=True) * x7[None, :]
    return p


@triton.jit
def _e2m1_decode_kernel(words_ptr, out_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """`out[i, j]` = value j of word i / 16384 for the BLOCK words of this program (`e2m1_decode`)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    values = _e2m1_values(tl.load(words_ptr + offs, mask=ok, other=0), ASM)
    for j in tl.static_range(8):
        tl.store(out_ptr + offs * 8 + j, values[j], mask=ok)


# words per program of the decode test kernel (any power of two; 128 = 4 warps' lanes)
E2M1_DECODE_BLOCK = 128


def e2m1_decode(words: torch.Tensor, asm: bool | None = None) -> torch.Tensor:
    """The NVFP4 GEMV's word decode alone (for tests): `words [N]` int32, contiguous, eight e2m1 codes each
    (code j at bits 4j..4j+3) -> `[N, 8]` fp32, value j / 16384. `asm`: the PTX form (default: compiled, i.e.
    not under the interpreter, which cannot run it). N may be 0."""
    assert words.dim() == 1 and words.dtype == torch.int32 and words.is_contiguous(), (
        f"words: {tuple(words.shape)} {words.dtype}, contiguous={words.is_contiguous()}; want [N] int32"
    )
    assert words.numel() < 2**28, f"{words.numel()} words: int32 offsets of the [N, 8] output need N < 2^28"
    asm = not interpreting() if asm is None else asm
    assert not (asm and interpreting()), "the PTX form does not run under TRITON_INTERPRET=1"
    out = torch.empty((words.numel(), 8), dtype=torch.float32, device=words.device)
    if words.numel():
        grid = (triton.cdiv(words.numel(), E2M1_DECODE_BLOCK),)
        _e2m1_decode_kernel[grid](words, out, words.numel(), ASM=asm, BLOCK=E2M1_DECODE_BLOCK)
    return out


def e2m1_decode_ref(words: torch.Tensor) -> torch.Tensor:
    """`e2m1_decode` in torch: each code looked up in the format's e2m1 table, divided by 16384."""
    from pooled_runner.formats.quant import E2M1_VALUES

    table = torch.tensor(E2M1_VALUES, device=words.device)
    table = torch.cat([table, -table]) / 16384.0
    codes = (words.to(torch.int64)[:, None] >> (4 * torch.arange(8, device=words.device))[None, :]) & 15
    return table[codes]
