"""GEMV decode path, the shared `@triton.jit` tiles (`gemv.py` has the kernels, launchers and the why; the pair
schedule is `gemv_schedule.py`): packed-word loads, the rows' dot over K, the gate_up and down tiles (the per-format word dot products
are in `gemv_words.py`)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .dequant import e4m3_to_f32
from .gemm_parts import _row_bases
from .gemv_combine import _arrive_and_combine
from .gemv_half import (
    INT4_TOP,
    NVFP4_TOP,
    X_PACK_CHUNK_WORDS,
    int4_half_dot,
    nvfp4_half_dot,
    x_half_pack,
    x_half_scale,
)
from .gemv_words import _halves, _word_dot


@triton.jit
def _load_words(w_base, s_base, z_base, n2, kcol, k0, K_WORDS, w_sn, s_sn, z_sn,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """One tile: the packed words `[BN, KW]` at word columns `kcol` (the first is `k0`) and, per word, its fp32
    scale and zero point (int4, fp8 blocks; a word never straddles a group); NVFP4: its `[BN, KW / 2]` scales,
    one per two words, loaded contiguous (a byte load per word made its GEMV 2x slower). int4 tiles inside one group
    (GROUP a multiple of the tile's values) load one scale and zero point per row, `[BN, 1]`; tiles of two
    groups two per row, selected per word. Rows `n2` are in bounds (`_rows_dot` clamps those past N), so the loads
    are masked only past K, and only unless EVEN_K: a mask that varies along K would split the 16-byte loads and
    keep repeated loads apart; without the row mask NVFP4's loop went from 752 to 707 instructions (predicates,
    zeroing of masked bytes; Triton 3.6, sm_90)."""
    m = kcol < K_WORDS  # used only without EVEN_K
    words = _load_k(w_base + n2 * w_sn + kcol, m, 0, EVEN_K)
    if FMT == 1:
        TILE_VALUES: tl.constexpr = kcol.shape[1] * 8
        if tl.constexpr(GROUP) % TILE_VALUES == 0:
            # the tile lies in one group (K is a multiple of GROUP, so EVEN_K): one group index per row
            s, z = _row_group_scales(s_base, z_base, n2, (k0 * 8) // GROUP, s_sn, z_sn, HAS_ZERO)
        elif TILE_VALUES == 2 * GROUP and EVEN_K:
            # two groups per row: one load each per row, the word's picked by a select (a per-word load of
            # the same two addresses made K tiles of 256 three times slower on the H200)
            g = (k0 * 8) // GROUP
            s0, z0 = _row_group_scales(s_base, z_base, n2, g, s_sn, z_sn, HAS_ZERO)
            s1, z1 = _row_group_scales(s_base, z_base, n2, g + 1, s_sn, z_sn, HAS_ZERO)
            second = (kcol - k0) >= GROUP // 8
            s = tl.where(second, s1, s0)
            z = tl.where(second, z1, z0)
        else:
            g = (kcol * 8) // GROUP
            s = _load_k(s_base + n2 * s_sn + g, m, 0.0, EVEN_K).to(tl.float32)
            if HAS_ZERO:  # noqa: SIM108 (constexpr branch)
                z = _load_k(z_base + n2 * z_sn + g, m, 0, EVEN_K).to(tl.float32)
            else:
                z = s
    elif FMT == 4:
        # one e4m3 scale per two words: `[BN, KW / 2]`, contiguous per row (16 bytes of a tile of 32 words);
        # fp8 loads take no `other` (see dequant.py): zero after decoding
        scol = k0 // 2 + tl.arange(0, kcol.shape[1] // 2)[None, :] + (n2 * 0)
        if EVEN_K:
            s = e4m3_to_f32(tl.load(s_base + n2 * s_sn + scol), NATIVE_FP8)
        else:
            sm = scol < K_WORDS // 2
            s = tl.where(sm, e4m3_to_f32(tl.load(s_base + n2 * s_sn + scol, mask=sm), NATIVE_FP8), 0.0)
        z = s
    elif FMT == 3:
        s = _load_k(s_base + (n2 // GROUP) * s_sn + (kcol * 4) // GROUP, m, 0.0, EVEN_K)
        z = s
    else:
        s = words
        z = words
    return words, s, z


@triton.jit
def _load_k(ptrs, m, other, EVEN_K: tl.constexpr):
    """`ptrs` loaded, masked by `m` (past K) unless EVEN_K."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=m, other=other)


@triton.jit
def _row_group_scales(s_base, z_base, n2, g, s_sn, z_sn, HAS_ZERO: tl.constexpr):
    """fp32 scale and zero point `[BN, 1]` of group `g` of each row (the scale again without zero points)."""
    s = tl.load(s_base + n2 * s_sn + g).to(tl.float32)
    if HAS_ZERO:  # noqa: SIM108 (constexpr branch)
        z = tl.load(z_base + n2 * z_sn + g).to(tl.float32)
    else:
        z = s
    return s, z


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
def _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, offs_n, n_ok, K, kw_lo, kw_hi, w_sn, s_sn, z_sn,
              c0, c1, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr, COMPUTE: tl.constexpr, VPW: tl.constexpr,
              PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, X_CG: tl.constexpr, HALF_X: tl.constexpr,
              X_PACK: tl.constexpr, PEEL: tl.constexpr = False, PDL_WAIT: tl.constexpr = False):  # fmt: skip
    """`[BLOCK_N]` fp32: rows `offs_n` of one projection row (weights at `w_base`) dotted with x over the word
    columns `[kw_lo, kw_hi)` of K (`kw_lo` a multiple of the tile's words; 0 and K / VPW for all of K).
    HALF_X > 0 (NVFP4 and int4): the word dot in packed half math (`gemv_half`), x's row scale found HALF_X values
    at a time; X_PACK: x' written once as fp16x2 pairs to `xp_row` (int32, 4 per word) and loaded by the K loop.
    PEEL (PREFETCH != 1, one tile at least): the first tile's loads are issued before anything reads x (its row
    scale), and PDL_WAIT waits for the kernel before (`pdl.wait`) after them, so the first weights stream in
    while x is found (down: while gate_up ends)."""
    KW: tl.constexpr = BLOCK_K // VPW
    K_WORDS = K // VPW
    zero2 = (offs_n * 0)[:, None]
    # rows past N read the block's first row (in bounds: every block has one) instead of a mask per load; their
    # sums are never stored
    n2 = tl.where(n_ok, offs_n, tl.min(offs_n, axis=0))[:, None]
    kw = tl.arange(0, KW)[None, :] + zero2
    # NVFP4 and int4: one accumulator per pair of words (a scale / a group), the others one per word
    ACC_W: tl.constexpr = KW // 2 if (FMT == 4 or FMT == 1) else KW
    acc = tl.zeros((BLOCK_N, ACC_W), dtype=tl.float32)
    tl.static_assert(HALF_X == 0 or FMT == 4 or FMT == 1, "the packed half word dot is NVFP4's and int4's")
    tl.static_assert(not PEEL or PREFETCH != 1, "the register prefetch loads the first tile itself")
    if PEEL:
        words0, s0, z0 = _load_words(w_base, s_base, z_base, n2, kw + kw_lo, kw_lo, K_WORDS, w_sn, s_sn, z_sn,
                                     FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
        pdl.wait(PDL_WAIT)
    if HALF_X > 0:
        # the scale of the x values this program reads (its K share with split K)
        xscale, xinv = x_half_scale(
            x_row, kw_lo * VPW, kw_hi * VPW, X_CG, HALF_X, NVFP4_TOP if FMT == 4 else INT4_TOP
        )
        if X_PACK:
            x_half_pack(x_row, xp_row, kw_lo, kw_hi, xscale, X_CG, X_PACK_CHUNK_WORDS, NATIVE_FP8)
    else:
        xscale = 1.0
    # PREFETCH 1: the next tile in registers; 0: none; >= 2: Triton's software pipeline with that many stages
    if PREFETCH == 1:
        words, s, z = _load_words(w_base, s_base, z_base, n2, kw + kw_lo, kw_lo, K_WORDS, w_sn, s_sn,
                                  z_sn, FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
        for k0 in range(kw_lo, kw_hi, KW):
            kcol = kw + k0
            # with EVEN_K the last prefetch re-reads the last tile (cached) instead of masking
            if EVEN_K:  # noqa: SIM108 (constexpr branch)
                nk0 = tl.minimum(k0 + KW, kw_hi - KW)
            else:
                nk0 = k0 + KW
            nw, ns, nz = _load_words(w_base, s_base, z_base, n2, kw + nk0, nk0, K_WORDS, w_sn, s_sn, z_sn,
                                     FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
            # NATIVE_FP8 (compiled for CUDA, not the interpreter) is also what allows NVFP4's PTX word decode
            acc = _tile_dot(acc, words, s, z, x_row, xp_row, kcol, k0, K_WORDS, c0, c1, xscale, FMT, HAS_ZERO,
                            COMPUTE, VPW, EVEN_K, X_CG, NATIVE_FP8, HALF_X > 0, X_PACK)  # fmt: skip
            words, s, z = nw, ns, nz
    else:
        STAGES: tl.constexpr = PREFETCH if PREFETCH >= 2 else 1
        start = kw_lo
        if PEEL:
            acc = _tile_dot(acc, words0, s0, z0, x_row, xp_row, kw + kw_lo, kw_lo, K_WORDS, c0, c1, xscale, FMT,
                            HAS_ZERO, COMPUTE, VPW, EVEN_K, X_CG, NATIVE_FP8, HALF_X > 0, X_PACK)  # fmt: skip
            start = kw_lo + KW
        for k0 in tl.range(start, kw_hi, KW, num_stages=STAGES):
            kcol = kw + k0
            words, s, z = _load_words(w_base, s_base, z_base, n2, kcol, k0, K_WORDS, w_sn, s_sn, z_sn,
                                      FMT, GROUP, HAS_ZERO, NATIVE_FP8, EVEN_K)  # fmt: skip
            # NATIVE_FP8 (compiled for CUDA, not the interpreter) is also what allows NVFP4's PTX word decode
            acc = _tile_dot(acc, words, s, z, x_row, xp_row, kcol, k0, K_WORDS, c0, c1, xscale, FMT, HAS_ZERO,
                            COMPUTE, VPW, EVEN_K, X_CG, NATIVE_FP8, HALF_X > 0, X_PACK)  # fmt: skip
    total = tl.sum(acc, axis=1)
    if HALF_X > 0:
        total = total * xinv  # the row scale back (a power of two: exact)
    return _row_scale(total, s_base, g_base, offs_n, n_ok, FMT)


@triton.jit
def _tile_dot(acc, words, s, z, x_row, xp_row, kcol, k0, K_WORDS, c0, c1, xscale, FMT: tl.constexpr,
              HAS_ZERO: tl.constexpr, COMPUTE: tl.constexpr, VPW: tl.constexpr, EVEN_K: tl.constexpr,
              X_CG: tl.constexpr, ASM: tl.constexpr, HALF: tl.constexpr, X_PACK: tl.constexpr):  # fmt: skip
    """One tile's word dot: `gemv_half`'s where HALF (NVFP4, int4), else `gemv_words._word_dot`."""
    if HALF and FMT == 4:
        return nvfp4_half_dot(acc, words, s, x_row, xp_row, k0, K_WORDS, xscale, EVEN_K, X_CG, X_PACK, ASM)
    elif HALF:
        return int4_half_dot(acc, words, s, z, x_row, xp_row, k0, K_WORDS, xscale, HAS_ZERO, EVEN_K, X_CG, X_PACK,
                             ASM)  # fmt: skip
    else:
        return _word_dot(acc, words, s, z, x_row, kcol, k0, K_WORDS, c0, c1, FMT, HAS_ZERO, COMPUTE, VPW, EVEN_K,
                         X_CG, ASM)  # fmt: skip


@triton.jit
def _split_words(split, tiles_per_split, K_WORDS, KW: tl.constexpr, SPLIT: tl.constexpr):
    """Word columns `[lo, hi)` of K that split `split` of SPLIT sums (K tiles of KW words, `tiles_per_split`
    each, the last one cut at K); all of K when SPLIT is 1."""
    if SPLIT == 1:
        return 0, K_WORDS
    else:
        lo = split * tiles_per_split * KW
        return lo, tl.minimum(lo + tiles_per_split * KW, K_WORDS)


@triton.jit
def _gate_up_tile(
    pair, code, nb, split, tiles_per_split, x_ptr, act_ptr, part_ptr, cnt_ptr, ids_ptr, l2p_ptr, xp_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_experts, num_rows, I, H, stride_x, stride_act, stride_xp, c0, c1,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, HALF_X: tl.constexpr, X_PACK: tl.constexpr, HOST_WIDE: tl.constexpr = False,
):  # fmt: skip
    """`act[pair, nb block]` of a pair located at `code` (nothing for -1: not routed here).

    HOST_WIDE (SPLIT 1, K whole tiles of 2 * BLOCK_K): a host code's block is read as two halves of its rows, each
    over K in tiles twice as wide (`GemvConfig.host_wide`); pool codes as before.

    SPLIT > 1: this program sums K tiles `[split, split + 1) * tiles_per_split` only and stores its fp32 gate/up
    sums to `part_ptr` (`[pairs, N blocks, SPLIT, 2 * BLOCK_N]`); the last of the SPLIT arrivals at the (pair, N
    block) counter sums the parts in split order (deterministic) and stores act. More programs per SM for the
    same rows per thread (the x split is paid per tile and thread, whatever the rows)."""
    if code >= 0:
        w_base, s_base, z_base, g_base = _row_bases(
            code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
        )
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
        xp_row = xp_ptr + (pair // TOP_K).to(tl.int64) * stride_xp  # X_PACK: the token's x' pairs
        # gate row i and up row i interleaved: one loop over K for both, each x value serving twice the rows
        r = tl.arange(0, 2 * BLOCK_N)
        n_local = nb * BLOCK_N + r // 2
        kw_lo, kw_hi = _split_words(split, tiles_per_split, H // VPW, BLOCK_K // VPW, SPLIT)
        act_row = act_ptr + pair.to(tl.int64) * stride_act
        if HOST_WIDE and code >= num_rows:
            tl.static_assert(SPLIT == 1, "host-wide tiles run whole K")
            # half the rows (interleaved gate/up: BLOCK_N of them), twice the K per tile: as many values, so
            # as many registers, but each row's piece of a tile is twice as long (`GemvConfig.host_wide`)
            # (the launcher's `gemv_args._host_wide`: K is whole tiles of 2 * BLOCK_K, so EVEN_K holds for them too)
            rh = tl.arange(0, BLOCK_N)
            for h in tl.static_range(2):
                n0 = nb * BLOCK_N + h * (BLOCK_N // 2)
                # a half wholly past I is skipped: its masked rows would read row n0 (past the expert's rows)
                if n0 < I:
                    n_half = n0 + rh // 2
                    gu_h = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, n_half + (rh % 2) * I,
                                     n_half < I, H, 0, H // VPW, w_sn, s_sn, z_sn, c0, c1, BLOCK_N, 2 * BLOCK_K, FMT,
                                     GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH, EVEN_K, False, HALF_X,
                                     X_PACK)  # fmt: skip
                    _store_act(gu_h, act_row, n0, I, BLOCK_N // 2, COMPUTE)
        else:
            gu = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, n_local + (r % 2) * I, n_local < I, H, kw_lo,
                           kw_hi, w_sn, s_sn, z_sn, c0, c1, 2 * BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8,
                           COMPUTE, VPW, PREFETCH, EVEN_K, False, HALF_X, X_PACK)  # fmt: skip
            if SPLIT == 1:
                _store_act(gu, act_row, nb * BLOCK_N, I, BLOCK_N, COMPUTE)
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
                    _store_act(total, act_row, nb * BLOCK_N, I, BLOCK_N, COMPUTE)


@triton.jit
def _store_act(gu, act_row, n0, I, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """act of rows `[n0, n0 + BLOCK_N)` from their interleaved fp32 gate/up sums `[2 * BLOCK_N]`, as `gemm1`
    rounds it."""
    gate, up = _halves(gu)
    gate = gate.to(COMPUTE).to(tl.float32)
    up = up.to(COMPUTE).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(act_row + offs_n, act, mask=offs_n < I)


@triton.jit
def _down_tile(
    pair, code, nb, split, tiles_per_split, act_ptr, y_ptr, part_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
    xp_ptr, wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_experts, num_rows, H, I, stride_act, stride_y, stride_out, stride_xp, c0, c1,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, FUSE_COMBINE: tl.constexpr,
    EVEN_K: tl.constexpr, X_CG: tl.constexpr, SPLIT: tl.constexpr, HALF_X: tl.constexpr, X_PACK: tl.constexpr,
    PEEL: tl.constexpr = False, PDL: tl.constexpr = False, HOST_WIDE: tl.constexpr = False,
    HOST_TALL: tl.constexpr = False,
):  # fmt: skip
    """`y[pair, nb block]` (a pair routed here) and, with FUSE_COMBINE, the arrival of this (pair, block): the
    last of the token's K arrivals sums `out[t, nb block]`.

    HOST_TALL (SPLIT 1, not with HOST_WIDE): a host code's even block reads its rows and the next block's as one
    tile of 2 * BLOCK_N rows, twice the bytes in flight over the link per program, and stores and arrives for
    both; the odd block's program reads nothing and does not arrive. Pool codes keep their tiles.

    HOST_WIDE (SPLIT 1, K whole tiles of 2 * BLOCK_K): a host code's rows are read as two halves, each over K in
    tiles twice as wide, as gate_up's (`_gate_up_tile`).

    PEEL: the caller has not waited for gate_up (PDL): a routed pair's program waits after its first tile's
    loads (`_rows_dot`), the others at once, before anything reads act or the counters.

    SPLIT > 1 (FUSE_COMBINE only): this program sums K tiles `[split, split + 1) * tiles_per_split` only and
    stores its fp32 rows to `part_ptr` (`[pairs, SPLIT, H]`); the last of the token's K * SPLIT arrivals sums
    each pair's parts in split order, rounds that y as the unsplit kernel stores it, and combines (deterministic).
    Smaller work items, so the grid's last wave is fuller (y is not stored)."""
    tl.static_assert(SPLIT == 1 or FUSE_COMBINE, "a split down sums its parts in the fused combine")
    tl.static_assert(
        not HOST_TALL or (SPLIT == 1 and not HOST_WIDE), "host-tall tiles: whole K, no host_wide"
    )
    num_nb = tl.cdiv(H, BLOCK_N)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if code >= 0:
        w_base, s_base, z_base, g_base = _row_bases(
            code, num_rows, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se
        )
        x_row = act_ptr + pair.to(tl.int64) * stride_act
        xp_row = xp_ptr + pair.to(tl.int64) * stride_xp  # X_PACK: the pair's act' pairs
        kw_lo, kw_hi = _split_words(split, tiles_per_split, I // VPW, BLOCK_K // VPW, SPLIT)
        if HOST_WIDE and code >= num_rows:
            tl.static_assert(SPLIT == 1, "host-wide tiles run whole K")
            y_row = y_ptr + pair.to(tl.int64) * stride_y
            # the first half waits for gate_up after its first tile's loads (PEEL), the second has waited
            offs_a = nb * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            y_a = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, offs_a, offs_a < H, I, 0, I // VPW,
                            w_sn, s_sn, z_sn, c0, c1, BLOCK_N // 2, 2 * BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8,
                            COMPUTE, VPW, PREFETCH, EVEN_K, X_CG, HALF_X, X_PACK, PEEL, PDL)  # fmt: skip
            tl.store(y_row + offs_a, y_a.to(COMPUTE), mask=offs_a < H)
            # a second half wholly past H is skipped: its masked rows would read row H (past the expert's rows)
            if nb * BLOCK_N + BLOCK_N // 2 < H:
                offs_b = offs_a + BLOCK_N // 2
                y_b = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, offs_b, offs_b < H, I, 0, I // VPW,
                                w_sn, s_sn, z_sn, c0, c1, BLOCK_N // 2, 2 * BLOCK_K, FMT, GROUP, HAS_ZERO,
                                NATIVE_FP8, COMPUTE, VPW, PREFETCH, EVEN_K, X_CG, HALF_X, X_PACK)  # fmt: skip
                tl.store(y_row + offs_b, y_b.to(COMPUTE), mask=offs_b < H)
        elif HOST_TALL and code >= num_rows:
            if nb % 2 == 0:  # rows past H read the tile's first row (`_rows_dot`) and are not stored
                offs_t = nb * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
                y_t = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, offs_t, offs_t < H, I, 0, I // VPW,
                                w_sn, s_sn, z_sn, c0, c1, 2 * BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8,
                                COMPUTE, VPW, PREFETCH, EVEN_K, X_CG, HALF_X, X_PACK, PEEL, PDL)  # fmt: skip
                tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_t, y_t.to(COMPUTE), mask=offs_t < H)
            elif PEEL:
                pdl.wait(PDL)  # the odd block's program of a host pair: no tile (every program waits)
        else:
            y = _rows_dot(w_base, s_base, z_base, g_base, x_row, xp_row, offs_n, n_ok, I, kw_lo, kw_hi, w_sn,
                          s_sn, z_sn, c0, c1, BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW,
                          PREFETCH, EVEN_K, X_CG, HALF_X, X_PACK, PEEL, PDL)  # fmt: skip
            if SPLIT == 1:
                tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, y.to(COMPUTE), mask=n_ok)
            else:
                tl.store(part_ptr + (pair * SPLIT + split).to(tl.int64) * H + offs_n, y, mask=n_ok)
    elif PEEL:
        pdl.wait(PDL)  # not routed here: no tile to load first (every program waits: see `_down_kernel`)
    if FUSE_COMBINE:
        # every thread's y stores happen before the (one-thread, release) arrival
        tl.debug_barrier()
        if HOST_TALL:
            # a host code's even block arrives for itself and the next block (where there is one), its odd none
            num_arrive = tl.where(code >= num_rows, tl.where(nb % 2 == 0, tl.minimum(num_nb - nb, 2), 0), 1)
            for j in range(num_arrive):
                _arrive_and_combine(pair, nb + j, y_ptr, part_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
                                    num_experts, H, stride_y, stride_out, TOP_K, BLOCK_N, COMPUTE, SPLIT)  # fmt: skip
        else:
            _arrive_and_combine(pair, nb, y_ptr, part_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
                                num_experts, H, stride_y, stride_out, TOP_K, BLOCK_N, COMPUTE, SPLIT)  # fmt: skip
