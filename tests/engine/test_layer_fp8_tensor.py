"""fp8 checkpoints with one scale per tensor (quant_method fp8 without weight_block_size, e.g. static-activation
FP8 Mixtral/Qwen checkpoints; NVIDIA ModelOpt FP8, whose tensors are the same) at layer level, against the real SGLang classes on CPU: the e4m3 weights go into the
"fp8" format's rows as they are and each shard's one scale onto every row of its per-channel scales; the
activation input scales are checked and not used (W8A16). Shared pieces in `layer_setup.py`, fixtures in
conftest.py."""

from __future__ import annotations

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
    tp_rank_loaded,
)

E4M3_MAX = 448.0


def fp8_tensor_checkpoint(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The experts of `sd` as a per-tensor fp8 checkpoint, quantized here in plain torch (not the pool's
    quantizer): each projection e4m3 with one fp32 `weight_scale` (w = q * scale, amax / 448) and a random
    positive `input_scale`, as static-activation checkpoints carry; everything else as it was."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sd.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            scale = w.float().abs().amax() / E4M3_MAX
            out[name] = (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale"] = scale.reshape(())
            out[name.removesuffix("weight") + "input_scale"] = torch.rand((), generator=g) + 0.01
        else:
            out[name] = w
    return out


def dequantized(fp8: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The reference's weights: q * scale in fp32, rounded once to the model's dtype."""
    out = {}
    for name, w in fp8.items():
        if name.endswith(("weight_scale", "input_scale")):
            continue
        scale = fp8.get(name.removesuffix("weight") + "weight_scale")
        out[name] = (w.float() * scale).to(dtype) if scale is not None else w.to(dtype)
    return out


def quant_config(activation_scheme: str = "static", exclude: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """SGLang's `Fp8Config` of a per-tensor checkpoint with static or dynamic activations, or "modelopt": the
    `ModelOptFp8Config` of a ModelOpt FP8 checkpoint (static activations; `exclude` its exclude patterns)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config

    if activation_scheme == "modelopt":
        config = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", *exclude]}
        return ModelOptFp8Config.from_config(config)
    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme=activation_scheme)


def fp8_runtime():  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format="fp8"), cpu=True)
    )
    set_runtime(rt)
    return rt


def expected_rows(fp8: dict[str, torch.Tensor], layer: int, e: int, rows: slice) -> dict[str, torch.Tensor]:
    """One expert's bank row of the "fp8" format, built from the checkpoint: gate and up rows `rows` (this rank's),
    the same columns of down, each shard's scale repeated over its rows."""
    prefix = f"model.layers.{layer}.mlp.experts.{e}."
    gate, up, down = (fp8[prefix + p + "_proj.weight"] for p in ("gate", "up", "down"))
    gate_s, up_s, down_s = (fp8[prefix + p + "_proj.weight_scale"] for p in ("gate", "up", "down"))
    n = len(range(*rows.indices(gate.shape[0])))
    return {
        "w13": torch.cat([gate[rows], up[rows]]),
        "w13_s": torch.cat([gate_s.expand(n), up_s.expand(n)]),
        "w2": down[:, rows],
        "w2_s": down_s.expand(down.shape[0]),
    }


@pytest.mark.parametrize("activation_scheme", ["static", "dynamic", "modelopt"])
def test_fp8_tensor_checkpoint_is_pooled_as_it_is(sglang_context, checkpoint, activation_scheme: str) -> None:  # type: ignore[no-untyped-def]
    """Served with --moe-expert-pool-weight-format fp8: SGLang's fp8 method lays out the placeholders, the e4m3
    weights land in the bank rows byte for byte and each shard's scale on each of its rows; the pooled layer
    equals SGLang's unquantized `FusedMoE` on the dequantized weights."""

    from pooled_runner.sglang.runtime import set_runtime

    dtype = torch.bfloat16
    fp8 = fp8_tensor_checkpoint(checkpoint, seed=3)
    if activation_scheme == "dynamic":
        fp8 = {name: w for name, w in fp8.items() if not name.endswith("input_scale")}
    reference = dequantized(fp8, dtype)
    rt = fp8_runtime()
    try:
        pooled, ref = pooled_and_reference(quant_config(activation_scheme), fp8, reference, dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == "fp8" and rt.loader is None
        for i in range(NUM_LAYERS):
            for e in range(E):
                assert_bank_row(
                    moe.bank.row(i, e), expected_rows(fp8, i, e, slice(None)), f"layer {i} expert {e}"
                )
        assert_layers_agree(pooled, ref, checkpoint, dtype, seed=17, what="fp8 per-tensor checkpoint")
        assert moe.stats().misses > 0
    finally:
        set_runtime(None)


@pytest.mark.parametrize("kind", ["static", "modelopt"])
@pytest.mark.parametrize("rank", [0, 1])
def test_fp8_tensor_checkpoint_under_tensor_parallelism(
    sglang_context, checkpoint, rank: int, kind: str
) -> None:  # type: ignore[no-untyped-def]
    """Rank r of TP=2: its bank rows are the checkpoint's gate/up rows [r*I/2, (r+1)*I/2) and the same columns of
    down, byte for byte, and every per-channel scale of a shard is that shard's one scale."""
    from pooled_runner.sglang.runtime import set_runtime

    half = I // 2
    fp8 = fp8_tensor_checkpoint(checkpoint, seed=5)
    rt = fp8_runtime()
    try:
        tp_rank_loaded(quant_config(kind), fp8, rank)
        bank = rt.require_moe().bank
        assert bank is not None
        for e in range(E):
            rows = slice(rank * half, (rank + 1) * half)
            assert_bank_row(bank.row(0, e), expected_rows(fp8, 0, e, rows), f"rank {rank} expert {e}")
    finally:
        set_runtime(None)


def test_fp8_tensor_checkpoint_refuses_other_scales(sglang_context, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A weight scale that is not one positive finite value (per-channel scales under a per-tensor config, a
    zero) and an input scale of more than one value are refused while they load, naming the tensor and the
    expert. An input scale of 0 (left so for experts calibration never routed) loads: it is not used."""
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import set_runtime

    fp8 = fp8_tensor_checkpoint(checkpoint, seed=7)
    name = "model.layers.0.mlp.experts.3.up_proj.weight_scale"
    cases = {
        "per channel": (
            fp8[name].expand(I, 1).clone(),
            "a per-tensor scale is one value, got shape (32, 1)",
        ),
        "zero": (torch.zeros(()), "scale 0.0 is not a positive finite number"),
        "two input scales": (torch.ones(2), "an input scale is one value, got shape (2,)"),
    }
    for what, (bad, message) in cases.items():
        key = name if "input" not in what else name.replace("weight_scale", "input_scale")
        fp8_runtime()
        try:
            layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config())
            with pytest.raises(
                ValueError, match=r"expert 3\): " + message.replace("(", r"\(").replace(")", r"\)")
            ):
                load(layer, 0, {**fp8, key: bad})
        finally:
            set_runtime(None)


@pytest.mark.parametrize("kind", ["static", "modelopt"])
def test_fp8_tensor_checkpoint_needs_the_fp8_pool_format(runtime, kind: str) -> None:  # type: ignore[no-untyped-def]
    """The default bf16 pool cannot take fp8 experts as they are: the layer stays on the device, saying the flag."""
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config(kind))
    assert not layer.is_pooled
    assert runtime.not_pooled == {
        "quantization fp8 (serve it with --moe-expert-pool-weight-format fp8)": ["model.layers.0.mlp.experts"]
    }


def test_fp8_tensor_checkpoint_takes_an_unused_zero_input_scale(sglang_context, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """SGLang serves a static checkpoint whose input scale is 0 for an expert (the largest is used), so the pool
    loads it too: the rows are the checkpoint's."""
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import set_runtime

    fp8 = fp8_tensor_checkpoint(checkpoint, seed=9)
    fp8["model.layers.0.mlp.experts.3.up_proj.input_scale"] = torch.zeros(())
    rt = fp8_runtime()
    try:
        layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config())
        load(layer, 0, fp8)
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
        bank = rt.require_moe().bank
        assert bank is not None
        assert_bank_row(bank.row(0, 3), expected_rows(fp8, 0, 3, slice(None)), "expert 3")
    finally:
        set_runtime(None)


def test_layers_the_checkpoint_leaves_unquantized_stay_on_the_device(runtime) -> None:  # type: ignore[no-untyped-def]
    """An fp8 checkpoint whose ignore list holds a MoE layer stores its experts in bf16, and SGLang serves them
    so: in an fp8 pool they would be quantized on load, so the layer keeps its experts on the device."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from pooled_runner.sglang.layer import not_pooled_reason

    config = Fp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme="dynamic",
        ignored_layers=["model.layers.1.mlp.experts"],
    )
    args = {"quant_config": config, "prefix": "model.layers.1.mlp.experts"}
    reason = "experts the checkpoint leaves unquantized (its ignore list): the fp8 pool would quantize them"
    assert not_pooled_reason(args, "fp8") == reason
    assert not_pooled_reason({**args, "prefix": "model.layers.0.mlp.experts"}, "fp8") is None
    assert not_pooled_reason(args, "bf16") is None  # a bf16 pool holds them as they are
    modelopt = {**args, "quant_config": quant_config("modelopt", exclude=("model.layers.1.*",))}
    assert not_pooled_reason(modelopt, "fp8") == reason  # ModelOpt's exclude_modules
    assert not_pooled_reason({**modelopt, "prefix": "model.layers.0.mlp.experts"}, "fp8") is None
