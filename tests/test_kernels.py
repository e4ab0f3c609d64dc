"""Kernels against their torch references on the CPU, under Triton's interpreter, at small awkward sizes."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    import triton
    import triton.language as tl
    from pooled_runner.kernels.align import (
        PATHS,
        TINY_FORCED_MAX_PAIRS,
        align_blocks,
        align_blocks_ref,
        default_path,
    )
    from pooled_runner.kernels.align_sort import SORT_COMPILED_MAX_PAIRS, SORT_MAX_PAIRS
    from pooled_runner.kernels.combine import combine, combine_ref
    from pooled_runner.kernels.dequant import e2m1_to_f32, e4m3_to_f32
    from pooled_runner.kernels.fused_moe import (
        gemm1_ref,
        gemm2_ref,
        make_projections,
        pooled_fused_moe,
        pooled_fused_moe_ref,
    )
    from pooled_runner.kernels.locate import locate, locate_ref
    from pooled_runner.kernels.moe_gemm import GemmConfig, gemm1, gemm2
    from pooled_runner.kernels.operands import kernel_format

    @triton.jit
    def _decode_kernel(raw_ptr, out_ptr, N: tl.constexpr, WHICH: tl.constexpr):
        offs = tl.arange(0, N)
        raw = tl.load(raw_ptr + offs)
        if WHICH == 0:  # noqa: SIM108 (constexpr branch)
            v = e4m3_to_f32(raw, False)
        else:
            v = e2m1_to_f32(raw.to(tl.int32))
        tl.store(out_ptr + offs, v)


from pooled_runner.formats import Int4Format, make_format
from pooled_runner.formats.quant import E2M1_VALUES, pack_int4, unpack_int4
from tests.kernel_helpers import assert_close, build_layer, random_routing

pytestmark = pytest.mark.interpreter(gpu="tests/test_kernels_gpu.py")


ALIGN_FIELDS = ("sorted_pairs", "block_experts", "block_codes", "block_order", "num_post_padded")


@pytest.mark.parametrize(
    ("T", "K", "E", "block_m"),
    [(0, 2, 3, 16), (1, 1, 1, 16), (7, 3, 5, 16), (5, 8, 9, 32), (40, 8, 33, 16), (200, 6, 61, 32),
     (17, 8, 128, 32), (128, 8, 256, 16), (300, 1, 600, 16)],
)  # fmt: skip
def test_align_matches_reference(T, K, E, block_m):
    """The default path and every path forced where it reaches, against the reference; ids of -1 and >= E (not
    placed), E its own power of two or not, and E = 600."""
    g = torch.Generator().manual_seed(T * 131 + E)
    R = max(1, E // 2)
    ids = torch.randint(-1, E + 2, (T, K), generator=g)
    if (
        ids.numel() > 2
    ):  # int64 ids whose low 32 bits are a valid expert: not placed (the int32 run wraps them)
        ids.view(-1)[1] = 2**32 + 1
    l2p = torch.randint(-1, R + E, (E + 3,), generator=g).int()
    l2p[E:] = -1
    limits = {"tiny": TINY_FORCED_MAX_PAIRS, "sort": SORT_COMPILED_MAX_PAIRS}
    paths = [None, *(p for p in PATHS if T * K <= limits.get(p, T * K))]
    refs = {d: align_blocks_ref(ids.to(d), l2p, E, R, block_m) for d in (torch.int64, torch.int32)}
    for dtype, path in [(d, p) for d in (torch.int64, torch.int32) for p in paths]:
        got, ref = align_blocks(ids.to(dtype), l2p, E, R, block_m, path=path), refs[dtype]
        for f in ALIGN_FIELDS:
            assert torch.equal(getattr(got, f), getattr(ref, f)), (
                f"path {path}, {dtype}, {f}: {getattr(got, f)} != {getattr(ref, f)}"
            )


def test_align_wide_path_used_and_exact():
    T, K, E = SORT_MAX_PAIRS // 4 + 3, 4, 7  # > SORT_MAX_PAIRS pairs: the three-launch path
    assert default_path(T * K) == "wide"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, E, (T, K), generator=g)
    l2p = torch.tensor([0, 9, 1, 10, -1, 2, 13, -1], dtype=torch.int32)
    got, ref = align_blocks(ids, l2p, E, 3, 16), align_blocks_ref(ids, l2p, E, 3, 16)
    for f in ALIGN_FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    # host blocks (codes >= 3) come first in the schedule
    order = got.block_order[got.block_order >= 0].long()
    is_host = (got.block_codes[order] >= 3).int()
    assert torch.equal(is_host, is_host.sort(descending=True, stable=True).values)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_one_program_paths_every_width(block_m):
    """The sort and tiny paths equal the reference at every N from 0 to 17 and around powers of two (the sort's
    key and block widths): repeated experts, padding ids, ids >= E, host, pool and absent codes."""
    g = torch.Generator().manual_seed(block_m)
    for n in [*range(0, 18), 31, 32, 33, 47, 63, 64, 65, 127, 129]:
        E = int(torch.randint(1, 40, (1,), generator=g))
        R = int(torch.randint(1, E + 1, (1,), generator=g))
        ids = torch.randint(-1, E + 2, (n, 1), generator=g)
        l2p = torch.randint(-1, R + E, (E + 2,), generator=g).int()
        ref = align_blocks_ref(ids, l2p, E, R, block_m)
        for path in ("sort", "tiny"):
            got = align_blocks(ids, l2p, E, R, block_m, path=path)
            for f in ALIGN_FIELDS:
                assert torch.equal(getattr(got, f), getattr(ref, f)), f"{path} n={n} E={E} {f}"


def test_align_bad_input():
    l2p = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        align_blocks(torch.zeros(2, 2, dtype=torch.int64), l2p, 4, 2, 24)
    with pytest.raises(ValueError, match="l2p"):
        align_blocks(torch.zeros(2, 2, dtype=torch.int64), l2p.long(), 4, 2, 16)
    with pytest.raises(ValueError, match="contiguous"):
        align_blocks(torch.zeros(4, 4, dtype=torch.int64)[:, ::2], l2p, 4, 2, 16)
    with pytest.raises(ValueError, match="align path 'steps'"):
        align_blocks(torch.zeros(2, 2, dtype=torch.int64), l2p, 4, 2, 16, path="steps")
    with pytest.raises(ValueError, match="align path 'tiny' for 260 pairs"):
        align_blocks(torch.zeros(130, 2, dtype=torch.int64), l2p, 4, 2, 16, path="tiny")


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_locate_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    E = 11
    experts = torch.randint(-1, E + 2, (n,), generator=g).int()
    l2p = torch.randint(-1, 30, (E + 1,), generator=g).int()
    assert torch.equal(locate(experts, l2p, E), locate_ref(experts, l2p, E))


@pytest.mark.parametrize(("T", "K", "H"), [(1, 1, 5), (7, 3, 33), (4, 8, 1100)])
def test_combine_matches_reference(T, K, H):
    g = torch.Generator().manual_seed(H)
    E = 9
    ids, w = random_routing(T, K, E, g, pad_prob=0.3)
    l2p = torch.arange(E + 1, dtype=torch.int32)
    l2p[2] = -1  # an expert not here: its pairs add nothing
    y = torch.randn(T * K, H, generator=g).bfloat16()
    y[(ids.flatten() < 0) | (ids.flatten() == 2)] = float("nan")  # unrouted rows must not leak
    got, ref = combine(y, ids, w, l2p, E), combine_ref(y, ids, w, l2p, E)
    # not bitwise: the interpreter's fp32 -> bf16 store may round differently from torch's
    assert_close(got, ref, "combine", rel=1e-2)


def test_in_kernel_decoders_exact():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](raw, out, 256, 0)
    ref = raw.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(ref)
    assert torch.equal(out[finite], ref[finite])
    codes = torch.arange(16, dtype=torch.uint8)
    out16 = torch.empty(16)
    _decode_kernel[(1,)](codes, out16, 16, 1)
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(out16, torch.cat([table, -table]))


def test_int4_pack_roundtrip_and_bad_group():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    with pytest.raises(ValueError, match="group"):
        Int4Format(torch.bfloat16, group=48)
    with pytest.raises(ValueError, match="group"):
        make_format("int4-g128", torch.bfloat16).operands(96, 64)


FORMATS = [
    ("bf16", 40, 24, torch.bfloat16),
    ("bf16", 40, 24, torch.float16),
    ("int4-g32", 64, 32, torch.bfloat16),
    ("int4-g64-zp", 64, 64, torch.bfloat16),
    ("int4-g128-zp", 128, 128, torch.float16),
    ("fp8", 40, 24, torch.bfloat16),
    ("fp8-b16", 40, 24, torch.bfloat16),
    ("nvfp4", 48, 32, torch.bfloat16),
]


@pytest.mark.parametrize(("name", "H", "I", "dtype"), FORMATS)
def test_gemm_stages_match_reference(name, H, I, dtype):
    g = torch.Generator().manual_seed(len(name) + H)
    E, R, T, K = 7, 3, 9, 3
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, _ = random_routing(T, K, E, g)
    ids[0, 0] = -1  # at least one pair not computed (its row of a given y stays as it was)
    cfg = GemmConfig(16, 16, 32, num_stages=1)
    al = align_blocks(ids, l2p, E, R, 16)
    computed = ((al.block_codes >= 0).repeat_interleave(16)) & (al.sorted_pairs < T * K)
    act, act_ref = gemm1(x, al, w13, fmt, K, cfg), gemm1_ref(x, al, w13, fmt, K, cfg)
    assert_close(act[computed], act_ref[computed], f"{name} gemm1")
    y, y_ref = gemm2(act_ref, al, w2, fmt, T * K, cfg), gemm2_ref(act_ref, al, w2, fmt, T * K, cfg)
    pairs = al.sorted_pairs[computed].long()
    assert_close(y[pairs], y_ref[pairs], f"{name} gemm2")
    # into a given output (staging passes share one): computed rows written, the others left as they were
    fill = torch.randn(T * K, H, generator=g).to(dtype)
    y_in, y_in_ref = fill.clone(), fill.clone()
    assert gemm2(act_ref, al, w2, fmt, T * K, cfg, y=y_in) is y_in
    assert gemm2_ref(act_ref, al, w2, fmt, T * K, cfg, y=y_in_ref) is y_in_ref
    untouched = torch.ones(T * K, dtype=torch.bool)
    untouched[pairs] = False
    assert untouched.any()
    assert torch.equal(y_in[untouched], fill[untouched]) and torch.equal(y_in_ref[untouched], fill[untouched])
    assert_close(y_in[pairs], y_in_ref[pairs], f"{name} gemm2 into y")


@pytest.mark.parametrize(
    ("name", "H", "I"),
    [("int4-g32", 128, 64), ("int4-g64-zp", 128, 64), ("nvfp4", 80, 64), ("fp8-b16", 80, 64),
     ("fp8-b128", 80, 48), ("fp8-b32", 144, 96)],
)  # fmt: skip
def test_packed_tiles_spanning_groups(name, H, I):
    """K tiles of 64 values: several int4 groups / NVFP4 scales / fp8 blocks per tile (fp8-b128: one block
    spanning several tiles), a partial last tile (H=80, 144), both operand orders (the fp8 block scales of a
    tile are loaded once per block and widened, K-major or N-major)."""
    g = torch.Generator().manual_seed(H + I)
    E, R, T, K = 5, 2, 6, 2
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = random_routing(T, K, E, g)
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    for swap in (False, True):
        cfg = GemmConfig(16, 16, 64, num_stages=1, swap_ab=swap)
        for decode in (False, True) if not swap else (False,):  # the decode path takes no swapped tiles
            out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, (cfg, cfg), decode=decode)
            assert_close(out, ref, f"{name} decode={decode} swap={swap}")


@pytest.mark.parametrize(("name", "H", "I", "dtype"), FORMATS)
@pytest.mark.parametrize(("T", "K", "E", "R"), [(1, 1, 1, 1), (7, 3, 5, 2), (13, 4, 9, 9)])
@pytest.mark.parametrize("decode", [False, True])
def test_pooled_fused_moe_matches_reference(name, H, I, dtype, T, K, E, R, decode):
    g = torch.Generator().manual_seed(T * 7 + E + H)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype, num_not_here=int(E > 3))
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank if R < E else None, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, decode=decode)
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    assert out.dtype == dtype
    assert_close(out, ref, f"{name} T={T} K={K} E={E} R={R}")


@pytest.mark.parametrize(("name", "H", "I", "dtype"), [FORMATS[0], FORMATS[2], FORMATS[6], FORMATS[7]])
@pytest.mark.parametrize(
    ("T", "K", "E", "R"), [(1, 1, 1, 1), (3, 3, 7, 3), (4, 8, 9, 4), (5, 2, 6, 2), (8, 8, 13, 5)]
)
@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_combine_and_inline_align_equal_align_path(name, H, I, dtype, T, K, E, R, block_m):
    """variant "align-fc" (combine in gemm2) and "inline" (no align launch; 64 pairs fall back to align-fc):
    bitwise the align path's output, tokens without a routed pair included; counters back at zero."""
    from pooled_runner.kernels import gemv

    g = torch.Generator().manual_seed(T * 11 + E + block_m)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype, num_not_here=int(E > 3))
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank if R < E else None, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g, pad_prob=0.2)
    if T > 2:
        ids[1] = -1  # a token with no pair routed here: its output row is still written (zeros)
    cfgs = (GemmConfig(block_m, 16, 32, num_stages=1), GemmConfig(block_m, 16, 32, num_stages=1))
    base = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs, variant="align")
    for variant in ("align-fc", "inline"):
        out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs, variant=variant)
        assert torch.equal(out, base), f"{variant}: max diff {(out.float() - base.float()).abs().max()}"
        assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize(
    ("fmt_case", "T", "K", "E", "swap", "expected"),
    [
        (0, 1, 8, 9, False, "inline"),  # bf16, 8 pairs: the switch point
        (0, 1, 3, 7, False, "inline"),
        (0, 2, 5, 7, False, "align"),  # 10 pairs
        (2, 1, 8, 9, True, "align"),  # int4 with swapped tiles (its default): never inline
        (2, 1, 8, 9, False, "inline"),  # int4 with unswapped tiles given by the caller
        (2, 2, 5, 7, False, "align"),
        (7, 1, 3, 7, True, "align"),  # NVFP4, swapped
        (5, 1, 3, 7, False, "inline"),  # fp8, unswapped (its default at I <= 1024)
    ],
)
def test_default_decode_variant_dispatch_and_output(fmt_case, T, K, E, swap, expected, monkeypatch):
    """The default decode kernels with the caller's tiles: inline (no align launch) up to
    INLINE_DEFAULT_MAX_PAIRS pairs where the tiles are not swapped, else the align path; the output is the
    explicit align path's (same tiles) bitwise either way."""
    from pooled_runner.kernels import fused_moe

    name, H, I, dtype = FORMATS[fmt_case]
    g = torch.Generator().manual_seed(T * 13 + K + E)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, 3, g, dtype)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g, pad_prob=0.2)
    cfg = GemmConfig(16, 16, 32, num_stages=1, swap_ab=swap)
    cfgs = (cfg, cfg)
    base = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs, variant="align")
    calls = []
    real_align = fused_moe.align_blocks
    monkeypatch.setattr(fused_moe, "align_blocks", lambda *a, **kw: calls.append(1) or real_align(*a, **kw))
    out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs)
    assert len(calls) == (0 if expected == "inline" else 1), f"{name} {T}x{K}: align launches {len(calls)}"
    assert torch.equal(out, base), f"default {expected}: max diff {(out.float() - base.float()).abs().max()}"


@pytest.mark.parametrize(
    ("name", "H", "I"), [("int4-g32", 64, 32), ("int4-g64-zp", 128, 64), ("int4-g128-zp", 128, 128)]
)
@pytest.mark.parametrize("block_k", [32, 64])
def test_int4_half_math_tiles_equal_fp32_tiles(name, H, I, block_k, monkeypatch):
    """moe_gemm.HALF_INT4 (int4 MMA tiles in packed half math) gives the fp32 path's output bitwise (fp16 here:
    the interpreter has no bf16 arithmetic; bf16 differs only in its magic constant, see the next test)."""
    from pooled_runner.kernels import moe_gemm

    g = torch.Generator().manual_seed(H + block_k)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, 7, 3, g, torch.float16)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(5, H, generator=g).half()
    ids, w = random_routing(5, 3, 7, g)
    cfgs = (GemmConfig(16, 16, block_k, num_stages=1), GemmConfig(16, 16, block_k, num_stages=1))
    monkeypatch.setattr(moe_gemm, "HALF_INT4", False)  # the fp32-math tiles (HALF_INT4 is the default)
    assert not moe_gemm._half_int4(fmt, torch.float16, cfgs[0])
    base = pooled_fused_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfgs, variant="align")
    monkeypatch.setattr(moe_gemm, "HALF_INT4", True)
    assert moe_gemm._half_int4(fmt, torch.float16, cfgs[0])
    # groups narrower than 64 take the fp32 math in 64-row tiles and wider (a Triton 3.6 sm_90 compile failure)
    wide = GemmConfig(64, 16, block_k, num_stages=1)
    assert moe_gemm._half_int4(fmt, torch.float16, wide) == (fmt.group >= moe_gemm.HALF_INT4_MIN_GROUP_WIDE)
    for variant in ("align", "inline"):
        assert torch.equal(pooled_fused_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfgs, variant=variant), base)


def test_int4_half_magic_is_exact_in_bf16_and_fp16():
    """The half-math int4 dequant in torch arithmetic: `(M + q) - (M + z)` is exact and one multiply by the
    scale equals the reference's fp32 `(q - z) * s` rounded once, for every nibble, zero point and many scales."""
    g = torch.Generator().manual_seed(0)
    q = torch.arange(16, dtype=torch.int32)[:, None, None]
    z = torch.arange(16, dtype=torch.int32)[None, :, None]
    for dtype, magic, m in ((torch.bfloat16, 0x4300, 128.0), (torch.float16, 0x6400, 1024.0)):
        s = (torch.randn(1, 1, 4096, generator=g) * torch.logspace(-6, 2, 4096)[None, None, :]).to(dtype)
        v = (q | magic).to(torch.int16).view(dtype)
        assert torch.equal(v.float(), (q + m).float())
        half = (v - (z.float() + m).to(dtype)) * s
        ref = ((q - z).float() * s.float()).to(dtype)
        assert torch.equal(half, ref)


def test_fused_moe_zero_tokens():
    g = torch.Generator().manual_seed(1)
    fmt_obj, pool, bank, l2p = build_layer("bf16", 16, 16, 3, 2, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, 16, 16)
    ids = torch.empty(0, 2, dtype=torch.int64)
    out = pooled_fused_moe(
        torch.empty(0, 16, dtype=torch.bfloat16), ids, torch.empty(0, 2), l2p, 3, w13, w2, fmt
    )
    assert out.shape == (0, 16)


def test_wide_tiles_by_width_and_format(monkeypatch):
    """The tiles a card gets (not the interpreter's) around the 33-128-token rule: K tiles of 128 ungrouped for
    dense experts with I <= 1024 there, the old tiles outside it and for other formats; both GEMMs one block_m."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.dequant import FMT_DENSE, FMT_INT4

    monkeypatch.setattr(fused_moe, "interpreting", lambda: False)

    def tiles(T: int, I: int = 768, fmt: int = FMT_DENSE) -> tuple:  # type: ignore[type-arg]
        cfg1, cfg2 = fused_moe.pick_configs(T, 8, 128, 2048, I, fmt)
        assert cfg1.block_m == cfg2.block_m, (T, I, fmt, cfg1, cfg2)
        return (cfg1.block_m, cfg1.block_n, cfg2.block_n, cfg1.block_k, cfg1.group_m)

    assert tiles(32)[0] == 16  # decode tiles
    assert tiles(33) == tiles(128) == tiles(64, I=1024) == (32, 64, 128, 128, 1)
    assert tiles(129) == (64, 64, 128, 64, 8)
    assert tiles(64, I=1025) == tiles(64, fmt=FMT_INT4) == (32, 64, 128, 64, 8)
