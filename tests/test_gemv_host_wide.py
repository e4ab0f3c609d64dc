"""Host rows in tiles of half the rows and twice the K (`GemvConfig.host_wide`) on the CPU, under Triton's
interpreter: host pairs against the references, pool pairs bitwise the plain tiles, and the fallback where K is not
whole wide tiles."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels import gemv, gemv_args
    from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe_ref
    from pooled_runner.kernels.gemv import (
        GemvConfig,
        gemv_down_combine,
        gemv_down_combine_ref,
        gemv_gate_up,
        gemv_gate_up_ref,
        gemv_moe,
    )
    from pooled_runner.kernels.operands import kernel_format

from tests.kernel_helpers import assert_close, build_layer, random_routing

pytestmark = pytest.mark.interpreter(gpu="tests/test_gemv_half_gpu.py")

# (format, H, I, dtype, config): K tiles of 32 (wide: 64) in both kernels unless said
_HALF = GemvConfig(16, 32, 16, 32, prefetch=False, half_dot=True, down_peel=True)
CASES = [
    ("nvfp4", 64, 64, torch.bfloat16, _HALF),
    ("nvfp4", 128, 64, torch.bfloat16, GemvConfig(8, 32, 32, 32, prefetch=False)),  # fp32 dot, 8-row blocks
    ("int4-g32-zp", 128, 64, torch.float16, GemvConfig(16, 32, 16, 32, stages=3)),  # pipelined
    ("bf16", 64, 64, torch.bfloat16, GemvConfig(16, 16, 16, 16)),  # the register prefetch
    ("fp8", 64, 40, torch.bfloat16, GemvConfig(16, 16, 16, 16, prefetch=False)),  # I past a gate_up block
    # H = 96 over down blocks of 64: the last block's second half lies past H (skipped); I = 48 over gate_up
    # blocks of 32: the second block's second half lies past I (skipped)
    ("bf16", 96, 48, torch.bfloat16, GemvConfig(32, 16, 64, 8, prefetch=False, down_peel=True)),
]


def _layer(name, H, I, dtype, E=7, R=3, seed=0):
    g = torch.Generator().manual_seed(seed + 3 * H + I)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype)
    fmt = kernel_format(fmt_obj)
    return g, fmt, *make_projections(fmt, pool, bank, H, I), l2p


class _LaunchSpy:
    """Records each launch's constexpr `flag` (HOST_WIDE, HOST_TALL) of the wrapped kernel in `flags` (so a test
    knows the host tiles ran)."""

    def __init__(self, kernel, flag="HOST_WIDE"):
        self.kernel, self.flag, self.flags = kernel, flag, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.flags.append(kwargs[self.flag])
            return self.kernel[grid](*args, **kwargs)

        return launch


def _nan_empty(empty, *args, **kwargs):
    """`torch.empty` filled with NaN (floating dtypes): rows a kernel leaves unwritten stay NaN."""
    out = empty(*args, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out


def _routing(H, dtype, E, R, l2p, g, T=3, K=3):
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g)
    ids[1, 2] = -1  # a pair not routed
    codes = l2p[ids.clamp(min=0)]
    assert bool(((codes >= R) & (ids >= 0)).any()) and bool(((codes >= 0) & (codes < R)).any()), (ids, l2p)
    return x, ids, w, codes


@pytest.mark.parametrize(("name", "H", "I", "dtype", "cfg"), CASES, ids=[c[0] + str(c[1]) for c in CASES])
def test_host_wide_against_references_and_pool_rows_unchanged(name, H, I, dtype, cfg, monkeypatch):
    """Host pairs in wide tiles equal the references (gate_up's act, down's combined output, the layer) within
    rounding; pool pairs are bitwise what the plain tiles give (they take the same tiles); rows of unrouted pairs
    stay as the allocator left them in both (NaN-filled here); the combine counters end at zero."""
    E, R = 7, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E, R)
    x, ids, w, codes = _routing(H, dtype, E, R, l2p, g)
    wide = dataclasses.replace(cfg, host_wide=True)
    gate_up_spy = _LaunchSpy(gemv._gate_up_kernel)
    down_spy = _LaunchSpy(gemv._down_kernel)
    monkeypatch.setattr(gemv, "_gate_up_kernel", gate_up_spy)
    monkeypatch.setattr(gemv, "_down_kernel", down_spy)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", functools.partial(_nan_empty, torch.empty))
        act_plain = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)
        act_wide = gemv_gate_up(x, ids, l2p, E, w13, fmt, wide)
    assert gate_up_spy.flags == [False, True], gate_up_spy.flags
    routed = (ids.flatten() >= 0) & (codes.flatten() >= 0)
    pool = routed & (codes.flatten() < R)
    host = routed & (codes.flatten() >= R)
    assert torch.equal(act_wide[pool], act_plain[pool]), "pool pairs' act changed"
    unrouted = ~routed
    assert bool(act_wide[unrouted].isnan().all()) and bool(act_plain[unrouted].isnan().all()), "unrouted rows"
    ref = gemv_gate_up_ref(x, ids, l2p, E, w13, fmt, wide)
    assert_close(act_wide[host], ref[host], f"{name} host gate_up")
    assert_close(act_plain[host], ref[host], f"{name} host gate_up, plain tiles")
    out = gemv_down_combine(act_wide, ids, w, l2p, E, w2, fmt, wide)
    assert down_spy.flags == [I % (2 * cfg.block_k2) == 0], (down_spy.flags, I, cfg.block_k2)
    assert_close(out, gemv_down_combine_ref(act_wide, ids, w, l2p, E, w2, fmt, wide), f"{name} host down")
    layer = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, wide)
    assert_close(layer, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} layer")
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("after_plan", [False, True])
def test_host_wide_falls_back_where_k_is_not_whole_wide_tiles(after_plan):
    """K = 96 over tiles of 32 (wide: 64, not whole) in gate_up, and a split down: both keep the plain tiles, so
    the output is bitwise host_wide=False's; beside the plan too."""
    name, H, I, dtype = "nvfp4", 96, 64, torch.bfloat16
    cfg = GemvConfig(16, 32, 16, 32, prefetch=False, split_k2=2)
    assert not gemv_args._host_wide(True, H, 32, 16, 1) and not gemv_args._host_wide(True, I, 32, 16, 2)
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype)
    x, ids, w, _ = _routing(H, dtype, 7, 3, l2p, g)
    want = gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfg, after_plan=after_plan)
    got = gemv_moe(
        x, ids, w, l2p, 7, w13, w2, fmt, dataclasses.replace(cfg, host_wide=True), after_plan=after_plan
    )
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_host_wide_with_packed_x_and_one_launch():
    """Packed x (`half_x_pack`) under host_wide: bitwise host_wide's unpacked output (the same x' values, the same
    sums); one launch ignores host_wide (it has the plain tiles only): bitwise one launch without it."""
    name, H, I, dtype = "nvfp4", 64, 64, torch.bfloat16
    cfg = GemvConfig(16, 32, 16, 32, prefetch=False, half_dot=True, host_wide=True)
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype)
    x, ids, w, _ = _routing(H, dtype, 7, 3, l2p, g)
    want = gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, cfg)
    got = gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, dataclasses.replace(cfg, half_x_pack=True))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    one = dataclasses.replace(cfg, one_launch=True)
    got = gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, one)
    want = gemv_moe(x, ids, w, l2p, 7, w13, w2, fmt, dataclasses.replace(one, host_wide=False))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert not gemv_args._host_wide(True, 64, 32, 1, 1)  # one row a block: no halves
    assert not gemv_args._host_wide(False, 64, 32, 16, 1)


# (format, H, I, dtype, config): down blocks of 16 rows (tall: 32) over H = 80 (five blocks: the last even block
# has no next one), H = 72 (the same, that block partly past H) and H = 88 (six blocks: the last tall tile's second
# block partly past H, stored and arrived for by the even program); int4 with zero points (K a multiple of its
# group), bf16 with the
# register prefetch, fp8 with I past a K tile, NVFP4 in the half dot with down's first tile ahead of its wait
TALL_CASES = [
    ("nvfp4", 80, 64, torch.bfloat16, _HALF),
    ("int4-g32-zp", 96, 64, torch.float16, GemvConfig(16, 32, 32, 32, prefetch=False)),  # three blocks of 32
    ("bf16", 80, 48, torch.bfloat16, GemvConfig(16, 16, 16, 16)),
    ("bf16", 88, 48, torch.bfloat16, GemvConfig(16, 16, 16, 16)),
    ("fp8", 72, 40, torch.bfloat16, GemvConfig(16, 16, 16, 16, prefetch=False, down_peel=True)),
]


@pytest.mark.parametrize(
    ("name", "H", "I", "dtype", "cfg"), TALL_CASES, ids=[c[0] + str(c[1]) for c in TALL_CASES]
)
@pytest.mark.parametrize("after_plan", [False, True])
def test_host_tall_against_references_and_pool_rows_unchanged(
    name, H, I, dtype, cfg, after_plan, monkeypatch
):
    """down with host rows in tiles of twice the rows (`GemvConfig.host_tall`): the combined output equals the
    reference within rounding and the layer equals `pooled_fused_moe_ref`; pool pairs' y and every unrouted row
    are what the plain tiles leave (bitwise, the combine unfused); the arrival counters end at zero."""
    E, R = 7, 3
    g, fmt, w13, w2, l2p = _layer(name, H, I, dtype, E, R, seed=1)
    x, ids, w, codes = _routing(H, dtype, E, R, l2p, g)
    tall = dataclasses.replace(cfg, host_tall=True)
    act = gemv_gate_up(x, ids, l2p, E, w13, fmt, cfg)
    down_spy = _LaunchSpy(gemv._down_kernel, "HOST_TALL")
    monkeypatch.setattr(gemv, "_down_kernel", down_spy)
    out = gemv_down_combine(act, ids, w, l2p, E, w2, fmt, tall, after_plan)
    assert down_spy.flags == [True], down_spy.flags
    assert_close(out, gemv_down_combine_ref(act, ids, w, l2p, E, w2, fmt, tall), f"{name} host-tall down")
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
    # y itself, the combine left to `combine`: pool pairs bitwise the plain tiles', host pairs the reference's
    unfused = dataclasses.replace(tall, fuse_combine=False)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", functools.partial(_nan_empty, torch.empty))
        patch.setattr(gemv, "combine", lambda y, *args: y)
        y_tall = gemv_down_combine(act, ids, w, l2p, E, w2, fmt, unfused)
        y_plain = gemv_down_combine(
            act, ids, w, l2p, E, w2, fmt, dataclasses.replace(unfused, host_tall=False)
        )
    routed = (ids.flatten() >= 0) & (codes.flatten() >= 0)
    pool, host = routed & (codes.flatten() < R), routed & (codes.flatten() >= R)
    assert torch.equal(y_tall[pool], y_plain[pool]), "pool pairs' y changed"
    assert bool(y_tall[~routed].isnan().all()) and bool(y_plain[~routed].isnan().all()), "unrouted rows"
    assert not bool(y_tall[host].isnan().any()), "a host row of y left unwritten"
    assert_close(y_tall[host], y_plain[host], f"{name} host y against the plain tiles")
    layer = gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, tall)
    assert_close(layer, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} host-tall layer")
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0
