"""NVIDIA ModelOpt NVFP4 checkpoints (SGLang's `ModelOptFp4Config`, quant_algo NVFP4) at layer level, against the
real SGLang classes on CPU: the packed e2m1 weights, e4m3 `weight_scale` per 16 values and fp32 `weight_scale_2`
go into the "nvfp4" format's rows as they are; where gate and up carry different global scales, the larger one
is the row's and the other half's block scales are rescaled onto it. Checkpoints are quantized here in plain
torch (not the pool's converter); the pooled layer is compared with SGLang's unquantized `FusedMoE` on the
weights the checkpoint dequantizes to. Shared pieces in `layer_setup.py`, fixtures in conftest.py."""

from __future__ import annotations

import logging

import pytest
import torch

from pooled_runner import PoolConfig
from tests.engine.layer_setup import (
    NUM_LAYERS,
    E,
    I,
    assert_bank_row,
    assert_layers_agree,
    build,
    load,
    pooled_and_reference,
    reference_layers,
    tp_rank_loaded,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX, E2M1_MAX, GROUP = 448.0, 6.0, 16
# two bf16 steps at |out| in [2, 4): measured 0.031 here (layer_setup.assert_layers_agree)
TOLERANCE = 4e-2
PROJECTIONS = ("gate", "up", "down")


def quantize(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's NVFP4 of `w [N, K]` with global `g`: block scales amax / (6 g) in e4m3, each value the nearest
    e2m1 (by distance to the 8 magnitudes), packed two per byte with the even k in the low nibble."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // GROUP, GROUP)
    s = (blocks.abs().amax(-1) / (E2M1_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    x = blocks / (s.float()[..., None] * g)
    magnitude = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (magnitude | ((x < 0).long() << 3)).reshape(n, k).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), s


def dequantize(packed: torch.Tensor, s: torch.Tensor, g: float) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    values = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).float()
    return values * s.float().repeat_interleave(GROUP, 1) * g


def nvfp4_checkpoint(sd: dict[str, torch.Tensor], seed: int, globals_: str) -> dict[str, torch.Tensor]:
    """The experts of `sd` as a ModelOpt NVFP4 checkpoint: per projection `weight` [N, K/2] uint8,
    `weight_scale` [N, K/16] e4m3, `weight_scale_2` [] fp32, `input_scale` [] fp32 (random, not used).
    `globals_`: "shared" (gate and up quantized with one global, amax / (6 * 448) of both, as ModelOpt's export
    syncs them), "power-of-two" (up's is gate's times 2 or 1/2, by expert), "own" (each projection its own amax,
    as unsynced checkpoints carry)."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    experts = sorted({k.rsplit(".", 2)[0] for k in sd if ".mlp.experts." in k and k.endswith("_proj.weight")})
    for i, prefix in enumerate(experts):
        w = {p: sd[f"{prefix}.{p}_proj.weight"].float() for p in PROJECTIONS}
        amax = {p: w[p].abs().amax() for p in PROJECTIONS}
        g = {p: amax[p] / (E2M1_MAX * E4M3_MAX) for p in PROJECTIONS}
        if globals_ != "own":
            g["gate"] = g["up"] = max(amax["gate"], amax["up"]) / (E2M1_MAX * E4M3_MAX)
        if globals_ == "power-of-two":
            g["up"] = g["gate"] * (2.0 if i % 2 else 0.5)
        for p in PROJECTIONS:
            name = f"{prefix}.{p}_proj."
            out[name + "weight"], out[name + "weight_scale"] = quantize(w[p], g[p])
            out[name + "weight_scale_2"] = g[p].reshape(()).float()
            out[name + "input_scale"] = torch.rand((), generator=gen) + 0.01
    return out


def dequantized(ckpt: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The reference's weights: e2m1 * weight_scale * weight_scale_2 in fp32, rounded once to the model's dtype."""
    out = {}
    for name, w in ckpt.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        if w.dtype == torch.uint8:
            stem = name.removesuffix("weight")
            w = dequantize(w, ckpt[stem + "weight_scale"], float(ckpt[stem + "weight_scale_2"]))
        out[name] = w.to(dtype)
    return out


def quant_config(exclude: tuple[str, ...] = (), quant_algo: str = "NVFP4"):  # type: ignore[no-untyped-def]
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    return ModelOptFp4Config.from_config(
        {
            "quant_method": "modelopt",
            "quant_algo": quant_algo,
            "group_size": GROUP,
            "ignore": ["lm_head", *exclude],
        }
    )


def nvfp4_runtime(weight_format: str = "nvfp4", pool_rows: int = 6):  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    rt = PoolRuntime(
        ServeConfig(
            pool=PoolConfig.resolve(pool_rows=pool_rows, device="cpu", weight_format=weight_format), cpu=True
        )
    )
    set_runtime(rt)
    return rt


def expected_rows(
    ckpt: dict[str, torch.Tensor], layer: int, e: int, rank: int = 0, tp: int = 1, inter: int = I
) -> dict:
    """One expert's nvfp4 bank row from the checkpoint, as rank `rank` of `tp` holds it: its gate and up rows,
    its columns of down (packed bytes and scale groups); w13_g the larger of gate's and up's globals, and the
    smaller one's half of the block scales times (its global / that), rounded to e4m3."""
    prefix = f"model.layers.{layer}.mlp.experts.{e}."
    q, s, g = (
        {p: ckpt[f"{prefix}{p}_proj.{t}"] for p in PROJECTIONS}
        for t in ("weight", "weight_scale", "weight_scale_2")
    )
    n, k2 = inter // tp, inter // tp // 2
    rows, packed_cols, groups = (
        slice(rank * n, (rank + 1) * n),
        slice(rank * k2, (rank + 1) * k2),
        slice(rank * n // GROUP, (rank + 1) * n // GROUP),
    )
    g13 = max(float(g["gate"]), float(g["up"]))
    half_s = {p: (s[p][rows].float() * (float(g[p]) / g13)).to(torch.float8_e4m3fn) for p in ("gate", "up")}
    return {
        "w13": torch.cat([q["gate"][rows], q["up"][rows]]),
        "w13_s": torch.cat([half_s["gate"], half_s["up"]]),
        "w13_g": torch.tensor([g13]),
        "w2": q["down"][:, packed_cols],
        "w2_s": s["down"][:, groups],
        "w2_g": g["down"].reshape(1),
    }


@pytest.mark.parametrize("globals_", ["shared", "power-of-two"])
def test_nvfp4_checkpoint_is_pooled_as_it_is(sglang_context, checkpoint, globals_: str) -> None:  # type: ignore[no-untyped-def]
    """Served with --moe-expert-pool-weight-format nvfp4: the packed weights and block scales land in the bank
    rows byte for byte (a power-of-two gate/up ratio rescales exactly), the globals as expected_rows says; the
    pooled layer equals SGLang's unquantized `FusedMoE` on the checkpoint's dequantized weights."""
    from pooled_runner.sglang.runtime import set_runtime

    dtype = torch.bfloat16
    ckpt = nvfp4_checkpoint(checkpoint, seed=3, globals_=globals_)
    if globals_ == "power-of-two":  # the rescaled half stays exact: no block scale is near e4m3's subnormals
        assert min(float(v.float().min()) for k, v in ckpt.items() if k.endswith("weight_scale")) >= 2.0**-4
    rt = nvfp4_runtime()
    try:
        pooled, ref = pooled_and_reference(quant_config(), ckpt, dequantized(ckpt, dtype), dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == "nvfp4" and rt.loader is None
        for i in range(NUM_LAYERS):
            for e in range(E):
                assert_bank_row(moe.bank.row(i, e), expected_rows(ckpt, i, e), f"layer {i} expert {e}")
        assert_layers_agree(
            pooled,
            ref,
            checkpoint,
            dtype,
            seed=17,
            what=f"nvfp4 checkpoint ({globals_})",
            tolerance=TOLERANCE,
        )
        assert moe.stats().misses > 0
    finally:
        set_runtime(None)


def test_nvfp4_checkpoint_with_unsynced_gate_up_globals(sglang_context, checkpoint, caplog) -> None:  # type: ignore[no-untyped-def]
    """Gate and up quantized with their own globals: the smaller one's block scales are rescaled onto the larger
    and rounded to e4m3, which is logged. Each block's effective scale (block scale x global) stays within
    e4m3's half step, 1/16, of the checkpoint's (these scales stay in e4m3's normal range), and the pooled layer
    equals the unquantized layer on the weights those rows hold, dequantized here in plain torch."""
    from pooled_runner.sglang.runtime import set_runtime

    dtype = torch.bfloat16
    ckpt = nvfp4_checkpoint(checkpoint, seed=5, globals_="own")
    rt = nvfp4_runtime()
    try:
        with caplog.at_level(logging.INFO, logger="pooled_runner"):
            pooled, _ = pooled_and_reference(quant_config(), ckpt, dequantized(ckpt, dtype), dtype)
        assert f"{E} of {E} experts have different gate and up global scales" in caplog.text
        moe = rt.require_moe()
        assert moe.bank is not None
        served = {k: v for k, v in checkpoint.items() if ".mlp.experts." not in k}  # what the rows hold
        for i in range(NUM_LAYERS):
            for e in range(E):
                row = moe.bank.row(i, e)
                assert_bank_row(row, expected_rows(ckpt, i, e), f"layer {i} expert {e}")
                prefix = f"model.layers.{i}.mlp.experts.{e}."
                g13, s13 = float(row["w13_g"]), row["w13_s"].float()
                for p, half in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
                    want = (
                        ckpt[prefix + p + "_proj.weight_scale"].float()
                        * ckpt[prefix + p + "_proj.weight_scale_2"]
                    )
                    change = ((s13[half] * g13 - want).abs() / want).max()
                    assert change <= 1 / 16, (
                        f"layer {i} expert {e} {p}: a block's scale changed by {change:.3g}"
                    )
                w13 = dequantize(row["w13"], row["w13_s"], g13)
                w2 = dequantize(row["w2"], row["w2_s"], float(row["w2_g"]))
                for p, w in (("gate", w13[:I]), ("up", w13[I:]), ("down", w2)):
                    served[f"{prefix}{p}_proj.weight"] = w.to(dtype)
        ref = reference_layers(served, dtype)
        what = "nvfp4 checkpoint (own globals)"
        assert_layers_agree(pooled, ref, checkpoint, dtype, seed=19, what=what, tolerance=TOLERANCE)
    finally:
        set_runtime(None)


def test_nvfp4_layer_sizes_not_a_power_of_two_under_tensor_parallelism(sglang_context) -> None:  # type: ignore[no-untyped-def]
    """H = 48 (3 scale groups), I = 96 (rank r of TP=2 holds 48 rows, 3 groups of down), 5 experts, unsynced
    globals: each rank's rows are its slices of the checkpoint, byte for byte, with gate/up joined."""
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import set_runtime

    experts, hidden, inter = 5, 48, 96
    gen = torch.Generator().manual_seed(23)
    dense = {}
    for e in range(experts):
        prefix = f"model.layers.0.mlp.experts.{e}."
        for p, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            dense[prefix + p + "_proj.weight"] = torch.randn(*shape, generator=gen) * (1 + e)
    ckpt = nvfp4_checkpoint(dense, seed=29, globals_="own")
    for rank in (0, 1):
        rt = nvfp4_runtime(pool_rows=4)  # fewer rows than experts: the experts live in the host bank
        try:
            layer = build(
                PooledFusedMoE,
                0,
                torch.bfloat16,
                quant_config=quant_config(),
                num_experts=experts,
                hidden_size=hidden,
                intermediate_size=inter // 2,
            )
            layer.moe_tp_size, layer.moe_tp_rank = 2, rank
            load(layer, 0, ckpt, num_experts=experts)
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
            bank = rt.require_moe().bank
            assert bank is not None
            for e in range(experts):
                want = expected_rows(ckpt, 0, e, rank, tp=2, inter=inter)
                assert_bank_row(bank.row(0, e), want, f"rank {rank} expert {e}")
        finally:
            set_runtime(None)


def test_an_nvfp4_layer_the_pool_does_not_take_fails_naming_the_fix(sglang_context) -> None:  # type: ignore[no-untyped-def]
    """A bf16 pool leaves NVFP4 experts to SGLang's own NVFP4 method, which is refused without Blackwell or the
    marlin runner: the error says why the pool did not take the layer and how to serve it."""
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import set_runtime

    nvfp4_runtime("bf16")
    try:
        with pytest.raises(ValueError) as info:
            build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config())
        message = str(info.value)
        assert message.startswith(
            "model.layers.0.mlp.experts: not pooled (quantization nvfp4 (serve it with "
        )
        assert "SGLang's own NVFP4 experts refused it: Current platform does not support NVFP4" in message
        assert message.endswith("or pass --no-moe-expert-pool")
    finally:
        set_runtime(None)


@pytest.mark.parametrize("rank", [0, 1])
def test_nvfp4_checkpoint_under_tensor_parallelism(sglang_context, checkpoint, rank: int) -> None:  # type: ignore[no-untyped-def]
    """Rank r of TP=2: its gate/up rows [r*I/2, (r+1)*I/2) with their block scales, and the same columns of down
    (packed bytes [r*I/4, ...), scale groups [r*I/32, ...)), byte for byte; globals as the whole expert's."""
    from pooled_runner.sglang.runtime import set_runtime

    ckpt = nvfp4_checkpoint(checkpoint, seed=7, globals_="power-of-two")
    rt = nvfp4_runtime()
    try:
        tp_rank_loaded(quant_config(), ckpt, rank)
        bank = rt.require_moe().bank
        assert bank is not None
        for e in range(E):
            assert_bank_row(bank.row(0, e), expected_rows(ckpt, 0, e, rank, tp=2), f"rank {rank} expert {e}")
    finally:
        set_runtime(None)


def test_nvfp4_checkpoint_refuses_bad_globals(sglang_context, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A global scale that is not one positive finite value is refused while it loads, naming tensor and
    expert; a layer missing one is refused after loading, naming it."""
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import set_runtime

    ckpt = nvfp4_checkpoint(checkpoint, seed=9, globals_="shared")
    name = "model.layers.0.mlp.experts.3.up_proj.weight_scale_2"
    cases = {
        "two values": (torch.ones(2), r"expert 3\): a per-tensor scale is one value, got shape \(2,\)"),
        "zero": (torch.zeros(()), r"expert 3\): scale 0.0 is not a positive finite number"),
        "missing": (None, r"did not provide expert 3 w3 w13_weight_scale_2$"),
    }
    for bad, message in cases.values():
        nvfp4_runtime()
        try:
            layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config())
            with pytest.raises(ValueError, match=message):
                if bad is None:
                    load(layer, 0, ckpt, skip=name)
                    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
                else:
                    load(layer, 0, {**ckpt, name: bad})
        finally:
            set_runtime(None)


def test_which_nvfp4_layers_are_pooled(runtime) -> None:  # type: ignore[no-untyped-def]
    """A bf16 pool names the flag; a layer the checkpoint's exclude list names is bf16 in the checkpoint and
    stays on the device of an nvfp4 pool; NVFP4_AWQ (pre-quant scales) is not served."""
    from pooled_runner.sglang.layer import not_pooled_reason

    args = {"quant_config": quant_config(), "prefix": "model.layers.1.mlp.experts"}
    assert (
        not_pooled_reason(args, "bf16")
        == "quantization nvfp4 (serve it with --moe-expert-pool-weight-format nvfp4)"
    )
    assert not_pooled_reason(args, "nvfp4") is None
    excluded = {**args, "quant_config": quant_config(exclude=("model.layers.1.*",))}
    assert not_pooled_reason(excluded, "nvfp4") == (
        "experts the checkpoint leaves unquantized (its ignore list): the nvfp4 pool would quantize them"
    )
    assert not_pooled_reason({**excluded, "prefix": "model.layers.0.mlp.experts"}, "nvfp4") is None
    awq = {**args, "quant_config": quant_config(quant_algo="NVFP4_AWQ")}
    assert "quantization modelopt_fp4 (the pool takes" in str(not_pooled_reason(awq, "nvfp4"))
