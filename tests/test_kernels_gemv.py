"""The GEMV decode path (kernels/gemv.py) against its references on the CPU, under Triton's interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    import triton
    import triton.language as tl
    from pooled_runner.kernels import gemv, gemv_args, gemv_words
    from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe, pooled_fused_moe_ref
    from pooled_runner.kernels.gemv import (
        GemvConfig,
        gemv_down_combine,
        gemv_down_combine_ref,
        gemv_gate_up,
        gemv_gate_up_ref,
        gemv_moe,
        gemv_moe_ref,
    )
    from pooled_runner.kernels.operands import kernel_format

    @triton.jit
    def _schedule_kernel(ids_ptr, l2p_ptr, out_ptr, num_pairs, num_experts, num_rows, P_POW2: tl.constexpr):
        slot = tl.program_id(0)
        pair, code = gemv._slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2)
        tl.store(out_ptr + 2 * slot, pair)
        tl.store(out_ptr + 2 * slot + 1, code)


from tests.kernel_helpers import (
    assert_close,
    assert_exact_values,
    build_layer,
    e2m1_words_and_values,
    random_routing,
)

pytestmark = pytest.mark.interpreter(gpu="tests/test_decode_variants_gpu.py")


# (format, H, I, dtype): H and I both multiples of the 32-value test tiles (EVEN_K) or not
FORMATS = [
    ("bf16", 40, 24, torch.bfloat16),
    ("bf16", 64, 32, torch.float16),
    ("int4-g32", 64, 32, torch.bfloat16),
    ("int4-g64-zp", 128, 64, torch.bfloat16),
    ("int4-g32-zp", 96, 32, torch.float16),
    ("fp8", 40, 28, torch.bfloat16),
    ("fp8-b16", 48, 32, torch.bfloat16),
    ("nvfp4", 48, 32, torch.bfloat16),
    ("nvfp4", 64, 64, torch.bfloat16),
]
CONFIGS = [
    GemvConfig(16, 32, 16, 32),
    GemvConfig(8, 64, 32, 32, num_warps=2, prefetch=False, fuse_combine=False),
    GemvConfig(16, 32, 16, 64, stages=3),
]


def test_e2m1_word_decode_is_exact():
    """The NVFP4 GEMV's word decode (`gemv_words._e2m1_values`, the bit logic its PTX form runs on the GPU):
    every code at every position of a word, and random words, give exactly value / 16384."""
    words, want = e2m1_words_and_values(torch.Generator().manual_seed(5), 301)
    assert_exact_values(gemv_words.e2m1_decode_ref(words), want, "e2m1 decode reference")
    for n in (0, 1, 7, words.numel()):
        assert_exact_values(gemv_words.e2m1_decode(words[:n]), want[:n], "e2m1 decode")


def _layer(name, H, I, dtype, E=7, R=3, seed=0):
    g = torch.Generator().manual_seed(seed + H + I)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype)
    fmt = kernel_format(fmt_obj)
    return g, fmt, *make_projections(fmt, pool, bank, H, I), l2p


@pytest.mark.parametrize(("name", "H", "I", "dtype"), FORMATS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "no-prefetch-sep-combine", "pipelined"])
def test_gemv_stages_match_references(name, H, I, dtype, cfg):
    _check_stages(name, H, I, dtype, cfg)


@pytest.mark.parametrize(
    ("name", "H", "I", "dtype", "cfg"),
    [
        ("int4-g32", 96, 32, torch.bfloat16, GemvConfig(32, 32, 64, 32)),  # down: 96 rows in blocks of 64
        ("int4-g32-zp", 96, 96, torch.float16, GemvConfig(64, 32, 64, 32, prefetch=False)),  # both
        ("nvfp4", 48, 48, torch.bfloat16, GemvConfig(32, 32, 32, 32)),  # both
    ],
)
def test_gemv_rows_past_n(name, H, I, dtype, cfg):
    """N blocks that run past N (the rows there read the block's first row, unmasked, and are never stored), for
    the packed formats, whose K rules keep N whole blocks in most other cases: gate_up and down for int4 (with
    and without zero points) and NVFP4."""
    _check_stages(name, H, I, dtype, cfg)


def _check_stages(name, H, I, dtype, cfg):
    """gate_up and down + combine, each against its reference (random routing with an id past E)."""
    E, T, K = 7, 3, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[0, 0] = E + 1  # an id past E: not routed here (as -1 padding and the expert that is not here)
    act = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)
    act_ref = gemv_gate_up_ref(x, ids, l2p, E, w13, fmt, cfg)
    codes = torch.tensor(gemv._pair_codes(ids, l2p, E))
    assert (codes < 0).any() and (codes >= 3).any() and ((codes >= 0) & (codes < 3)).any()
    assert_close(act[codes >= 0], act_ref[codes >= 0], f"{name} gate_up")
    out = gemv_down_combine(act_ref, ids, w, l2p, E, w2, fmt, cfg)
    assert out.dtype == dtype
    assert_close(out, gemv_down_combine_ref(act_ref, ids, w, l2p, E, w2, fmt, cfg), f"{name} down_combine")


@pytest.mark.parametrize(("name", "dtype", "bk"), [("int4-g128", torch.float16, 128), ("int4-g128-zp", torch.bfloat16, 128),
                                                   ("int4-g128-zp", torch.float16, 256), ("nvfp4", torch.float16, 256)])  # fmt: skip
def test_gemv_production_tiles_with_outliers(name, dtype, bk):
    """int4 tiles at group 128 (K tiles of 128 = one group: one scale and zero point per row and tile; K tiles
    of 256 = two groups: two per row, selected per word; here through a 4-stage pipeline, the interpreter runs
    the same arithmetic as the H200 default without one) over two K tiles of gate_up, and
    NVFP4's (no prefetch, K tiles of 256) at a group-128 shape, with large x
    outliers (the int4 words carry 2048 + q and 128 + q: the offsets come off per word) and fp16 compute,
    against the path's reference and the dense torch reference of the align path."""
    H, I, E, T, K = 512, 128, 5, 2, 3
    g = torch.Generator().manual_seed(11 + len(name))
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, 3, g, dtype)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g)
    x[0, 5], x[1, 130], x[1, 7] = 300.0, -250.0, 120.0  # outliers at even and odd values of a word
    x = x.to(dtype)
    ids, w = random_routing(T, K, E, g)
    if name == "nvfp4":
        cfg = GemvConfig(16, 256, 16, 128, prefetch=False)
    else:
        cfg = GemvConfig(16, bk, 16, bk, prefetch=False, stages=4)
    out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, variant="gemv", gemv_config=cfg)
    assert out.dtype == dtype
    assert_close(out, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt, cfg), f"{name} gemv reference")
    assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} vs align reference")


def test_default_decode_path_is_gemv_for_int4_only_where_it_applies(monkeypatch):
    """`pooled_fused_moe` without a variant: an int4 step of 8 pairs over many experts runs the GEMV path; 136
    pairs over 300 experts (mostly distinct, but past GEMV_MAX_PAIRS), 72 pairs over 40 experts and 8 pairs over
    2 experts (heavy reuse) do not; every output matches the dense reference. (`default_variant`'s table is in
    test_kernels_swap.py; a 72-pair GEMV step in `test_gemv_path_matches_fused_reference`.)"""
    from pooled_runner.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "DECODE_VARIANT", None)
    calls = []
    real = fused_moe.gemv_moe
    monkeypatch.setattr(fused_moe, "gemv_moe", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    H, I = 64, 32
    for E, T, K, expect_gemv in [(40, 1, 8, True), (300, 17, 8, False), (40, 9, 8, False), (2, 4, 2, False)]:
        g = torch.Generator().manual_seed(E + T)
        fmt_obj, pool, _, l2p = build_layer("int4-g32", H, I, E, E, g, num_not_here=0)
        fmt = kernel_format(fmt_obj)
        w13, w2 = make_projections(fmt, pool, None, H, I)
        x = torch.randn(T, H, generator=g).bfloat16()
        ids, w = random_routing(T, K, E, g)
        calls.clear()
        out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt)
        assert (calls == [T]) == expect_gemv, (E, T, K, calls)
        assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"E={E} T={T} K={K}")


ROUTINGS = [(1, 1, 1, 1), (1, 8, 9, 4), (5, 4, 9, 9)]
WIDE = (8, 8, 20, 6)  # 64 pairs, the widest step of the default schedule width (GemvConfig.schedule_width)
WIDER = (9, 8, 29, 11)  # 72 pairs: the 128-wide schedule (up to GEMV_MAX_PAIRS)


@pytest.mark.parametrize(
    ("name", "H", "I", "dtype", "T", "K", "E", "R"),
    [(*f, *r) for f in FORMATS for r in ROUTINGS]
    + [(*f, *WIDE) for f in (FORMATS[0], FORMATS[2], FORMATS[7])]
    + [(*FORMATS[7], *WIDER)],
)
def test_gemv_path_matches_fused_reference(name, H, I, dtype, T, K, E, R):
    """Through `pooled_fused_moe(variant="gemv")`: the path's own reference and the align path's."""
    g = torch.Generator().manual_seed(T * 7 + E + H)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype, num_not_here=int(E > 3))
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank if R < E else None, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    out = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, variant="gemv")
    assert out.dtype == dtype
    assert_close(out, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} T={T} K={K} E={E} R={R}")
    assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} vs align reference")


def test_gemv_repeated_experts_and_counters_reset():
    """Tokens sharing experts (pairs of one expert side by side), twice in a row: the arrival counters are
    back at zero after each call and the second call equals the first."""
    E, T, K, H, I = 4, 6, 3, 64, 32
    g, fmt, w13, w2, l2p = _layer("int4-g32", H, I, torch.bfloat16, E, R=2)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.tensor([[0, 1, 2], [1, 0, 3], [2, 3, 0], [0, 1, 2], [3, 2, 1], [1, 2, 0]])
    w = torch.rand(T, K, generator=g)
    cfg = GemvConfig(16, 32, 16, 32)
    first = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
    assert torch.equal(gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg), first)
    assert_close(first, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt, cfg), "repeated experts")


@pytest.mark.parametrize(
    ("name", "H", "I", "dtype"),
    [FORMATS[0], ("int4-g32-zp", 128, 32, torch.float16), FORMATS[7]],  # K tiles: 2 / 4 / 2 (32 values)
)
@pytest.mark.parametrize(
    ("split", "cfg"),
    [
        (2, CONFIGS[0]),
        (3, CONFIGS[2]),
        (5, CONFIGS[0]),
        (3, CONFIGS[1]),
    ],  # CONFIGS[1]: int4 two groups a tile
)
def test_gemv_split_k_gate_up(name, H, I, dtype, split, cfg):
    """gate_up with K split over `split` programs per (pair, N block) (fewer tiles than splits, a last tile
    past K, the three prefetch modes): the reference's act; the arrival counters back at zero; a second call
    bitwise the first (the parts are summed in split order, whatever program arrives last)."""

    E, T, K = 7, 3, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[1, 2] = -1
    cfg = dataclasses.replace(cfg, split_k1=split)
    act = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)
    codes = torch.tensor(gemv._pair_codes(ids, l2p, E))
    ref = gemv_gate_up_ref(x, ids, l2p, E, w13, fmt, cfg)
    assert_close(act[codes >= 0], ref[codes >= 0], f"{name} split {split} gate_up")
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
    assert torch.equal(gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)[codes >= 0], act[codes >= 0])
    out = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} split {split} layer")
    with pytest.raises(ValueError, match="split_k1"):
        gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(cfg, one_launch=True))


@pytest.mark.parametrize(("name", "H", "I", "dtype"), [FORMATS[0], FORMATS[4], FORMATS[5], FORMATS[7]])
@pytest.mark.parametrize("tickets", [True, False])
def test_gemv_one_launch_equals_two_launches(name, H, I, dtype, tickets):
    """gate_up and down tiles in one grid (down tiles wait for their pair's act): bitwise the two-launch
    result; every sync word is back at zero afterwards and no wait timed out."""
    E, T, K = 7, 2, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    two = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, GemvConfig(16, 32, 16, 32))
    one = gemv_moe(
        x, ids, w, l2p, E, w13, w2, fmt, GemvConfig(16, 32, 16, 32, one_launch=True, tickets=tickets)
    )
    assert torch.equal(one, two)
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
    assert gemv.spin_timeouts(x.device) == 0


@pytest.mark.parametrize("num_pairs", [1, 5, 16, 37])
def test_gemv_schedule_is_host_first_permutation(num_pairs):
    """Slot -> (pair, code): a permutation of the pairs; host codes first, then pool codes, then pairs not
    routed here; inside a class by (expert, pair)."""
    g = torch.Generator().manual_seed(num_pairs)
    E, R = 9, 4
    ids = torch.randint(-1, E + 1, (num_pairs,), generator=g)
    l2p = torch.randint(-1, R + E, (E + 2,), generator=g).int()
    p_pow2 = max(16, triton.next_power_of_2(num_pairs))
    out = torch.full((num_pairs, 2), -7, dtype=torch.int32)
    _schedule_kernel[(num_pairs,)](ids, l2p, out, num_pairs, E, R, P_POW2=p_pow2)
    pairs, codes = out[:, 0].tolist(), out[:, 1].tolist()
    assert sorted(pairs) == list(range(num_pairs))
    expected = gemv._pair_codes(ids, l2p, E)
    assert codes == [expected[p] for p in pairs]

    def key(p):
        c = expected[p]
        cls = 0 if c >= R else 1 if c >= 0 else 2
        return (cls, int(ids[p]) if cls < 2 else 0, p)

    assert pairs == sorted(range(num_pairs), key=key)


def test_gemv_schedule_without_sort_is_identity():
    """P_POW2 = 0 (`GemvConfig.schedule_width=0`): slot s runs pair s, with its code (-1 where not routed)."""
    g = torch.Generator().manual_seed(11)
    E, R, num_pairs = 9, 4, 13
    ids = torch.randint(-1, E + 1, (num_pairs,), generator=g)
    l2p = torch.randint(-1, R + E, (E + 2,), generator=g).int()
    out = torch.full((num_pairs, 2), -7, dtype=torch.int32)
    _schedule_kernel[(num_pairs,)](ids, l2p, out, num_pairs, E, R, P_POW2=0)
    assert out[:, 0].tolist() == list(range(num_pairs))
    assert out[:, 1].tolist() == gemv._pair_codes(ids, l2p, E)


@pytest.mark.parametrize(("name", "H", "I", "dtype"), [FORMATS[0], FORMATS[4], FORMATS[7]])
@pytest.mark.parametrize(("width", "split_k2"), [(0, 1), (8, 1), (16, 1), (0, 2)])
def test_gemv_schedule_width_changes_only_the_order(name, H, I, dtype, width, split_k2):
    """Any schedule width, or none (0): bitwise the default schedule's output (the combine sums in k order,
    whatever ran first), host and unrouted pairs included, and the references'."""
    E, T, K = 7, 3, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[1, 2] = -1
    base = GemvConfig(16, 32, 16, 32, split_k2=split_k2)
    expected = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, base)
    out = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(base, schedule_width=width))
    assert torch.equal(out, expected), f"{name} width {width}: {(out.float() - expected.float()).abs().max()}"
    assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} width {width}")
    # beside the plan (OVERLAP: the schedule that does not read the location table)
    cfg = dataclasses.replace(base, schedule_width=width)
    assert torch.equal(gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg, after_plan=True), expected)
    if width and split_k2 == 1:  # one launch (its sync words are laid out by the width)
        one = dataclasses.replace(cfg, one_launch=True)
        assert torch.equal(gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, one), expected)
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize(("name", "H", "I", "dtype"), [FORMATS[0], FORMATS[3], FORMATS[7]])
@pytest.mark.parametrize(
    "cfg",
    [
        GemvConfig(16, 32, 16, 32, prefetch=False),
        GemvConfig(16, 64, 16, 64, prefetch=False, half_dot=True),
        GemvConfig(16, 32, 16, 64, stages=3),
        GemvConfig(16, 16, 16, 16, prefetch=False),
    ],
    ids=["no-prefetch", "half-dot", "pipelined", "short-tiles"],
)
def test_gemv_peel_is_bitwise_the_loop(name, H, I, dtype, cfg):
    """down's first K tile loaded ahead (`GemvConfig.down_peel`: it waits for gate_up after its loads): bitwise
    the loop's output (the same sums in the same order), a last tile past K (bf16 40 x 24; with tiles of 16 after
    a whole one: 24 = 16 + 8), rows of one tile (the half dot's down: int4 I = 64, NVFP4 I = 32 masked), host and
    unrouted pairs, beside the plan too; split K programs do not peel."""
    if cfg.half_dot and not name.startswith(("int4", "nvfp4")):
        pytest.skip("the half dot is int4's and NVFP4's")
    E, T, K = 7, 3, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[2, 0] = -1
    want = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    peel = dataclasses.replace(cfg, down_peel=True)
    for after_plan in (False, True):
        got = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, peel, after_plan=after_plan)
        assert torch.equal(got, want), f"{name} {cfg}: {(got.float() - want.float()).abs().max()}"
    split = dataclasses.replace(peel, split_k1=2, split_k2=2)
    assert_close(gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, split), want, f"{name} split")
    assert_close(want, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} reference")
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


def test_gemv_peel_refuses_the_register_prefetch_and_one_launch():
    for bad in (dict(), dict(prefetch=False, down_prefetch=1), dict(prefetch=False, one_launch=True)):
        with pytest.raises(ValueError, match="down_peel"):
            GemvConfig(down_peel=True, **bad)
    assert GemvConfig(down_peel=True, down_prefetch=0).down_peel  # gate_up's register prefetch is its own


@pytest.mark.parametrize("width", [-1, 3, 256])
def test_gemv_schedule_width_must_be_a_power_of_two(width):
    with pytest.raises(ValueError, match="schedule_width"):
        GemvConfig(schedule_width=width)
    with pytest.raises(ValueError, match="schedule_width"):
        GemvConfig(one_launch=True, schedule_width=0)


def test_gemv_rejects_bad_input():
    g, fmt, w13, w2, l2p = _layer("bf16", 40, 24, torch.bfloat16)
    x = torch.randn(2, 40, generator=g).bfloat16()
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_k"):
        gemv_gate_up(x, ids, l2p, 7, w13, fmt, GemvConfig(16, 48, 16, 32))
    with pytest.raises(ValueError, match="split_k1"):
        gemv_gate_up(x, ids, l2p, 7, w13, fmt, GemvConfig(16, 32, 16, 32, split_k1=0))
    with pytest.raises(ValueError, match="pairs"):
        wide = torch.zeros(200, 40).bfloat16()
        gemv_gate_up(wide, torch.zeros(200, 1, dtype=torch.int64), l2p, 7, w13, fmt, CONFIGS[0])
    with pytest.raises(ValueError, match="variant"):
        pooled_fused_moe(x, ids, torch.ones(2, 2), l2p, 7, w13, w2, fmt, variant="fast")
    # NVFP4: a tile of one word (8 values) would split a scale of 16 values; int4: it would leave a word without
    # its pair (the two are summed before the scale). A K of whole words but not whole units is checked directly
    # (neither format builds one).
    for name, H, unit in (("nvfp4", 48, "one e4m3 scale"), ("int4-g32", 64, "two int32 words")):
        _, fmt16, w13_16, _, l2p16 = _layer(name, H, 32, torch.bfloat16)
        x16 = torch.randn(2, H, generator=g).bfloat16()
        with pytest.raises(ValueError, match="block_k=8 must be a power of two >= 16"):
            gemv_gate_up(x16, ids, l2p16, 7, w13_16, fmt16, GemvConfig(16, 8, 16, 16))
        with pytest.raises(ValueError, match=rf"K=40 is not a multiple of 16 values \({unit}\)"):
            gemv_args._check_gemv(fmt16, 40, 16)
        assert not gemv_args.gemv_supported(fmt16, 40, 32) and gemv_args.gemv_supported(fmt16, H, 32), name
