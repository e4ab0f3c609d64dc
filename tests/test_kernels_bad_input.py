"""Kernel launchers refuse bad input before launch (shapes, dtypes, operands of the wrong format or K, mixed
block sizes), and edge cases that must give zeros (top-k 0, groups of zeros): on the CPU, under Triton's
interpreter. Split from test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels.fused_moe import (
        make_projections,
        pooled_fused_moe,
        pooled_fused_moe_ref,
    )
    from pooled_runner.kernels.moe_gemm import GemmConfig, gemm1, gemm2
    from pooled_runner.kernels.operands import kernel_format


from tests.kernel_helpers import build_layer, random_routing

pytestmark = pytest.mark.interpreter(gpu="tests/test_kernels_gpu.py")


def test_operand_bad_input():
    g = torch.Generator().manual_seed(2)
    fmt_obj, pool, bank, l2p = build_layer("bf16", 16, 16, 3, 2, g)
    fmt = kernel_format(fmt_obj)
    bad_bank = dict(bank, w2=bank["w2"].half())
    with pytest.raises(ValueError, match="bank w2"):
        make_projections(fmt, pool, bad_bank, 16, 16)
    strided = dict(pool, w13=torch.empty(2, 32, 32, dtype=torch.bfloat16)[:, :, ::2])
    with pytest.raises(ValueError, match="not contiguous"):
        make_projections(fmt, strided, bank, 16, 16)
    with pytest.raises(ValueError, match="shape"):
        make_projections(fmt, pool, bank, 16, 8)
    w13, w2 = make_projections(fmt, pool, bank, 16, 16)
    x16 = torch.randn(2, 16).half()  # fp16 activations, bf16 weights
    with pytest.raises(ValueError, match="dtype"):
        pooled_fused_moe(x16, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), l2p, 3, w13, w2, fmt)


@pytest.mark.parametrize("name", ["int4-g32", "nvfp4"])
@pytest.mark.parametrize("one_launch", [False, True])
def test_top_k_zero_gives_zeros_on_the_gemv_path(name, one_launch):
    """No pair routed (top-k 0): the default variant is the GEMV, which launches nothing; every output is 0, as
    the reference's empty sum (it returned unset memory)."""
    from pooled_runner.kernels.fused_moe import default_variant
    from pooled_runner.kernels.gemv import gemv_moe
    from pooled_runner.kernels.gemv_config import GemvConfig

    g = torch.Generator().manual_seed(11)
    H, I = (64, 32) if name != "nvfp4" else (48, 32)
    fmt_obj, pool, bank, l2p = build_layer(name, H, I, 5, 3, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(3, H, generator=g).bfloat16()
    ids, w = torch.empty(3, 0, dtype=torch.int64), torch.empty(3, 0)
    assert default_variant(fmt.fmt, 0, I, num_tokens=3, num_experts=5, hidden_size=H) == "gemv"
    ref = pooled_fused_moe_ref(x, ids, w, l2p, 5, w13, w2, fmt)
    assert torch.equal(ref, torch.zeros_like(ref))
    for _ in range(2):  # fresh (possibly recycled) memory each time
        assert torch.equal(pooled_fused_moe(x, ids, w, l2p, 5, w13, w2, fmt), ref)
        cfg = GemvConfig(one_launch=one_launch)
        assert torch.equal(gemv_moe(x, ids, w, l2p, 5, w13, w2, fmt, cfg), ref)


def test_launchers_refuse_weights_of_another_k_and_mixed_block_m():
    """The kernels take K from the activations: weights of another K (read past a row, or part of it) and a
    gemm2 block layout other than gemm1's are refused before any launch."""
    from pooled_runner.kernels.decode import decode_moe
    from pooled_runner.kernels.gemv import gemv_down_combine, gemv_gate_up
    from pooled_runner.kernels.gemv_config import GemvConfig
    from pooled_runner.kernels.moe_gemm import DecodeRouting
    from pooled_runner.kernels.splitk import splitk_moe

    g = torch.Generator().manual_seed(12)
    fmt_obj, pool, bank, l2p = build_layer("int4-g32", 64, 32, 5, 3, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, 64, 32)
    ids, w = random_routing(2, 2, 5, g, pad_prob=0.0)
    wide = torch.randn(2, 96, generator=g).bfloat16()  # H = 96 against rows of 64
    with pytest.raises(
        ValueError, match=r"gemm1 w13: weight rows \(64, 8\) .* expected the \[64, 96\] projection"
    ):
        gemm1(wide, None, w13, fmt, 2, GemmConfig(16, 16, 32), DecodeRouting(ids, l2p, 5, w))
    with pytest.raises(ValueError, match=r"GEMV w13: weight rows \(64, 8\)"):
        gemv_gate_up(wide, ids, l2p, 5, w13, fmt, GemvConfig())
    narrow_act = torch.randn(4, 16, generator=g).bfloat16()  # I = 16 against rows of 32
    with pytest.raises(ValueError, match=r"gemm2 w2: weight rows \(64, 4\)"):
        gemm2(
            narrow_act,
            None,
            w2,
            fmt,
            4,
            GemmConfig(16, 16, 32),
            DecodeRouting(ids, l2p, 5, w),
            fuse_combine=True,
        )
    with pytest.raises(ValueError, match=r"GEMV w2: weight rows \(64, 4\)"):
        gemv_down_combine(narrow_act, ids, w, l2p, 5, w2, fmt, GemvConfig())
    with pytest.raises(ValueError, match=r"decode path w13: weight rows \(64, 8\)"):
        decode_moe(wide, ids, w, l2p, 5, w13, w2, fmt)
    dense_obj, dpool, dbank, dl2p = build_layer("bf16", 40, 24, 5, 3, g)
    dfmt = kernel_format(dense_obj)
    d13, d2 = make_projections(dfmt, dpool, dbank, 40, 24)
    with pytest.raises(ValueError, match=r"split path w13: weight rows \(48, 40\)"):
        splitk_moe(torch.randn(2, 32, generator=g).bfloat16(), ids, w, dl2p, 5, d13, d2, dfmt)
    x = torch.randn(2, 64, generator=g).bfloat16()
    with pytest.raises(ValueError, match="gemm1 block_m=16 != gemm2 block_m=32"):
        pooled_fused_moe(
            x,
            ids,
            w,
            l2p,
            5,
            w13,
            w2,
            fmt,
            configs=(GemmConfig(16, 16, 32), GemmConfig(32, 16, 32)),
            variant="inline",
        )


@pytest.mark.parametrize(
    ("name", "operand", "bad_row", "dtype"),
    [
        ("int4-g32", "w13_s", (64, 1), None),  # group-64 scales for a group-32 format
        ("int4-g64-zp", "w2_z", (64, 1), torch.int32),  # the right row shape, the wrong dtype
        ("fp8", "w13_s", (64, 1), None),
        ("fp8-b16", "w2_s", (3, 3), None),
        ("nvfp4", "w13_s", (64, 3), torch.uint8),
        ("nvfp4", "w2_g", (2,), None),
    ],
)
def test_scale_zero_and_global_operands_must_match_the_format(name, operand, bad_row, dtype):
    g = torch.Generator().manual_seed(13)
    H, I = {"int4-g32": (64, 32), "int4-g64-zp": (64, 64)}.get(name, (48, 32))
    fmt_obj, pool, bank, _ = build_layer(name, H, I, 3, 2, g)
    fmt = kernel_format(fmt_obj)
    make_projections(fmt, pool, bank, H, I)  # as laid out by the format: accepted
    good = pool[operand]
    bad = torch.zeros((good.shape[0], *bad_row), dtype=dtype or good.dtype)
    if bad.shape[1:] == good.shape[1:] and bad.dtype == good.dtype:
        pytest.fail(f"case {operand} {bad_row} {bad.dtype} is what the format lays out")
    with pytest.raises(ValueError, match=rf"pool {operand}: rows"):
        make_projections(fmt, dict(pool, **{operand: bad}), None, H, I)


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int4_groups_of_zeros_or_too_small_for_the_scale_dtype_dequantize_to_zero(zero_point, scale_dtype):
    """A zero scale divided 0 by 0 (NaN codes); such groups now quantize to the zero code."""
    from pooled_runner.formats.quant import dequantize_int4, quantize_int4

    g = torch.Generator().manual_seed(14)
    w = torch.randn(3, 96, generator=g)
    w[0, :32] = 0.0  # an all-zero group
    w[1, 32:64] = torch.randn(32, generator=g) * 1e-9  # below fp16's smallest subnormal scale
    q, s, z = quantize_int4(w, 32, zero_point, scale_dtype)
    assert torch.isfinite(s.float()).all() and (s.float() > 0).all()
    back = dequantize_int4(q, s, z, torch.float32)
    assert torch.equal(back[0, :32], torch.zeros(32))
    assert back[1, 32:64].abs().max() <= 1e-8
    err = (back - w).abs()
    assert err.max() <= w.abs().max() / 7 + 1e-6, (
        f"max error {err.max():.3g} at {divmod(int(err.argmax()), 96)}"
    )


def test_native_fp8_by_compute_capability(monkeypatch):
    """e4m3 converts in hardware from sm_89 on; sm_80 / sm_86 (where Triton refuses fp8e4nv at compile) and the
    CPU decode the bits instead: the launchers' flag and the operand views follow the card."""
    from pooled_runner.kernels import gemm_args

    monkeypatch.setattr(gemm_args, "_INTERPRETING", False)
    for capability, want in [
        ((8, 0), False),
        ((8, 6), False),
        ((8, 9), True),
        ((9, 0), True),
        ((12, 0), True),
    ]:
        monkeypatch.setattr(gemm_args, "_capability", lambda index, c=capability: c)
        assert gemm_args.native_fp8(torch.device("cuda", 0)) is want, capability
        w = torch.zeros(4, dtype=torch.float8_e4m3fn)
        assert gemm_args._as_kernel_tensor(w, want).dtype == (torch.float8_e4m3fn if want else torch.uint8)
    assert gemm_args.native_fp8(torch.device("cpu")) is False


def test_launch_fitting_steps_stages_down(monkeypatch):
    """A tile whose stages need more shared memory than the card gives runs with the most that fit, found once
    and then launched directly; other resource errors and a refusal at 1 stage still raise."""
    from pooled_runner.kernels import gemm_args
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(gemm_args, "_FITTED_STAGES", {})
    calls = []

    class Kernel:  # a JIT function's launch protocol: kernel[grid](*args, **options)
        def __init__(self, fits: int, resource: str = "shared memory"):
            self.fits, self.resource = fits, resource

        def __getitem__(self, grid):
            def launch(*args, num_stages, **options):
                calls.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(40_000 * num_stages, 101_376, self.resource)
                return (grid, args, num_stages, options)

            return launch

    small = Kernel(fits=2)
    assert gemm_args.launch_fitting(small, (3,), "a", num_stages=4, BLOCK=16) == (
        (3,),
        ("a",),
        2,
        {"BLOCK": 16},
    )
    assert calls == [4, 3, 2]
    calls.clear()
    assert gemm_args.launch_fitting(small, (5,), "b", num_stages=4, BLOCK=16)[2] == 2
    assert calls == [2]  # remembered: straight to the stages that fit
    calls.clear()
    assert gemm_args.launch_fitting(small, (5,), "b", num_stages=2, BLOCK=32)[2] == 2 and calls == [2]
    roomy = Kernel(fits=5)
    calls.clear()
    assert gemm_args.launch_fitting(roomy, (1,), num_stages=4, BLOCK=16)[2] == 4 and calls == [4]
    with pytest.raises(OutOfResources, match="threads"):
        gemm_args.launch_fitting(Kernel(fits=1, resource="threads"), (1,), num_stages=3)
    with pytest.raises(OutOfResources, match="shared memory"):
        gemm_args.launch_fitting(Kernel(fits=0), (1,), num_stages=3)


def test_launchers_take_the_native_fp8_flag(monkeypatch):
    """The MoE GEMMs' and the GEMV's launch arguments follow `native_fp8` for fp8 weights: fp8 pointers and the
    flag set where the card converts e4m3, bytes and the flag clear where it does not."""
    from pooled_runner.kernels import gemm_args, gemv_args

    from tests.kernel_helpers import build_layer

    fmt_obj, pool, bank, _ = build_layer("fp8-b16", 32, 16, 3, 2, torch.Generator().manual_seed(1))
    fmt = kernel_format(fmt_obj)
    w13, _ = make_projections(fmt, pool, bank, 32, 16)
    for native in (True, False):
        monkeypatch.setattr(gemm_args, "native_fp8", lambda device, n=native: n)
        monkeypatch.setattr(gemv_args, "native_fp8", lambda device, n=native: n)
        ptrs, _, flag = gemm_args._launch_args(w13, fmt)
        assert flag is native and ptrs[0].dtype == (torch.float8_e4m3fn if native else torch.uint8)
        assert gemv_args._word_args(w13, fmt)[2] is native
