"""The GEMV path's configuration (CPU): the default tiles per shape and format off the interpreter, int4's K
tiles, and the register cap reaching every launch (the launches run under Triton's interpreter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.interpreter import interpreter_imports
from tests.test_kernels_gemv import CONFIGS, GemvConfig, _layer, gemv, pooled_fused_moe

with interpreter_imports():
    from pooled_runner.kernels import gemv_one

pytestmark = pytest.mark.interpreter(gpu="tests/test_decode_variants_gpu.py")


def test_int4_k_tiles_hold_whole_groups():
    """int4's K tile is 256 only where K is whole tiles of whole groups of 128 (or a multiple); else 128 (a tile
    straddling more than two groups, or masked past K, would load a scale per word)."""
    assert gemv._int4_block_k(7168, 128) == 256
    assert gemv._int4_block_k(768, 256) == 256
    assert gemv._int4_block_k(1408, 128) == 128  # I % 256 == 128: the last tile would be half past K
    assert gemv._int4_block_k(2048, 64) == 128
    assert gemv._int4_block_k(2048, 32) == 128


def test_default_tiles_on_a_132_sm_gpu(monkeypatch):
    """`gemv_configs` off the interpreter (a stand-in of 132 SMs): rows per tile halved until pairs x N blocks
    reach two programs per SM; int4 K tiles from `_int4_block_k`, NVFP4 256, dense 128 with the register
    prefetch; worked by hand for the DeepSeek-like (H 7168, I 2048) and Qwen3-like (H 2048, I 768) layers."""
    from pooled_runner.kernels import dequant, gemv_config

    monkeypatch.setattr(gemv_config, "interpreting", lambda: False)
    monkeypatch.setattr(gemv_config, "_num_sms", lambda: 132)
    cfg = gemv_config.gemv_configs

    def tiles(c: GemvConfig) -> tuple:
        return c.block_n1, c.block_k1, c.block_n2, c.block_k2, c.prefetch

    # int4 with 64 down rows at most 96 registers per thread (five programs per SM); smaller tiles and the other
    # formats the compiler's choice
    int4 = dequant.FMT_INT4
    # DeepSeek-like two tokens: 16 x 112 = 1792 down programs > 4 x 132, 64 rows
    assert cfg(7168, 2048, int4, 16, 128).max_registers == gemv_config.PACKED_MAX_REGISTERS == 96
    assert cfg(2048, 768, int4, 64, 128).max_registers == 96  # 64 pairs x 32 blocks = 2048 programs
    assert cfg(2048, 768, int4, 24, 128).max_registers == 96  # 24 x 32 = 768 > 528
    assert cfg(2048, 768, int4, 16, 128).max_registers == 0  # 16 x 32 = 512: one wave at 4 per SM
    assert cfg(2048, 768, int4, 8, 128).max_registers == 0  # 32 down rows (8 x 64 = 512)
    # int4 at one token on whole 512 tiles (896 down programs <= two waves of five per SM on 132 SMs): NVFP4's
    # wide tiles; not at two tokens, other groups, or I = 768
    wide = cfg(7168, 2048, int4, 8, 128)
    assert wide.half_dot and (wide.block_k1, wide.block_k2, wide.registers(), wide.registers(down=True)) == (
        512,
        512,
        gemv_config.WIDE_REGISTERS,
        128,
    ), wide
    # (a Qwen3-235B-like layer, H 4096, I 1536, at one token: 8 x 64 = 512 down programs, one wave: not measured)
    for narrow in (
        cfg(7168, 2048, int4, 16, 128),
        cfg(7168, 2048, int4, 8, 64),
        cfg(2048, 768, int4, 8, 128),
        cfg(4096, 1536, int4, 8, 128),
    ):
        assert not narrow.half_dot and narrow.block_k1 <= 256, narrow
        # the fp32 dot: no peel (1.3% slower at M=8), the schedule's usual width
        assert not narrow.down_peel and narrow.schedule_width == 64, narrow
    # the half dot's wide tiles peel down and sort 8 keys at least (the same order: `gemv_schedule._slot_pair`)
    assert wide.down_peel and wide.schedule_width == 8, wide
    for fmt_code in (dequant.FMT_DENSE, dequant.FMT_FP8_CHANNEL, dequant.FMT_FP8_BLOCK):
        assert cfg(7168, 2048, fmt_code, 8).max_registers == 0, fmt_code
    # NVFP4: the half dot, gate_up's K tiles of 512 at 128 registers (1024 at 16 rows where H is whole 1024
    # tiles); down's 512 too where I is whole 512 tiles, else 256 at 96 (one wave or not)
    nvfp4 = dequant.FMT_NVFP4
    for pairs in (8, 64):
        deepseek = cfg(7168, 2048, nvfp4, pairs)
        assert deepseek.half_dot and not deepseek.half_x_pack
        assert deepseek.down_peel and deepseek.schedule_width == 8, deepseek
        assert (
            deepseek.block_k1,
            deepseek.block_k2,
            deepseek.registers(),
            deepseek.registers(down=True),
        ) == (
            512,
            512,
            gemv_config.WIDE_REGISTERS,
            128,
        )
    for pairs, bn1, bk1, bn2 in ((8, 16, 1024, 32), (64, 32, 512, 64)):
        qwen3 = cfg(2048, 768, nvfp4, pairs)
        assert qwen3.half_dot
        assert (
            qwen3.block_n1,
            qwen3.block_k1,
            qwen3.block_n2,
            qwen3.block_k2,
            qwen3.registers(),
            qwen3.registers(down=True),
        ) == (
            bn1,
            bk1,
            bn2,
            256,
            128,
            96,
        )
    # 16 rows on an H that is not whole 1024 tiles (a masked last tile) and int4 on the wide tiles keep 512
    narrow = cfg(2560, 768, nvfp4, 8)
    assert (narrow.block_n1, narrow.block_k1) == (16, 512), narrow
    # host rows in their own tiles (`GemvConfig.host_wide`) are not a default: they cost resident steps 3-5%
    assert not cfg(7168, 2048, nvfp4, 8).host_wide and not cfg(2048, 768, nvfp4, 64).host_wide
    assert not cfg(7168, 2048, dequant.FMT_INT4, 8, 128).host_wide
    # nor down's taller host tiles (`host_tall`): under 1% on the layer with one host expert, resident cost untimed
    assert not any(cfg(2048, 768, f, 8).host_tall for f in (nvfp4, dequant.FMT_INT4, dequant.FMT_DENSE))
    assert gemv_config._half_gate_up_block_k(16, 2048, nvfp4=False) == 512

    assert tiles(cfg(7168, 2048, dequant.FMT_INT4, 16, 128)) == (
        32,
        256,
        64,
        256,
        False,
    )  # 1024 / 1792 programs
    assert tiles(cfg(2048, 768, dequant.FMT_INT4, 8, 128)) == (
        16,
        256,
        32,
        256,
        False,
    )  # 192 -> 384, 256 -> 512
    assert tiles(cfg(2048, 768, dequant.FMT_INT4, 8, 64)) == (16, 128, 32, 128, False)
    assert tiles(cfg(7168, 2048, dequant.FMT_NVFP4, 64)) == (32, 512, 64, 512, False)
    assert tiles(cfg(2048, 768, dequant.FMT_DENSE, 8)) == (16, 128, 32, 128, True)
    assert tiles(cfg(2048, 768, dequant.FMT_INT4, 1, 128)) == (
        8,
        256,
        8,
        256,
        False,
    )  # halving stops at 8 rows


@pytest.mark.parametrize("one_launch", [False, True])
def test_register_limit_reaches_the_launch(monkeypatch, one_launch):
    """`GemvConfig.max_registers` is handed to every GEMV launch as ptxas' `maxnreg` (and none is handed without
    one); a value ptxas cannot take is refused first. (That ptxas honours it: `test_sass_count.py`.)"""
    g, fmt, w13, w2, l2p = _layer("int4-g32", 64, 32, torch.bfloat16)
    x = torch.randn(3, 64, generator=g).bfloat16()
    ids = torch.randint(0, 7, (3, 2), generator=g)
    tw = torch.rand(3, 2, generator=g)
    seen: list = []

    def spy(module, name):
        kernel = getattr(module, name)

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    seen.append((name, kwargs.get("maxnreg")))
                    return kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(module, name, Spy())

    for module, name in ((gemv, "_gate_up_kernel"), (gemv, "_down_kernel"), (gemv_one, "_fused_kernel")):
        spy(module, name)
    base = dataclasses.replace(CONFIGS[0], one_launch=one_launch)
    out = {}
    for regs in (0, 96):
        seen.clear()
        cfg = dataclasses.replace(base, max_registers=regs)
        out[regs] = pooled_fused_moe(x, ids, tw, l2p, 7, w13, w2, fmt, variant="gemv", gemv_config=cfg)
        kernels = ["_fused_kernel"] if one_launch else ["_gate_up_kernel", "_down_kernel"]
        assert seen == [(k, regs or None) for k in kernels], (regs, seen)
    assert torch.equal(out[0], out[96])  # the interpreter drops `maxnreg`: the cap changes no result
    for bad in (-1, 256):
        with pytest.raises(ValueError, match=f"max_registers={bad} must be 0"):
            gemv.reg_limit(dataclasses.replace(base, max_registers=bad))
    with pytest.raises(ValueError, match="down_max_registers=-2 must be 0"):
        gemv.reg_limit(dataclasses.replace(base, down_max_registers=-2))
    with pytest.raises(ValueError, match="down_prefetch=-2 >= 0"):
        dataclasses.replace(base, down_prefetch=-2)


@pytest.mark.parametrize("one_launch", [False, True])
def test_down_prefetch_and_cap_reach_the_down_launch_only(monkeypatch, one_launch):
    """`down_prefetch` / `down_max_registers` set down's PREFETCH and `maxnreg` apart from gate_up's (which keeps
    the shared fields'); the one launch compiles both tiles alike and refuses them; results equal (the
    interpreter drops `maxnreg`; the prefetch changes only when loads are issued)."""
    g, fmt, w13, w2, l2p = _layer("nvfp4", 64, 64, torch.bfloat16)
    x = torch.randn(2, 64, generator=g).bfloat16()
    ids = torch.randint(0, 7, (2, 3), generator=g)
    tw = torch.rand(2, 3, generator=g)
    seen: dict = {}
    for name in ("_gate_up_kernel", "_down_kernel"):
        kernel = getattr(gemv, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    seen[name] = (kwargs["PREFETCH"], kwargs.get("maxnreg"))
                    return kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(gemv, name, Spy())
    base = dataclasses.replace(CONFIGS[0], prefetch=False)
    apart = dataclasses.replace(base, down_prefetch=1, down_max_registers=96)
    if one_launch:
        with pytest.raises(ValueError, match="down_prefetch=1, down_max_registers=96"):
            pooled_fused_moe(x, ids, tw, l2p, 7, w13, w2, fmt, variant="gemv",
                             gemv_config=dataclasses.replace(apart, one_launch=True))  # fmt: skip
        return
    out = pooled_fused_moe(x, ids, tw, l2p, 7, w13, w2, fmt, variant="gemv", gemv_config=apart)
    assert seen == {"_gate_up_kernel": (0, None), "_down_kernel": (1, 96)}, seen
    shared = dataclasses.replace(base, prefetch=True, max_registers=80)
    ref = pooled_fused_moe(x, ids, tw, l2p, 7, w13, w2, fmt, variant="gemv", gemv_config=shared)
    assert seen == {"_gate_up_kernel": (1, 80), "_down_kernel": (1, 80)}, seen
    assert torch.equal(out, ref)
