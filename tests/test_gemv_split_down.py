"""The GEMV down kernel with K split over programs (`GemvConfig.split_k2`), under the Triton interpreter: the
references' output at awkward sizes, the arrival counters back at zero, bitwise repeatable, bad configs refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_helpers import assert_close, random_routing
from tests.test_kernels_gemv import (
    GemvConfig,
    _layer,
    gemv,
    gemv_down_combine,
    gemv_gate_up,
    gemv_moe,
    gemv_moe_ref,
    pooled_fused_moe_ref,
)

pytestmark = pytest.mark.interpreter(gpu="tests/test_decode_variants_gpu.py")
SEED = 3


# (format, H, I, dtype): down's K is I; with K tiles of 32 values: 3 tiles (the last partial for bf16's 72),
# 3, 3, 2 (int4 with zero points, fp16)
SPLIT_FORMATS = [
    ("bf16", 40, 72, torch.bfloat16),
    ("int4-g32", 64, 96, torch.bfloat16),
    ("nvfp4", 48, 96, torch.bfloat16),
    ("int4-g32-zp", 32, 64, torch.float16),
]


@pytest.mark.parametrize(("name", "H", "I", "dtype"), SPLIT_FORMATS)
@pytest.mark.parametrize(
    ("split", "cfg"),
    [
        (2, GemvConfig(16, 32, 16, 32)),
        (3, GemvConfig(16, 32, 16, 32, prefetch=False)),
        (5, GemvConfig(16, 32, 8, 32, stages=3)),  # more splits than K tiles; 8 rows a block
    ],
)
def test_gemv_split_k_down(name, H, I, dtype, split, cfg):
    """down with K split over `split` programs per (pair, N block), a pair not routed (-1) and host and pool
    rows: the references' output; counters back at zero; a second call bitwise the first (on the interpreter the
    last arrival is always the same program: arrival-order independence is the GPU graph replay test's); within
    fp32 summation order of the unsplit kernel."""
    E, T, K = 7, 3, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E, seed=SEED)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[2, 1] = -1
    split_cfg = dataclasses.replace(cfg, split_k2=split)
    act = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)
    out = gemv_down_combine(act, ids, w, l2p, E, w2, fmt, split_cfg)
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
    assert torch.equal(gemv_down_combine(act, ids, w, l2p, E, w2, fmt, split_cfg), out)
    unsplit = gemv_down_combine(act, ids, w, l2p, E, w2, fmt, cfg)
    assert_close(out, unsplit, f"{name} split_k2 {split} vs unsplit")
    layer = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, split_cfg)
    assert_close(layer, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt, cfg), f"{name} split_k2 {split} layer")
    assert_close(layer, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} vs align reference")


def test_gemv_split_k_both_and_one_token():
    """gate_up and down both split, one token with top-1 on a host row (one program per N block and split),
    then top-8 over an odd expert count with every pair on one pool row (the K arrivals of one block read one
    expert's parts)."""
    E, H, I, R = 9, 64, 96, 4
    g, fmt, w13, w2, l2p = _layer("nvfp4", H, I, torch.bfloat16, E, R=R, seed=SEED)
    codes = l2p[:E].tolist()
    host = next(e for e in range(E) if codes[e] >= R)
    pool = next(e for e in range(E) if 0 <= codes[e] < R)
    cfg = GemvConfig(16, 32, 16, 32, split_k1=2, split_k2=3)
    for ids in (torch.tensor([[host]]), torch.full((2, 8), pool)):
        x = torch.randn(ids.shape[0], H, generator=g).bfloat16()
        w = torch.rand(ids.shape, generator=g)
        out = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
        assert_close(out, gemv_moe_ref(x, ids, w, l2p, E, w13, w2, fmt, cfg), f"ids {tuple(ids.shape)}")
        assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


def test_gemv_split_k_down_rejects_bad_configs():
    g, fmt, w13, w2, l2p = _layer("int4-g32", 64, 96, torch.bfloat16, seed=SEED)
    x = torch.randn(2, 64, generator=g).bfloat16()
    ids, w = random_routing(2, 2, 7, g)
    act = gemv_gate_up(x, ids, l2p, 7, w13, fmt, GemvConfig(16, 32, 16, 32))
    with pytest.raises(ValueError, match="split_k2=0 must be >= 1"):
        gemv_down_combine(act, ids, w, l2p, 7, w2, fmt, GemvConfig(16, 32, 16, 32, split_k2=0))
    with pytest.raises(ValueError, match="split_k2=2 needs fuse_combine"):
        gemv_down_combine(
            act, ids, w, l2p, 7, w2, fmt, GemvConfig(16, 32, 16, 32, split_k2=2, fuse_combine=False)
        )
    with pytest.raises(ValueError, match="split_k2=2 are for the two-launch path"):
        gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, GemvConfig(16, 32, 16, 32, split_k2=2, one_launch=True))
