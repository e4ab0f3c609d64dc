"""GEMV decode path, the shared `@triton.jit` tiles (`gemv.py` has the kernels, launchers and the why): pair
slots, packed-word loads, per-format word dot products, the gate_up and down tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from .dequant import e4m3_to_f32
from .moe_gemm import _row_bases


# ---- jit helpers ----------------------------------------------------------------------------------------------
@triton.jit
def _sh(w, S: tl.constexpr):
    """`w << S` for S >= 0, `w >> -S` otherwise (callers mask the bits they keep)."""
    if S >= 0:
        return w << S
    else:
        return w >> (-S)


@triton.jit
def _half_lo(bits):
    """fp32 of the fp16 in the low half of each int32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half_hi(bits):
    """fp32 of the fp16 in the high half of each int32."""
    return (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


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
def _slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2: tl.constexpr):
    """(pair, code) of schedule slot `slot`: host pairs first, then pool pairs, each by (expert, pair); pairs
    not routed here (id -1, id >= E or code -1) last with code -1. A permutation of the pairs (a bitonic sort
    of P_POW2 keys in registers, then the slot-th key)."""
    p = tl.arange(0, P_POW2)
    e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    ok = (e >= 0) & (e < num_experts)
    codes = tl.where(ok, tl.load(l2p_ptr + e, mask=ok, other=-1), -1)
    cls = tl.where(codes >= num_rows, 0, tl.where(codes >= 0, 1, 2))
    key = (cls * (num_experts + 1) + tl.where(cls == 2, 0, e)) * P_POW2 + p
    key = tl.where(p < num_pairs, key, 2147483647)
    mine = tl.sum(tl.where(p == slot, tl.sort(key), 0), axis=0)
    pair = mine % P_POW2
    e_mine = tl.load(ids_ptr + pair).to(tl.int32)
    ok_mine = (e_mine >= 0) & (e_mine < num_experts)
    code = tl.where(ok_mine, tl.load(l2p_ptr + e_mine, mask=ok_mine, other=-1), -1)
    return pair, code


@triton.jit
def _load_words(w_base, s_base, z_base, n2, nmask2, kcol, k0, K_WORDS, w_sn, s_sn, z_sn,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """One tile: the packed words `[BN, KW]` at word columns `kcol` (the first is `k0`) and, per word, its fp32
    scale and zero point (int4, NVFP4, fp8 blocks; a word never straddles a group). int4 tiles inside one group
    (GROUP a multiple of the tile's values) load one scale and zero point per row, `[BN, 1]`; tiles of two
    groups two per row, selected per word. Masked past N (and
    past K unless EVEN_K: a mask that varies along K would split the 16-byte loads and keep repeated loads apart)."""
    if EVEN_K:  # noqa: SIM108 (constexpr branch)
        m = tl.broadcast_to(nmask2, kcol.shape)
    else:
        m = nmask2 & (kcol < K_WORDS)
    words = tl.load(w_base + n2 * w_sn + kcol, mask=m, other=0)
    if FMT == 1:
        TILE_VALUES: tl.constexpr = kcol.shape[1] * 8
        if tl.constexpr(GROUP) % TILE_VALUES == 0:
            # the tile lies in one group (K is a multiple of GROUP, so EVEN_K): one group index per row
            s, z = _row_group_scales(s_base, z_base, n2, nmask2, (k0 * 8) // GROUP, s_sn, z_sn, HAS_ZERO)
        elif TILE_VALUES == 2 * GROUP and EVEN_K:
            # two groups per row: one load each per row, the word's picked by a select (a per-word load of
            # the same two addresses made K tiles of 256 three times slower on the H200)
            g = (k0 * 8) // GROUP
            s0, z0 = _row_group_scales(s_base, z_base, n2, nmask2, g, s_sn, z_sn, HAS_ZERO)
            s1, z1 = _row_group_scales(s_base, z_base, n2, nmask2, g + 1, s_sn, z_sn, HAS_ZERO)
            second = (kcol - k0) >= GROUP // 8
            s = tl.where(second, s1, s0)
            z = tl.where(second, z1, z0)
        else:
            g = (kcol * 8) // GROUP
            s = tl.load(s_base + n2 * s_sn + g, mask=m, other=0.0).to(tl.float32)
            if HAS_ZERO:  # noqa: SIM108 (constexpr branch)
                z = tl.load(z_base + n2 * z_sn + g, mask=m, other=0).to(tl.float32)
            else:
                z = s
    elif FMT == 4:
        # fp8 loads take no `other` (see dequant.py): zero after decoding
        s = tl.where(m, e4m3_to_f32(tl.load(s_base + n2 * s_sn + kcol // 2, mask=m), NATIVE_FP8), 0.0)
        z = s
    elif FMT == 3:
        s = tl.load(s_base + (n2 // GROUP) * s_sn + (kcol * 4) // GROUP, mask=m, other=0.0)
        z = s
    else:
        s = words
        z = words
    return words, s, z


@triton.jit
def _row_group_scales(s_base, z_base, n2, nmask2, g, s_sn, z_sn, HAS_ZERO: tl.constexpr):
    """fp32 scale and zero point `[BN, 1]` of group `g` of each row (the scale again without zero points)."""
    s = tl.load(s_base + n2 * s_sn + g, mask=nmask2, other=0.0).to(tl.float32)
    if HAS_ZERO:  # noqa: SIM108 (constexpr branch)
        z = tl.load(z_base + n2 * z_sn + g, mask=nmask2, other=0).to(tl.float32)
    else:
        z = s
    return s, z


@triton.jit
def _word_dot(acc, words, s, z, x_row, kcol, k0, K_WORDS, c0, c1, FMT: tl.constexpr, HAS_ZERO: tl.constexpr,
              COMPUTE: tl.constexpr, VPW: tl.constexpr, EVEN_K: tl.constexpr, X_CG: tl.constexpr):  # fmt: skip
    """`acc [BN, KW]` plus, per word, the sum over its VPW values of weight * x (times the word's scale where
    the format has group scales; per-row and global factors are applied by `_row_scale` at the end). `k0`: the
    tile's first word column. Dense and fp8 read x through `[BN, KW]` pointers equal along the rows (the words'
    layout, no layout conversion); int4 and NVFP4 (8 values a word) load the tile's x once, contiguous, and
    split it in registers (`_x_split8`): on the H200 that halved the DeepSeek-like int4 GEMV at M=1."""
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
        bits = (_sh(words, 9) & c0) | (_sh(words, 12) & c1)
        p = _half_lo(bits) * x0[None, :] + _half_hi(bits) * x4[None, :]
        bits = (_sh(words, 5) & c0) | (_sh(words, 8) & c1)
        p += _half_lo(bits) * x1[None, :] + _half_hi(bits) * x5[None, :]
        bits = (_sh(words, 1) & c0) | (_sh(words, 4) & c1)
        p += _half_lo(bits) * x2[None, :] + _half_hi(bits) * x6[None, :]
        bits = (_sh(words, -3) & c0) | (_sh(words, 0) & c1)
        p += _half_lo(bits) * x3[None, :] + _half_hi(bits) * x7[None, :]
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
    the offsets and the zero point come off once per word, `p - (2048 sum_even x + 128 sum_odd x) - z sum x`,
    the sums formed per word column and shared by the thread's rows. The products are exact in fp32 (bf16 x
    times a 12-bit integer); a word's sum rounds at ~2^-24 of 2^14 |x|."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_split8(x_row, k0, K_WORDS, words.shape[1], EVEN_K, X_CG)
    m_hi = c0 << 4  # nibble field at bits 16..19
    e_hi = c1 - 33554432  # exponent of 128.0 (c1: of 2048.0)
    t = words << 12
    p = ((t & c0) | c1).to(tl.float32, bitcast=True) * x0[None, :]
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
    x_even = (x0 + x2) + (x4 + x6)
    x_odd = (x1 + x3) + (x5 + x7)
    if HAS_ZERO:
        offset = (x_even * 2048.0 + x_odd * 128.0)[None, :]
        return acc + s * (p - offset - z * (x_even + x_odd)[None, :])
    else:  # symmetric: the zero point 8 folded into the offsets
        return acc + s * (p - (x_even * 2056.0 + x_odd * 136.0)[None, :])


@triton.jit
def _row_scale(total, s_base, g_base, offs_n, n_ok, FMT: tl.constexpr):
    """Per-row and global factors of a row's fp32 sum: NVFP4 `2^14 * global`, fp8 `2^8` (and the channel scale)."""
    if FMT == 4:
        total = total * (tl.load(g_base) * 16384.0)
    elif FMT == 3:
        total = total * 256.0
    elif FMT == 2:
        total = total * (tl.load(s_base + offs_n, mask=n_ok, other=0.0) * 256.0)
    return total


@triton.jit
def _rows_dot(w_base, s_base, z_base, g_base, x_row, offs_n, n_ok, K, kw_lo, kw_hi, w_sn, s_sn, z_sn, c0, c1,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, VPW: tl.constexpr,
              PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, X_CG: tl.constexpr):  # fmt: skip
    """`[BLOCK_N]` fp32: rows `offs_n` of one projection row (weights at `w_base`) dotted with x over the word
    columns `[kw_lo, kw_hi)` of K (`kw_lo` a multiple of the tile's words; 0 and K / VPW for all of K)."""
    KW: tl.constexpr = BLOCK_K // VPW
    K_WORDS = K // VPW
    zero2 = (offs_n * 0)[:, None]
    n2 = offs_n[:, None]
    nmask2 = n_ok[:, None]
    kw = tl.arange(0, KW)[None, :] + zero2
    acc = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    # PREFETCH 1: the next tile in registers; 0: none; >= 2: Triton's software pipeline with that many stages
    if PREFETCH == 1:
        words, s, z = _load_words(w_base, s_base, z_base, n2, nmask2, kw + kw_lo, kw_lo, K_WORDS, w_sn, s_sn,
                                  z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
        for k0 in range(kw_lo, kw_hi, KW):
            kcol = kw + k0
            # with EVEN_K the last prefetch re-reads the last tile (cached) instead of masking
            if EVEN_K:  # noqa: SIM108 (constexpr branch)
                nk0 = tl.minimum(k0 + KW, kw_hi - KW)
            else:
                nk0 = k0 + KW
            nw, ns, nz = _load_words(w_base, s_base, z_base, n2, nmask2, kw + nk0, nk0, K_WORDS, w_sn, s_sn, z_sn,
                                     FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
            acc = _word_dot(
                acc, words, s, z, x_row, kcol, k0, K_WORDS, c0, c1, FMT, HAS_ZERO, COMPUTE, VPW, EVEN_K, X_CG
            )
            words, s, z = nw, ns, nz
    else:
        STAGES: tl.constexpr = PREFETCH if PREFETCH >= 2 else 1
        for k0 in tl.range(kw_lo, kw_hi, KW, num_stages=STAGES):
            kcol = kw + k0
            words, s, z = _load_words(w_base, s_base, z_base, n2, nmask2, kcol, k0, K_WORDS, w_sn, s_sn, z_sn,
                                      FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
            acc = _word_dot(
                acc, words, s, z, x_row, kcol, k0, K_WORDS, c0, c1, FMT, HAS_ZERO, COMPUTE, VPW, EVEN_K, X_CG
            )
    return _row_scale(tl.sum(acc, axis=1), s_base, g_base, offs_n, n_ok, FMT)


@triton.jit
def _gate_up_tile(
    slot, nb, split, tiles_per_split, x_ptr, act_ptr, part_ptr, cnt_ptr, ids_ptr, l2p_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_experts, num_rows, I, H, stride_x, stride_act, c0, c1,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """`act[pair, nb block]` of schedule slot `slot` (nothing for a pair not routed here); returns the pair.

    SPLIT > 1: this program sums K tiles `[split, split + 1) * tiles_per_split` only and stores its fp32 gate/up
    sums to `part_ptr` (`[pairs, N blocks, SPLIT, 2 * BLOCK_N]`); the last of the SPLIT arrivals at the (pair, N
    block) counter sums the parts in split order (deterministic) and stores act. More programs per SM for the
    same rows per thread (the x split is paid per tile and thread, whatever the rows)."""
    pair, code = _slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2)
    if code >= 0:
        w_base, s_base, z_base, g_base = _row_bases(
            code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
        )
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
        # gate row i and up row i interleaved: one loop over K for both, each x value serving twice the rows
        r = tl.arange(0, 2 * BLOCK_N)
        n_local = nb * BLOCK_N + r // 2
        KW: tl.constexpr = BLOCK_K // VPW
        if SPLIT == 1:
            kw_lo = 0
            kw_hi = H // VPW
        else:
            kw_lo = split * tiles_per_split * KW
            kw_hi = tl.minimum(kw_lo + tiles_per_split * KW, H // VPW)
        gu = _rows_dot(w_base, s_base, z_base, g_base, x_row, n_local + (r % 2) * I, n_local < I, H, kw_lo, kw_hi,
                       w_sn, s_sn, z_sn, c0, c1, 2 * BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE,
                       VPW, PREFETCH, EVEN_K, False)  # fmt: skip
        act_row = act_ptr + pair.to(tl.int64) * stride_act
        if SPLIT == 1:
            _store_act(gu, act_row, nb, I, BLOCK_N, COMPUTE)
        else:
            blk = pair * tl.cdiv(I, BLOCK_N) + nb
            part = part_ptr + blk.to(tl.int64) * (SPLIT * 2 * BLOCK_N) + r
            tl.store(part + split * (2 * BLOCK_N), gu)
            # every thread's part stores before the (one-thread, release) arrival; the last arrival (acquire)
            # reads the SPLIT parts from L2
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.store(cnt_ptr + blk, 0)  # ready for the next launch
                total = tl.load(part, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    total += tl.load(part + s * (2 * BLOCK_N), cache_modifier=".cg")
                _store_act(total, act_row, nb, I, BLOCK_N, COMPUTE)
    return pair


@triton.jit
def _store_act(gu, act_row, nb, I, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """act of an N block from its interleaved fp32 gate/up sums `[2 * BLOCK_N]`, as `gemm1` rounds it."""
    gate, up = tl.split(tl.reshape(gu, (BLOCK_N, 2)))
    gate = gate.to(COMPUTE).to(tl.float32)
    up = up.to(COMPUTE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_row + offs_n, act, mask=offs_n < I)


@triton.jit
def _down_tile(
    pair, code, nb, act_ptr, y_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_experts, num_rows, H, I, stride_act, stride_y, stride_out, c0, c1,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, FUSE_COMBINE: tl.constexpr,
    EVEN_K: tl.constexpr, X_CG: tl.constexpr,
):  # fmt: skip
    """`y[pair, nb block]` (a pair routed here) and, with FUSE_COMBINE, the arrival of this (pair, block): the
    last of the token's K arrivals sums `out[t, nb block]`."""
    num_nb = tl.cdiv(H, BLOCK_N)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if code >= 0:
        w_base, s_base, z_base, g_base = _row_bases(
            code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
        )
        x_row = act_ptr + pair.to(tl.int64) * stride_act
        y = _rows_dot(w_base, s_base, z_base, g_base, x_row, offs_n, n_ok, I, 0, I // VPW, w_sn, s_sn, z_sn, c0, c1,
                      BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH,
                      EVEN_K, X_CG)  # fmt: skip
        tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, y.to(COMPUTE), mask=n_ok)
    if FUSE_COMBINE:
        t = pair // TOP_K
        # every thread's y stores happen before the (one-thread, release) arrival; the last of the token's K
        # arrivals (acquire) sums the K rows of y, read from L2
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + t * num_nb + nb, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            tl.store(cnt_ptr + t * num_nb + nb, 0)  # ready for the next launch
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k in tl.static_range(TOP_K):
                pk = t * TOP_K + k
                e = tl.load(ids_ptr + pk).to(tl.int32)
                routed = (e >= 0) & (e < num_experts)
                routed = routed & (tl.load(l2p_ptr + e, mask=routed, other=-1) >= 0)
                wk = tl.load(tw_ptr + pk).to(tl.float32)
                yk = tl.load(y_ptr + pk.to(tl.int64) * stride_y + offs_n, mask=n_ok & routed, other=0.0,
                             cache_modifier=".cg").to(tl.float32)  # fmt: skip
                acc += tl.where(routed, wk * yk, 0.0)
            tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_n, acc.to(COMPUTE), mask=n_ok)
