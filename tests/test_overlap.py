"""The decode kernels' OVERLAP mode (`after_plan`: the plan + copy may still run beside the first GEMM) on the
CPU, under Triton's interpreter: the inline MMA path, the GEMV path and the align path on blocks aligned before
the plan schedule their blocks by expert id instead of host-first, read each code once and settle host codes
(`pdl.settle_code`). The interpreter runs one
program at a time, so this checks the schedule (every pair computed exactly once, at the slots the second
kernel reads) and the settle path; the race itself is the GPU tests' (`test_gpu_path.py`, `test_planner_gpu.py`).
Outputs must equal the host-first schedule's bit for bit (the same tiles and sums per pair) and the reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels import decode_align, gemv, moe_gemm
    from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe, pooled_fused_moe_ref
    from pooled_runner.kernels.gemv import GemvConfig
    from pooled_runner.kernels.moe_gemm import GemmConfig
    from pooled_runner.kernels.operands import kernel_format

from tests.kernel_helpers import assert_close, build_layer, random_routing


@pytest.fixture
def overlap_modes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The OVERLAP mode each decode GEMM launch chose, in launch order (the launchers' mode functions spied)."""
    modes: list[bool] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            modes.append(fn(*args, **kwargs))
            return modes[-1]

        return wrapped

    monkeypatch.setattr(moe_gemm, "overlap_mode", spy(decode_align.overlap_mode))
    monkeypatch.setattr(gemv, "_overlap", spy(gemv._overlap))
    return modes


# (format, H, I, variant): the inline MMA GEMMs (bf16 / fp16, int4 unswapped) and the GEMV (int4, NVFP4, bf16)
CASES = [
    ("bf16", 40, 24, torch.bfloat16, "inline"),
    ("int4-g32", 64, 32, torch.float16, "inline"),
    ("int4-g64-zp", 64, 64, torch.bfloat16, "gemv"),
    ("nvfp4", 48, 32, torch.bfloat16, "gemv"),
    ("bf16", 48, 32, torch.bfloat16, "gemv"),
]


@pytest.mark.parametrize(("name", "H", "I", "dtype", "variant"), CASES)
@pytest.mark.parametrize(("T", "K", "E", "R"), [(1, 1, 1, 1), (1, 3, 7, 3), (3, 3, 5, 2), (4, 7, 11, 4)])
def test_after_plan_equals_host_first_schedule(name, H, I, dtype, variant, T, K, E, R, overlap_modes):
    g = torch.Generator().manual_seed(T * 13 + K * 5 + E + H)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, dtype, num_not_here=int(E > 3))
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank if R < E else None, H, I)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = random_routing(T, K, E, g, pad_prob=0.2)
    if T > 2:
        ids[1] = -1  # a token with no pair routed here: its output row is still written (zeros)
    if T * K > 1:
        ids.view(-1)[-1] = ids.view(-1)[0]  # an expert shared by two pairs (one block or two GEMV pairs)
    cfgs = None
    if variant == "inline":
        cfgs = (GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1))
    before = l2p.clone()
    host_first = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs, variant=variant)
    assert overlap_modes == [False, False], overlap_modes
    by_id = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, cfgs, variant=variant, after_plan=True)
    assert overlap_modes[2:] == [True, True], f"both GEMMs must run in OVERLAP mode: {overlap_modes}"
    assert torch.equal(l2p, before), "the kernels wrote the location table"
    diff = (by_id.float() - host_first.float()).abs()
    assert torch.equal(by_id, host_first), f"{name} {variant}: max diff {diff.max()} at {diff.argmax()}"
    assert int(gemv._COUNTERS[x.device].abs().sum()) == 0, "arrival counters not back at zero"
    ref = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    assert_close(by_id, ref, f"{name} {variant} T={T} K={K} E={E} R={R} after_plan", rel=3e-2)


@pytest.mark.parametrize("name", ["int4-g128", "nvfp4"])
@pytest.mark.parametrize("split_k2", [1, 2])
def test_after_plan_split_k_gate_up(name, split_k2, overlap_modes) -> None:
    """The GEMV's split-K gate_up (and down, `split_k2`) in OVERLAP mode: each split program settles its pair's
    code on its own; the parts still sum in split order (bitwise the host-first schedule's output)."""
    g = torch.Generator().manual_seed(17)
    H, I, E, R, T, K = 256, 128, 7, 3, 2, 3
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, E, R, g, torch.bfloat16)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = random_routing(T, K, E, g)
    cfg = GemvConfig(16, 32, 16, 32, num_warps=4, split_k1=3, split_k2=split_k2)
    gemv.gemv_moe(
        x, ids, w, l2p, E, w13, w2, fmt, cfg
    )  # the workspace grows here, before the overlapped call
    a = gemv.gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg)
    b = gemv.gemv_moe(x, ids, w, l2p, E, w13, w2, fmt, cfg, after_plan=True)
    assert overlap_modes[-2:] == [True, True], overlap_modes
    assert torch.equal(a, b)
    assert_close(b, pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt), f"{name} split 3 after_plan", 3e-2)


def test_after_plan_is_ignored_where_the_blocks_are_aligned_first() -> None:
    """The align path (more pairs than the inline schedule takes) starts with a plain launch after the plan:
    `after_plan` changes nothing there."""
    g = torch.Generator().manual_seed(3)
    fmt_obj, pool, bank, l2p = build_layer("bf16", 40, 24, 9, 3, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, 40, 24)
    x = torch.randn(6, 40, generator=g).bfloat16()
    ids, w = random_routing(6, 6, 9, g)  # 36 pairs > INLINE_MAX_PAIRS
    cfgs = (GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1))
    a = pooled_fused_moe(x, ids, w, l2p, 9, w13, w2, fmt, cfgs, variant="inline")
    b = pooled_fused_moe(x, ids, w, l2p, 9, w13, w2, fmt, cfgs, variant="inline", after_plan=True)
    assert torch.equal(a, b)


def test_a_long_plan_beside_takes_the_inline_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`long_plan` (an adaptive policy's plan beside the step): 20 routed pairs, past the inline default of 8,
    run the inline schedule, which starts beside the plan, instead of the align path (no align launch); equal
    to the reference. Without `after_plan` nothing runs beside, and `long_plan` changes nothing."""
    from pooled_runner.kernels import fused_moe

    aligned_calls: list[int] = []
    real_align = fused_moe.align_blocks

    def spy(*args, **kwargs):
        aligned_calls.append(1)
        return real_align(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "align_blocks", spy)
    g = torch.Generator().manual_seed(5)
    fmt_obj, pool, bank, l2p = build_layer("bf16", 40, 24, 9, 3, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, 40, 24)
    x = torch.randn(4, 40, generator=g).bfloat16()
    ids, w = random_routing(
        4, 5, 9, g
    )  # 20 pairs: above INLINE_DEFAULT_MAX_PAIRS, not above INLINE_MAX_PAIRS
    long = pooled_fused_moe(x, ids, w, l2p, 9, w13, w2, fmt, after_plan=True, long_plan=True)
    assert not aligned_calls, "long_plan after a plan launched the align kernel"
    assert_close(long, pooled_fused_moe_ref(x, ids, w, l2p, 9, w13, w2, fmt), "long_plan inline", 3e-2)
    alone = pooled_fused_moe(x, ids, w, l2p, 9, w13, w2, fmt, long_plan=True)
    assert aligned_calls == [1], "without after_plan, long_plan changed the path"
    assert_close(alone, long, "long_plan without after_plan", 3e-2)


def test_blocks_aligned_before_the_plan_locate_the_new_table(overlap_modes: list[bool]) -> None:
    """`align_before_plan` (36 pairs: past the inline schedule, a plan beside): the blocks are aligned on
    the old table, then a "plan" evicts a routed expert from its row and admits another there. The OVERLAP
    GEMMs locate each block's expert in the new table: equal to the reference on it (a stale code would read
    the admitted expert's weights for the evicted one). Not after a plan, the old blocks are not taken (aligned
    again), and a GEMM handed them outside OVERLAP refuses."""
    from pooled_runner.kernels import fused_moe
    from pooled_runner.kernels.fused_moe import align_before_plan

    H, I, E, R = 40, 24, 9, 4
    g = torch.Generator().manual_seed(11)
    fmt_obj, pool, bank, l2p = build_layer("bf16", H, I, E, R, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(6, H, generator=g).bfloat16()
    ids, w = random_routing(6, 6, E, g)  # 36 pairs > INLINE_MAX_PAIRS
    routed = set(ids.flatten().tolist())
    evicted = next(e for e in range(E) if 0 <= int(l2p[e]) < R and e in routed)
    admitted = next(e for e in range(E) if int(l2p[e]) >= R and e in routed)
    assert align_before_plan(x, ids, l2p, E, w13, w2, fmt, overlap=False) is None  # nothing beside
    assert align_before_plan(x[:4], ids[:4], l2p, E, w13, w2, fmt, overlap=True) is None  # 24: inline range
    shipped = fused_moe.DECODE_VARIANT
    try:  # 36 pairs on another variant (POOLED_RUNNER_MOE_DECODE): no align before the plan
        fused_moe.DECODE_VARIANT = "inline"
        assert align_before_plan(x, ids, l2p, E, w13, w2, fmt, overlap=True) is None
    finally:
        fused_moe.DECODE_VARIANT = shipped
    aligned = align_before_plan(x, ids, l2p, E, w13, w2, fmt, overlap=True)
    assert aligned is not None and aligned.before_plan
    row = int(l2p[evicted])  # the "plan": evict, copy the admitted expert in, publish
    for k in pool:
        pool[k][row] = bank[k][admitted]
    l2p[evicted], l2p[admitted] = R + evicted, row
    want = pooled_fused_moe_ref(x, ids, w, l2p, E, w13, w2, fmt)
    got = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, after_plan=True, long_plan=True, aligned=aligned)
    assert overlap_modes == [True, True], overlap_modes
    assert_close(got, want, "aligned before the plan", 3e-2)
    again = pooled_fused_moe(x, ids, w, l2p, E, w13, w2, fmt, long_plan=True, aligned=aligned)
    assert overlap_modes[2:] == [False, False], overlap_modes
    assert_close(again, want, "aligned before the plan, no plan beside", 3e-2)
    with pytest.raises(ValueError, match="give align_before_plan this step's arguments"):  # another step's
        pooled_fused_moe(x[:5], ids[:5], w[:5], l2p, E, w13, w2, fmt, after_plan=True, aligned=aligned)
    with pytest.raises(ValueError, match="aligned before the plan"):
        moe_gemm.gemm1(x, aligned, w13, fmt, 6, GemmConfig(aligned.block_m, 16, 32, num_stages=1))
