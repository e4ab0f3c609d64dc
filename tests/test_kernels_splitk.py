"""The one-launch split path (kernels/splitk.py) against plain torch on the CPU, under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels import workspace
    from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe, pooled_fused_moe_ref
    from pooled_runner.kernels.operands import kernel_format
    from pooled_runner.kernels.splitk import SplitConfig, splitk_moe, splitk_moe_ref

from tests.kernel_helpers import assert_close, build_layer, random_routing

pytestmark = pytest.mark.interpreter(gpu="tests/test_kernels_gpu.py")


def _layer(name: str, H: int, I: int, dtype: torch.dtype, E: int = 7, R: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 31 * H + I)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype)
    fmt = kernel_format(fmt_obj)
    return g, fmt, *make_projections(fmt, pool, bank, H, I), l2p


def _torch_moe(x, ids, w, l2p, E, w13, w2):
    """Independent plain-torch MoE (fp32 throughout, no rounding but the output's), from the bank and pool."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0 or e >= E or int(l2p[e]) < 0:
                continue
            code, R = int(l2p[e]), w13.num_rows
            up = (w13.pool[0][code] if code < R else w13.bank[0][code - R]).float()
            down = (w2.pool[0][code] if code < R else w2.bank[0][code - R]).float()
            I = down.shape[1]
            gu = up @ x[t].float()
            out[t] += float(w[t, k]) * (down @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    return out


# (H, I, T, K, config): H not a multiple of the tiles, I with a ragged last slice, top-k not dividing the block
CASES = [
    (40, 24, 1, 3, SplitConfig(16, 32, 32, num_stages=1)),
    (64, 32, 2, 2, SplitConfig(16, 16, 16, num_stages=1)),
    (48, 40, 3, 5, SplitConfig(32, 32, 64, num_stages=1)),
    (33, 17, 7, 1, SplitConfig(16, 32, 32, num_stages=1)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "I", "T", "K", "cfg"), CASES)
def test_splitk_matches_references(H, I, T, K, cfg, dtype):
    g, fmt, w13, w2, l2p = _layer("bf16", H, I, dtype)
    for step in range(2):  # the second launch relies on the first having zeroed the sums and the counter
        x = torch.randn(T, H, generator=g).to(dtype)
        ids, w = random_routing(T, K, 7, g, pad_prob=0.2)
        if step == 1:
            ids[0] = -1  # a token with no pair routed here: its row must be written (zeros)
        out = splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfg)
        ref = splitk_moe_ref(x, ids, w, l2p, 7, w13, w2, fmt, cfg)
        # fp16: the reference's roundings exactly (sum order aside); bf16: the interpreter rounds bf16 its own
        # way (it stores bf16 as raw 16-bit words), so a few ulps apart
        assert_close(out, ref, f"splitk step {step}", rel=1e-3 if dtype == torch.float16 else 2e-2)
        assert_close(out, _torch_moe(x, ids, w, l2p, 7, w13, w2), f"splitk vs plain torch step {step}")
        assert_close(out, pooled_fused_moe_ref(x, ids, w, l2p, 7, w13, w2, fmt), f"splitk vs path ref {step}")
        if step == 1:
            assert torch.equal(out[0], torch.zeros_like(out[0])), "token with no routed pair: row not zero"
        sums = workspace._SUMS[(x.device, torch.float64)]
        assert not sums.any(), f"fp64 sums not zeroed after the launch: {sums.nonzero()[:5].tolist()}"
        cnt = workspace._COUNTERS[x.device][workspace.SYNC_WORDS]
        assert int(cnt) == 0, f"arrival counter left at {int(cnt)}"


def test_splitk_configs_per_card(monkeypatch):
    """`splitk_configs` on a CUDA device whose name `DEVICE_TILES` has returns that card's tiles, and without a
    device the default (CPU: the card's name and the compile mode faked; the launch through it: GPU tests)."""
    from pooled_runner.kernels import splitk

    monkeypatch.setattr(splitk, "interpreting", lambda: False)
    monkeypatch.setattr(splitk, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    h100 = splitk.splitk_configs(2048, 768, torch.device("cuda", 0))
    assert h100 == splitk.SplitConfig(block_h=128, num_warps=4), h100
    assert splitk.splitk_configs(2048, 768) == splitk.SplitConfig()


def test_splitk_overlap_and_variant():
    """OVERLAP (after_plan: pair by id, acquire loads) and the `variant="splitk"` dispatch give the same sums."""
    g, fmt, w13, w2, l2p = _layer("bf16", 40, 24, torch.bfloat16, seed=3)
    x = torch.randn(2, 40, generator=g).bfloat16()
    ids, w = random_routing(2, 4, 7, g)
    ref = splitk_moe_ref(x, ids, w, l2p, 7, w13, w2, fmt)
    cfg = SplitConfig(16, 32, 32, num_stages=1)
    plain = splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfg)
    assert_close(plain, ref, "splitk")
    # pairs taken by id (another program order): the same bits, as the fp64 sums promise
    assert torch.equal(splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfg, after_plan=True), plain), "overlap"
    # the dispatch really runs the split path (its default interpreter tiles are `cfg`), and picks it by default
    assert torch.equal(pooled_fused_moe(x, ids, w, l2p, 7, w13, w2, fmt, variant="splitk"), plain), "variant"
    # one token's pairs are distinct experts (two tokens' 8 pairs over 7 experts share too many for the default)
    one = splitk_moe(x[:1], ids[:1], w[:1], l2p, 7, w13, w2, fmt, cfg)
    assert torch.equal(pooled_fused_moe(x[:1], ids[:1], w[:1], l2p, 7, w13, w2, fmt), one), "default variant"


@pytest.mark.parametrize("T", [2, 5])  # 96 and 240 sums: 2 and 4 blocks of 64
def test_splitk_tail_in_blocks(T, monkeypatch):
    """The last program's rounding in several blocks (a cap of 64 sums per load here): the reference's values,
    and the same bits as in one block."""
    from pooled_runner.kernels import splitk

    g, fmt, w13, w2, l2p = _layer("bf16", 48, 40, torch.float16, seed=5)
    x = torch.randn(T, 48, generator=g).half()
    ids, w = random_routing(T, 3, 7, g, pad_prob=0.2)
    ref = splitk_moe_ref(x, ids, w, l2p, 7, w13, w2, fmt)
    base = SplitConfig(32, 32, 16, num_stages=1)
    one_block = splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt, base)
    assert_close(one_block, ref, "splitk", rel=1e-3)
    monkeypatch.setattr(splitk, "SPLITK_TAIL_MAX", 64)
    out = splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt, base)
    assert torch.equal(out, one_block), "blocks of 64: other bits than one block"
    assert not workspace._SUMS[(x.device, torch.float64)].any(), "sums not zeroed"
    assert int(workspace._COUNTERS[x.device][workspace.SYNC_WORDS]) == 0, "arrival counter not reset"


def test_splitk_no_pairs_writes_zeros():
    """K = 0 (no program runs): every row of the output is still written."""
    g, fmt, w13, w2, l2p = _layer("bf16", 40, 24, torch.bfloat16)
    x = torch.randn(3, 40, generator=g).bfloat16()
    ids, w = torch.empty(3, 0, dtype=torch.long), torch.empty(3, 0)
    out = splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt)
    assert out.shape == (3, 40) and not out.any(), "no routed pair: the output must be zeros"


def test_splitk_refuses_bad_input():
    g, fmt, w13, w2, l2p = _layer("int4-g32", 64, 32, torch.bfloat16)
    x = torch.randn(1, 64, generator=g).bfloat16()
    ids, w = random_routing(1, 2, 7, g)
    with pytest.raises(ValueError, match="dense weights only"):
        splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt)
    g, fmt, w13, w2, l2p = _layer("bf16", 40, 24, torch.bfloat16)
    x = torch.randn(11, 40, generator=g).bfloat16()
    ids, w = random_routing(11, 6, 7, g)  # 66 pairs
    with pytest.raises(ValueError, match="routed pairs"):
        splitk_moe(x, ids, w, l2p, 7, w13, w2, fmt)
    for bad in (SplitConfig(24, 32, 32), SplitConfig(16, 48, 32), SplitConfig(16, 32, 8)):
        with pytest.raises(ValueError, match="powers of two"):
            splitk_moe(x[:1], ids[:1], w[:1], l2p, 7, w13, w2, fmt, bad)
    with pytest.raises(ValueError, match="dtype"):
        splitk_moe(x[:1].half(), ids[:1], w[:1], l2p, 7, w13, w2, fmt)
