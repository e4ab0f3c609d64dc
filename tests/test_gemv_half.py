"""NVFP4's and int4's packed half word dot (`GemvConfig.half_dot`, kernels/gemv_half.py) under the Triton
interpreter (its fp32 emulation of `fma.rn.f16x2`; the PTX form: tests/test_gemv_half_gpu.py): the references' output at awkward
sizes, x rows over many decades, the row scale's chunked loop, bad configs refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_helpers import assert_close, packed_x_pairs, random_routing, record_x_pairs_workspaces
from tests.test_kernels_gemv import (
    GemvConfig,
    _layer,
    gemv_args,
    gemv_gate_up,
    gemv_moe,
    gemv_moe_ref,
    pooled_fused_moe_ref,
)

pytestmark = pytest.mark.interpreter(gpu="tests/test_gemv_half_gpu.py")


@pytest.mark.parametrize(
    ("name", "H", "I", "T", "cfg", "chunk"),
    [
        ("nvfp4", 48, 96, 3, GemvConfig(16, 32, 16, 32), 8192),  # gate_up K = 1.5 tiles (masked), prefetch
        ("nvfp4", 80, 48, 1, GemvConfig(16, 32, 8, 64, prefetch=False), 16),  # down K < a tile; scale chunks
        ("nvfp4", 64, 32, 2, GemvConfig(32, 64, 16, 32, stages=3), 32),  # rows past N in gate_up; a pipeline
        ("int4-g32", 96, 64, 3, GemvConfig(16, 64, 16, 32), 32),  # scale per word (two groups a tile)
        ("nvfp4", 64, 96, 2, GemvConfig(16, 32, 16, 32, split_k1=2, split_k2=3), 16),  # a scale per K share
        ("int4-g32-zp", 64, 96, 1, GemvConfig(32, 32, 16, 64, prefetch=False), 8192),  # zero points
        ("int4-g64-zp", 128, 64, 2, GemvConfig(16, 64, 8, 64, stages=3), 64),  # one group a tile: per row
    ],
)
def test_half_dot_matches_references(name, H, I, T, cfg, chunk, monkeypatch):
    """E = 7 experts on 3 pool rows and host rows, top-3 with one pair not routed (-1), x with an outlier of 300
    (in the row scale's last chunk) and a value of 1e-3: the half dot gives the path's fp32
    reference and the align path's dense reference within bf16 rounding, and the fp32 word dot's output within 1e-2 (it is not bitwise that output: the half
    path ran); act rows of routed pairs likewise."""
    monkeypatch.setattr(gemv_args, "X_SCALE_CHUNK", chunk)  # `_half_x` reads it there
    E, K = 7, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, torch.bfloat16, E, seed=9)
    x = torch.randn(T, H, generator=g)
    x[0, H - 5], x[-1, 1] = 300.0, 1e-3  # the outlier in the row scale's last chunk
    x = x.bfloat16()
    ids, w = random_routing(T, K, E, g)
    ids[-1, 1] = -1
    half_cfg = dataclasses.replace(cfg, half_dot=True)
    half = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, half_cfg)
    fp32 = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    assert not torch.equal(half, fp32), "half_dot did not reach the kernels"
    assert_close(half, fp32, f"{name} H={H} I={I} T={T}: half vs fp32 word dot", rel=1e-2)
    assert_close(
        half, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt, cfg), f"{name} H={H} I={I} T={T}: gemv reference"
    )
    assert_close(
        half, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} H={H} I={I}: align reference"
    )
    routed = (ids.flatten() >= 0) & (l2p[ids.flatten().clamp(min=0)] >= 0)
    act_half = gemv_gate_up(x, ids, l2p, E, w13, fmt, half_cfg)[: T * K][routed]
    act_fp32 = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)[: T * K][routed]
    assert_close(act_half, act_fp32, f"{name} H={H} I={I} T={T}: act", rel=1e-2)


@pytest.mark.parametrize("name", ["nvfp4", "int4-g32-zp"])
def test_half_dot_row_scale_over_decades(name):
    """x rows of 1e-12 and 1e15 (the row scale moves with them; products stay in fp16's range) and a row of zeros:
    the fp32 word dot's output within 1e-2, zeros exactly for the zero row."""
    E, K, H, I = 5, 2, 64, 32
    g, fmt, w13, w2, l2p = _layer(name, H, I, torch.bfloat16, E, R=5, seed=4)
    cfg = GemvConfig(16, 32, 16, 32)
    ids, w = random_routing(3, K, E, g, pad_prob=0.0)
    x = torch.randn(3, H, generator=g)
    for s in (1e-12, 1e15):
        xs = x * s
        xs[2] = 0.0
        xs = xs.bfloat16()
        half = gemv_moe(xs, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(cfg, half_dot=True))
        fp32 = gemv_moe(xs, ids, w, l2p, E, w13, w2, fmt, cfg)
        assert fp32[:2].float().abs().max() > 0, f"scale {s}: the reference output vanished"
        assert_close(half[:2], fp32[:2], f"{name}: x scaled by {s}", rel=1e-2)
        assert torch.equal(half[2], torch.zeros_like(half[2])), f"{name}: zero row at scale {s}"


def test_half_dot_refused_where_it_has_no_kernel():
    """half_dot with fp8 (no half word dot): ValueError naming the fix, in two launches and in one."""
    g, fmt, w13, w2, l2p = _layer("fp8", 64, 32, torch.bfloat16, seed=2)
    x = torch.randn(1, 64, generator=g).bfloat16()
    ids, w = random_routing(1, 2, 7, g, pad_prob=0.0)
    with pytest.raises(ValueError, match="half_dot is NVFP4's and int4's word dot"):
        gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, GemvConfig(16, 32, 16, 32, half_dot=True))
    with pytest.raises(ValueError, match="half_dot is NVFP4's and int4's word dot"):
        gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, GemvConfig(16, 32, 16, 32, half_dot=True, one_launch=True))


@pytest.mark.parametrize("name", ["nvfp4", "int4-g32-zp"])
def test_half_dot_one_launch_equals_two(name):
    """half_dot in one launch (`gemv_one`): bitwise the two launches' output (the same tiles and sums)."""
    E, K, H, I = 7, 3, 64, 32
    g, fmt, w13, w2, l2p = _layer(name, H, I, torch.bfloat16, E, seed=6)
    x = torch.randn(2, H, generator=g).bfloat16()
    ids, w = random_routing(2, K, E, g)
    cfg = GemvConfig(16, 32, 16, 32, half_dot=True)
    two = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    one = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(cfg, one_launch=True))
    assert torch.equal(one, two), (one.float() - two.float()).abs().max()


def _packed_shares(x: torch.Tensor, block_k: int, split: int, top: int) -> torch.Tensor:
    """`packed_x_pairs` of each K share of `x [K]` with its own scale, as a program of a split K packs its share
    (`split` shares of whole K tiles, as `gemv._k_split` cuts them), concatenated: `[K / 8, 4]`."""
    K = x.numel()
    per_split = -(-max(-(-K // block_k), 1) // split)
    share = per_split * block_k
    return torch.cat([packed_x_pairs(x[lo : lo + share], top) for lo in range(0, K, share)])


@pytest.mark.parametrize(
    ("name", "H", "I", "T", "cfg"),
    [
        ("nvfp4", 48, 96, 3, GemvConfig(16, 32, 16, 32)),  # gate_up K = 1.5 tiles (masked), prefetch
        ("nvfp4", 64, 96, 2, GemvConfig(16, 32, 16, 32, split_k1=2, split_k2=3, prefetch=False)),  # K shares
        ("int4-g32-zp", 64, 96, 1, GemvConfig(32, 32, 16, 64, prefetch=False)),  # zero points; down 1.5 tiles
        ("int4-g32-zp", 96, 32, 2, GemvConfig(16, 64, 16, 64)),  # gate_up 1.5 tiles; down K < a tile
        ("int4-g64", 128, 64, 3, GemvConfig(16, 64, 8, 64, stages=3)),  # a pipeline
    ],
)
def test_packed_x_gives_the_half_dots_output(name, H, I, T, cfg, monkeypatch):
    """`half_x_pack` (x' packed once per program, loaded by the K loop): bitwise the half dot's output (the same
    x' values and sums); each routed token's row of gate_up's workspace and each routed pair's row of down's
    hold the x' (act') pairs a torch packing of the scaled row gives, each K share with its own scale (E = 7
    on 3 pool rows, one pair not routed)."""
    E, K = 7, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, torch.bfloat16, E, seed=11)
    x = torch.randn(T, H, generator=g)
    x[0, 5] = 40.0
    x = x.bfloat16()
    ids, w = random_routing(T, K, E, g)
    ids[-1, 0] = -1
    half = dataclasses.replace(cfg, half_dot=True)
    act = gemv_gate_up(x, ids, l2p, E, w13, fmt, half)
    workspaces = record_x_pairs_workspaces(monkeypatch)
    want = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, half)
    assert workspaces == [], "the half dot alone has no workspace"
    workspaces.clear()
    got = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(half, half_x_pack=True))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert [ws.shape for ws in workspaces] == [(T, H // 2), (T * K, I // 2)]
    top = 13 if name == "nvfp4" else 8  # gemv_half.NVFP4_TOP, INT4_TOP
    pair_routed = (ids.flatten() >= 0) & (l2p[ids.flatten().clamp(min=0)] >= 0)
    for t in range(T):
        if pair_routed[t * K : (t + 1) * K].any():
            want_row = _packed_shares(x[t], cfg.block_k1, cfg.split_k1, top)
            assert torch.equal(workspaces[0][t].view(-1, 4), want_row), f"gate_up, token {t}"
    for p in range(T * K):
        if pair_routed[p]:
            want_row = _packed_shares(act[p], cfg.block_k2, cfg.split_k2, top)
            assert torch.equal(workspaces[1][p].view(-1, 4), want_row), f"down, pair {p}"


def test_packed_x_refused_without_the_half_dot_or_in_one_launch():
    with pytest.raises(ValueError, match="half_x_pack packs the half dot's x"):
        GemvConfig(half_x_pack=True)
    with pytest.raises(ValueError, match="one_launch=True"):
        GemvConfig(half_dot=True, half_x_pack=True, one_launch=True)
    assert GemvConfig(half_dot=True, half_x_pack=True).half_x_pack


def test_nvfp4_default_tiles_with_masked_last_tiles(monkeypatch):
    """NVFP4's compiled default (`gemv_configs` off the interpreter: the half dot, K tiles of 512 in gate_up and
    in down where I is whole 512 tiles) at H = I = 528: both kernels' last K tile masked (16 of 512 values, down
    set to 512 too); two launches, split K over 2, and one launch (down's own cap reset). Against the dense
    reference and the fp32 dot at the same tiles."""
    from pooled_runner.kernels import gemv_config
    from pooled_runner.kernels.dequant import FMT_NVFP4

    H, I, E, K, T = 528, 528, 5, 2, 1
    monkeypatch.setattr(gemv_config, "interpreting", lambda: False)
    base = gemv_config.gemv_configs(H, I, FMT_NVFP4, T * K)
    monkeypatch.undo()
    assert base.half_dot and base.block_k1 == 512 and base.block_k2 == 256, (
        base
    )  # I = 528: not whole 512 tiles
    g, fmt, w13, w2, l2p = _layer("nvfp4", H, I, torch.bfloat16, E, seed=3)
    x = torch.randn(T, H, generator=g)
    x[0, H - 3] = 200.0  # in the masked tile's live part
    x = x.bfloat16()
    ids, w = random_routing(T, K, E, g, pad_prob=0.0)
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    cfg = dataclasses.replace(base, block_k2=512)
    fp32 = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(cfg, half_dot=False))
    configs = [
        cfg,
        dataclasses.replace(cfg, split_k1=2, split_k2=2),
        dataclasses.replace(cfg, one_launch=True, down_max_registers=-1, down_peel=False),
    ]
    for c in configs:
        out = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, c)
        assert_close(out, ref, f"NVFP4 default tiles {c} vs dense reference")
        assert_close(out, fp32, f"NVFP4 default tiles {c} vs fp32 dot", rel=1e-2)


def test_int4_default_wide_tiles_at_one_token(monkeypatch):
    """int4's compiled default at one token on a layer of whole 512 tiles (`gemv_configs` off the interpreter:
    `_int4_wide`, the half dot with K tiles of 512 in both kernels) at H = I = 512, group 128 with zero points:
    four groups per tile, so each word loads its own scale and zero point (`gemv_tiles._load_words`' general path). Two launches and one launch (down's own cap reset),
    against the dense reference and the fp32 dot at the same tiles."""
    from pooled_runner.kernels import gemv_config
    from pooled_runner.kernels.dequant import FMT_INT4

    H, I, E, K, T = 512, 512, 5, 2, 1
    monkeypatch.setattr(gemv_config, "interpreting", lambda: False)
    # 3 SMs: 2 pairs x 8 down blocks of 64 rows = 16 programs, over one wave of 12 and within two (`_int4_wide`)
    monkeypatch.setattr(gemv_config, "_num_sms", lambda: 3)
    base = gemv_config.gemv_configs(H, I, FMT_INT4, T * K, 128)
    monkeypatch.undo()
    assert base.half_dot and (base.block_k1, base.block_k2) == (512, 512), base
    g, fmt, w13, w2, l2p = _layer("int4-g128-zp", H, I, torch.bfloat16, E, seed=5)
    x = torch.randn(T, H, generator=g)
    x[0, H - 3] = 200.0
    x = x.bfloat16()
    ids, w = random_routing(T, K, E, g, pad_prob=0.0)
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    fp32 = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, dataclasses.replace(base, half_dot=False))
    for c in (base, dataclasses.replace(base, one_launch=True, down_max_registers=-1, down_peel=False)):
        out = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, c)
        assert not torch.equal(out, fp32), "half_dot did not reach the kernels"
        assert_close(out, ref, f"int4 default wide tiles {c} vs dense reference")
        assert_close(out, fp32, f"int4 default wide tiles {c} vs fp32 dot", rel=1e-2)
