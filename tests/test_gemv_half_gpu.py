"""GPU tests of NVFP4's and int4's packed half word dot (`GemvConfig.half_dot`, kernels/gemv_half.py) as compiled for CUDA
(PTX `fma.rn.f16x2`; the interpreter runs its fp32 emulation: tests/test_gemv_half.py). Run by
scripts/gpu_check.sh."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_gpu_helpers import SHAPES, poison_allocator, pooled_reference, routing
from tests.kernel_helpers import assert_close, build_layer, packed_x_pairs, record_x_pairs_workspaces

pytestmark = pytest.mark.gpu


def _layer(name: str, shape: str, E: int, R: int, seed: int):
    from pooled_runner.kernels import fused_moe, operands

    H, I, _, _ = SHAPES[shape]
    fmt_obj, pool, bank, l2p = build_layer(
        name, H, I, E, R, torch.Generator().manual_seed(seed), device="cuda"
    )
    bank = {k: v.pin_memory() for k, v in bank.items()}
    fmt = operands.kernel_format(fmt_obj)
    return fmt, *fused_moe.make_projections(fmt, pool, bank, H, I), l2p


@pytest.mark.parametrize(
    ("name", "shape", "M"),
    [
        ("nvfp4", "deepseek", 1),
        ("nvfp4", "deepseek", 8),
        ("nvfp4", "qwen3", 1),
        ("nvfp4", "qwen3", 16),
        ("int4-g128", "deepseek", 1),
        ("int4-g128-zp", "deepseek", 8),
        ("int4-g32", "qwen3", 16),
    ],
)
def test_half_dot_against_fp32_dot_and_dense_reference(name, shape, M):
    """The DeepSeek-like and Qwen3-like NVFP4 and int4 layers at M = 1, 8, 16 (the 128-pair schedule) with pool rows,
    pinned host rows and an expert not here; x with outliers of 300 and values down to 1e-3: the half dot is
    within bf16 rounding of the fp32 word dot (the same config otherwise) and of the dense torch reference,
    and every output is written (poisoned allocator)."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.gemv import gemv_configs

    H, I, _, K = SHAPES[shape]
    E, R = 13, 9
    fmt, p13, p2, l2p = _layer(name, shape, E, R, seed=M)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, generator=g, device="cuda")
    x[0, 5], x[-1, H - 3] = 300.0, -1e-3
    x = x.bfloat16()
    ids, w = routing(M, K, E, g)
    base = gemv_configs(H, I, fmt.fmt, M * K, fmt.group)
    assert fmt.fmt == {"nvfp4": 4, "int4": 1}[name.split("-")[0]], (name, fmt.fmt)
    poison_allocator()
    # NVFP4's default is the half dot (K tiles of 512): the fp32 dot at the same tiles is the comparison
    half_cfg = dataclasses.replace(base, half_dot=True)
    fp32_cfg = dataclasses.replace(base, half_dot=False)
    half = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=half_cfg)
    fp32 = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=fp32_cfg)
    assert_close(half, fp32, f"{name}: half vs fp32 dot {shape} M={M}", rel=1e-2)
    ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
    assert_close(half, ref, f"{name}: half dot vs dense reference {shape} M={M}")
    # x' packed once per program (`half_x_pack`): the same x' values and sums, so bitwise the half dot's output at
    # the same tiles; also gpu_check.sh's alternative with gate_up's K tiles of 512, against the dense reference
    for cfg in (dataclasses.replace(half_cfg, half_x_pack=True),
                dataclasses.replace(half_cfg, half_x_pack=True, block_k1=512, max_registers=128,
                                    down_max_registers=96)):  # fmt: skip
        packed = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=cfg)
        if cfg.block_k1 == half_cfg.block_k1:
            assert torch.equal(packed, half), (packed.float() - half.float()).abs().max()
        assert_close(packed, ref, f"{name}: packed x vs dense reference {shape} M={M} ({cfg})")


@pytest.mark.parametrize("name", ["nvfp4", "int4-g128-zp"])
def test_half_dot_row_scale_extremes(name):
    """x rows scaled by 1e-12 and 1e15 (the row scale's power of two moves with them) and an all-zero row: the
    outputs follow the fp32 word dot's (zeros exactly for the zero row)."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.gemv import gemv_configs

    H, I, _, K = SHAPES["qwen3"]
    E, R = 9, 9
    fmt, p13, p2, l2p = _layer(name, "qwen3", E, R, seed=3)
    g = torch.Generator(device="cuda").manual_seed(3)
    ids, w = routing(3, K, E, g)
    base = dataclasses.replace(gemv_configs(H, I, fmt.fmt, 3 * K, fmt.group), half_dot=False)
    half_cfg = dataclasses.replace(base, half_dot=True)
    x = torch.randn(3, H, generator=g, device="cuda")
    for s in (1e-12, 1e15):
        xs = x * s
        xs[2] = 0.0
        xs = xs.bfloat16()
        half = fused_moe.pooled_fused_moe(
            xs, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=half_cfg
        )
        fp32 = fused_moe.pooled_fused_moe(xs, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=base)
        assert_close(half[:2], fp32[:2], f"{name}: x scaled by {s}", rel=1e-2)
        assert torch.equal(half[2], torch.zeros_like(half[2])), (
            f"zero row at scale {s}: {half[2].abs().max()}"
        )


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("nvfp4", dict(split_k1=2, split_k2=2)),  # programs pack disjoint shares of a row, each its own scale
        ("int4-g128-zp", dict(block_k2=512)),  # down K = 768: 1.5 tiles, the last masked (q - z != 0 there)
        ("int4-g32", dict(stages=3)),  # the pair loads in Triton's pipeline (cp.async)
        (
            "nvfp4",
            dict(prefetch=True, down_peel=False),
        ),  # the register prefetch (its own peel: none of down_peel)
    ],
)
def test_packed_x_in_split_masked_and_pipelined_loops(name, cfg, monkeypatch):
    """Qwen3-like layer, M = 5: packed x gives bitwise the half dot's output in the configs where programs write
    different parts of one workspace row (split K), the loop's last tile is masked, and the pair loads are
    pipelined or prefetched; gate_up's workspace rows (recorded) hold the scaled x as a torch packing gives it
    (without split K). The interpreter runs programs one at a time: only here do they race."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.gemv import gemv_configs

    H, I, _, K = SHAPES["qwen3"]
    E, R, M = 13, 9, 5
    fmt, p13, p2, l2p = _layer(name, "qwen3", E, R, seed=17)
    g = torch.Generator(device="cuda").manual_seed(17)
    x = torch.randn(M, H, generator=g, device="cuda")
    x[1, 7] = 120.0
    x = x.bfloat16()
    ids, w = routing(M, K, E, g)
    half = dataclasses.replace(gemv_configs(H, I, fmt.fmt, M * K, fmt.group), half_dot=True, **cfg)
    want = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=half)
    workspaces = record_x_pairs_workspaces(monkeypatch)
    packed_cfg = dataclasses.replace(half, half_x_pack=True)
    got = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=packed_cfg)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert workspaces and workspaces[0].shape == (M, H // 2), [ws.shape for ws in workspaces]
    if half.split_k1 == 1:
        top = 13 if fmt.fmt == 4 else 8  # gemv_half.NVFP4_TOP, INT4_TOP
        routed = ((ids >= 0) & (l2p[ids.clamp(min=0)] >= 0)).any(dim=1).tolist()
        for t in (t for t in range(M) if routed[t]):
            want_row = packed_x_pairs(x[t], top)
            assert torch.equal(workspaces[0][t].view(-1, 4), want_row), f"token {t}"


@pytest.mark.parametrize("field", ["host_wide", "host_tall"])
@pytest.mark.parametrize(
    ("name", "shape", "M"),
    [("nvfp4", "deepseek", 1), ("nvfp4", "qwen3", 1), ("nvfp4", "qwen3", 8), ("int4-g128", "deepseek", 1)],
)
def test_host_wide_tiles_against_plain_tiles_and_reference(name, shape, M, field):
    """Host rows in their own tiles, compiled for CUDA: half the rows and twice the K (`GemvConfig.host_wide`), or
    down's twice the rows (`host_tall`), on layers with pinned host rows: within bf16 rounding of the plain tiles
    and of the dense torch reference, every output written (poisoned allocator); on a layer without host rows,
    bitwise the plain tiles' output (pool rows take the same tiles)."""
    from pooled_runner.kernels import fused_moe, gemv
    from pooled_runner.kernels.gemv import gemv_configs

    H, I, _, K = SHAPES[shape]
    E = 13
    g = torch.Generator(device="cuda").manual_seed(40 + M)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    ids, w = routing(M, K, E, g)
    poison_allocator()
    for R in (5, E):  # 8 of 13 experts on the host, then none
        fmt, p13, p2, l2p = _layer(name, shape, E, R, seed=40 + M)
        base = gemv_configs(H, I, fmt.fmt, M * K, fmt.group)
        plain, wide = (dataclasses.replace(base, **{field: on}) for on in (False, True))
        # host_tall runs only where down's K is not split and host_wide does not take down (`gemv_args`)
        assert field != "host_tall" or (base.split_k2 == 1 and not base.host_wide), base
        got = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=wide)
        want = fused_moe.pooled_fused_moe(x, ids, w, l2p, E, p13, p2, fmt, variant="gemv", gemv_config=plain)
        if R == E:
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()
            continue
        assert bool((l2p[ids] >= R).any()), "no host pair routed"
        assert_close(got, want, f"{name}: {field} vs plain tiles {shape} M={M}", rel=1e-2)
        ref = pooled_reference(x, ids, w, l2p, E, p13, p2, fmt)
        assert_close(got, ref, f"{name}: {field} vs dense reference {shape} M={M}")
        assert int(gemv._COUNTERS[x.device].abs().sum()) == 0, "arrival counters not reset"
