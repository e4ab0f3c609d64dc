"""GPU tests of the one-launch split path (kernels/splitk.py) at real sizes: resident layers of both DESIGN.md §4
shapes, pinned host rows with an expert not here, graph replay with new routing beside other work."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_gpu_helpers import SHAPES, gpu_reference, poison_allocator, pooled_reference, routing
from tests.kernel_helpers import assert_close

pytestmark = pytest.mark.gpu
# the tests of the real-shape bf16 layers (about 45 GB with their permuted pool copies; this module's and
# test_kernels_gpu.py's) run in one process, apart from the pytest-xdist workers of the other GPU tests
# (scripts/gpu_pytest.sh): two processes holding such layers would not fit an H100's 80 GB
LAYERS_GROUP = pytest.mark.real_shape_layers


@pytest.fixture(scope="module")
def layers():
    """bf16 layers of both shapes, every expert in a pool row (row r holds expert perm[r])."""
    from pooled_runner.kernels import fused_moe, operands

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(11)
    out = {}
    for name, (H, I, E, _) in SHAPES.items():
        # drawn in bf16 and scaled in place: fp32 draws peaked at ~60 GB for the DeepSeek-like layer, near an
        # H100's 80 (a later run of every kernel test saw this fixture fail to set up)
        w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16).div_(H**0.5)
        w2 = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16).div_(I**0.5)
        perm = torch.randperm(E, generator=g, device="cuda")
        l2p = torch.empty(E, dtype=torch.int32, device="cuda")
        l2p[perm] = torch.arange(E, dtype=torch.int32, device="cuda")
        fmt = operands.KernelFormat(0)
        p13, p2 = fused_moe.make_projections(fmt, {"w13": w13[perm], "w2": w2[perm]}, None, H, I)
        out[name] = (w13, w2, l2p, fmt, p13, p2)
    del w13, w2, perm, l2p, p13, p2  # else this frame keeps the last layer alive past empty_cache below
    yield out
    out.clear()
    torch.cuda.empty_cache()


@LAYERS_GROUP
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_splitk_resident_real_shapes(layers, shape, M):
    from pooled_runner.kernels.fused_moe import pooled_fused_moe
    from pooled_runner.kernels.splitk import splitk_moe

    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = layers[shape]
    g = torch.Generator(device="cuda").manual_seed(300 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    if M > 2:
        ids[1] = -1  # a token with no pair here: its row is zeros
    poison_allocator()
    out = pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="splitk")
    assert torch.equal(out, splitk_moe(x, ids, w, l2p, E, p13, p2, fmt)), (
        "the variant did not run the split path"
    )
    ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
    assert_close(out, ref, f"splitk {shape} M={M}")
    inline = pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="inline")
    assert_close(out, inline, f"splitk vs inline {shape} M={M}")
    if M > 2:
        assert torch.equal(out[1], torch.zeros_like(out[1])), "a token with no routed pair: row not zero"


@LAYERS_GROUP
@pytest.mark.parametrize(("shape", "M"), [("qwen3", 3), ("qwen3", 4), ("deepseek", 1), ("deepseek", 2)])
def test_splitk_repeated_launches_agree(layers, shape, M):
    """20 launches with fresh inputs, each twice: the same bits both times and the reference's values. Cases
    whose T*H takes the last program more than one block of sums (a form of 2026-12-03 without a barrier per
    block differed between launches in most of them)."""
    from pooled_runner.kernels.splitk import splitk_moe

    H, _, E, K = SHAPES[shape]
    w13, w2, l2p, fmt, p13, p2 = layers[shape]
    g = torch.Generator(device="cuda").manual_seed(500 + M)
    for launch in range(20):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        ids, w = routing(M, K, E, g)
        first = splitk_moe(x, ids, w, l2p, E, p13, p2, fmt)
        again = splitk_moe(x, ids, w, l2p, E, p13, p2, fmt)
        diff = (first != again).nonzero()
        assert diff.numel() == 0, f"launch {launch}: two launches differ at {diff[:5].tolist()}"
        if launch % 5 == 0:  # the reference is slow: every fifth launch
            ref = gpu_reference(x, ids, w, lambda e: w13[e], lambda e: w2[e])
            assert_close(first, ref, f"splitk {shape} M={M} launch {launch}")


def _mixed_layer(M: int):
    """Qwen3-like bf16 layer of 12 experts, 8 in pool rows, the rest pinned host rows, one not here."""
    from pooled_runner.kernels import fused_moe, operands

    from tests.kernel_helpers import build_layer

    H, I, _, K = SHAPES["qwen3"]
    E, R = 12, 8
    fmt_obj, pool, bank, l2p = build_layer(
        "bf16", H, I, E, R, torch.Generator().manual_seed(M), device="cuda"
    )
    bank = {k: v.pin_memory() for k, v in bank.items()}
    fmt = operands.kernel_format(fmt_obj)
    p13, p2 = fused_moe.make_projections(fmt, pool, bank, H, I)
    return H, E, K, l2p, fmt, p13, p2


@pytest.mark.parametrize("M", [1, 4])
def test_splitk_mixed_rows(M):
    from pooled_runner.kernels.fused_moe import pooled_fused_moe

    H, E, K, l2p, fmt, p13, p2 = _mixed_layer(M)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    out = pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="splitk")
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
    assert_close(out, ref, f"splitk mixed rows M={M}")
    # the same experts read through the host view only (build_layer's pool rows are copies of bank rows):
    # bitwise the same output, though the programs now finish in another order
    here = l2p[:E] >= 0
    host_codes = torch.where(here, p13.num_rows + torch.arange(E, device="cuda", dtype=torch.int32), -1)
    bank_codes = torch.cat([host_codes.int(), l2p[E:]])
    again = pooled_fused_moe(x, ids, w, bank_codes, E, p13, p2, fmt, variant="splitk")
    bad = (out != again).nonzero()
    assert not bad.numel(), f"pool rows vs host rows: outputs differ at {bad[:5].tolist()}"


@pytest.mark.parametrize("tail_max", [4096, 512])
def test_splitk_graph_replay_with_new_routing(tail_max, monkeypatch):
    """Captured steps replayed with new routing (host rows, padding) beside work on another stream: each
    replay equals the eager call bitwise (the fp64 sums do not depend on the programs' order) and matches the
    reference, and the workspace is back at zero after every replay. With a tail of 512 sums per block, the
    last program rounds in 8 blocks."""
    from pooled_runner.kernels import splitk, workspace
    from pooled_runner.kernels.fused_moe import pooled_fused_moe

    monkeypatch.setattr(splitk, "SPLITK_TAIL_MAX", tail_max)

    M = 2
    H, E, K, l2p, fmt, p13, p2 = _mixed_layer(M)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="splitk")  # compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="splitk")
    side = torch.cuda.Stream()
    for step in range(4):
        new_ids, new_w = routing(M, K, E, g)
        if step == 2:
            new_ids[0, 1] = -1  # padding inside the graph
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(M, H, generator=g, device="cuda").bfloat16())
        with torch.cuda.stream(side):  # unrelated work beside the replay
            busy = torch.randn(4096, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda")
        graph.replay()
        torch.cuda.synchronize()
        sums = workspace._SUMS[(x.device, torch.float64)]
        assert not sums.any(), f"step {step}: fp64 sums not zeroed: {sums.nonzero()[:5].tolist()}"
        eager = pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="splitk")
        bad = (out != eager).nonzero()
        assert not bad.numel(), f"step {step}: replay differs from eager at {bad[:5].tolist()} (fp64 sums)"
        ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
        assert_close(out, ref, f"step {step}: replay vs reference")
        del busy


@LAYERS_GROUP
@pytest.mark.parametrize("M", [1, 3])
def test_splitk_fp32_sums_close_to_default(layers, M):
    """The bench's fp32-sums form: within rounding of the default (fp64) form."""
    import dataclasses

    from pooled_runner.kernels.splitk import splitk_configs, splitk_moe

    H, _, E, K = SHAPES["qwen3"]
    _, _, l2p, fmt, p13, p2 = layers["qwen3"]
    g = torch.Generator(device="cuda").manual_seed(400 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    base = splitk_moe(x, ids, w, l2p, E, p13, p2, fmt)
    cfg = dataclasses.replace(splitk_configs(H, 768, x.device), fp32_sums=True)
    assert_close(splitk_moe(x, ids, w, l2p, E, p13, p2, fmt, cfg), base, f"fp32 sums M={M}", rel=1e-2)


@LAYERS_GROUP
def test_splitk_device_tiles(layers, monkeypatch):
    """The decode path launches with this card's `DEVICE_TILES` entry: one naming this card an invalid tile makes
    `splitk_moe` (no config given) refuse it, on any card. The H100 SXM is in the table; another card gets the
    default tile (or one stage less where its blocks get too little shared memory)."""
    from pooled_runner.kernels import splitk

    H, I, E, K = SHAPES["qwen3"]
    _, _, l2p, fmt, p13, p2 = layers["qwen3"]
    g = torch.Generator(device="cuda").manual_seed(600)
    x = torch.randn(1, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(1, K, E, g)
    name = torch.cuda.get_device_name(x.device)
    cfg = splitk.splitk_configs(H, I, x.device)
    if "H100" in name and "HBM3" in name:
        assert name in splitk.DEVICE_TILES, f"{name!r}: not in DEVICE_TILES ({sorted(splitk.DEVICE_TILES)})"
    if name in splitk.DEVICE_TILES:
        assert cfg == splitk.DEVICE_TILES[name], (
            f"{name}: {cfg}, DEVICE_TILES has {splitk.DEVICE_TILES[name]}"
        )
    else:
        assert cfg in (splitk.SplitConfig(), splitk.SplitConfig(num_stages=3)), f"{name}: {cfg}"
    monkeypatch.setitem(splitk.DEVICE_TILES, name, splitk.SplitConfig(block_h=24))
    with pytest.raises(ValueError, match="powers of two"):
        splitk.splitk_moe(x, ids, w, l2p, E, p13, p2, fmt)


@LAYERS_GROUP
@pytest.mark.parametrize("M", [1, 2])
def test_splitk_every_card_tile(layers, M):
    """Every card's tile of `DEVICE_TILES`, run on this card: the default tile's sums and the reference's values
    (the H100's tile is otherwise only run where an H100 runs the tests)."""
    from pooled_runner.kernels.splitk import DEVICE_TILES, SplitConfig, splitk_moe

    H, _, E, K = SHAPES["qwen3"]
    _, _, l2p, fmt, p13, p2 = layers["qwen3"]
    g = torch.Generator(device="cuda").manual_seed(700 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    base = splitk_moe(x, ids, w, l2p, E, p13, p2, fmt, SplitConfig())
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
    for name, cfg in DEVICE_TILES.items():
        out = splitk_moe(x, ids, w, l2p, E, p13, p2, fmt, cfg)
        assert_close(out, base, f"{name} tile vs the default tile M={M}", rel=1e-3)
        assert_close(out, ref, f"{name} tile vs reference M={M}")
