"""llm-compressor NVFP4 checkpoints (quant_method compressed-tensors, format nvfp4-pack-quantized: NVFP4A16, and
NVFP4 W4A4, which SGLang serves weight-only below Blackwell with `CompressedTensorsW4A16Nvfp4MoE`) at layer level,
against the real SGLang classes on CPU: `weight_packed` and `weight_scale` go into the "nvfp4" rows as they are,
and `weight_global_scale` (which divides: w = e2m1 * s / global_scale) as its reciprocal. The checkpoints are
the ModelOpt ones of test_layer_nvfp4_modelopt.py with compressed-tensors' names and globals. Shared pieces in
`layer_setup.py`, fixtures in conftest.py."""

from __future__ import annotations

import pytest
import torch

from tests.engine.layer_setup import NUM_LAYERS, E, assert_bank_row, assert_layers_agree, pooled_and_reference
from tests.engine.test_layer_nvfp4_modelopt import (
    TOLERANCE,
    dequantized,
    expected_rows,
    nvfp4_checkpoint,
    nvfp4_runtime,
)

NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor_group",
    "group_size": 16,
    "dynamic": False,
}


def compressed_checkpoint(
    modelopt: dict[str, torch.Tensor], activations: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the compressed-tensors checkpoint of a ModelOpt one: `weight_packed`, `weight_scale`, `weight_global_scale`
    = 1 / weight_scale_2 in fp32, `input_global_scale` for W4A4; the ModelOpt view of it, whose weight_scale_2 is
    1 / weight_global_scale in fp32, as the rows must hold)."""
    out, view = {}, {}
    for name, t in modelopt.items():
        if name.endswith("weight_scale_2"):
            global_scale = (torch.tensor(1.0) / t.float()).reshape(())
            out[name.removesuffix("weight_scale_2") + "weight_global_scale"] = global_scale
            view[name] = (torch.tensor(1.0) / global_scale).reshape(())
        elif name.endswith("input_scale"):
            if activations:
                out[name.removesuffix("input_scale") + "input_global_scale"] = 1.0 / t
        elif name.endswith("_proj.weight") and t.dtype == torch.uint8:
            out[name + "_packed"], view[name] = t, t
        else:
            out[name], view[name] = t, t
    return out, view


def quant_config(activations: bool, ignore: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    group = {
        "targets": ["Linear"],
        "weights": NVFP4_ARGS,
        **({"input_activations": {**NVFP4_ARGS, "dynamic": "local"}} if activations else {}),
    }
    return CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", *ignore],
        }
    )


@pytest.fixture
def below_blackwell(monkeypatch):  # type: ignore[no-untyped-def]
    """SGLang picks its W4A4 NVFP4 scheme only on Blackwell; its capability check queries CUDA, which this CPU
    lacks: answer it as a Hopper GPU does (not supported), so the W4A16 fallback is chosen."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    monkeypatch.setattr(CompressedTensorsConfig, "_check_scheme_supported", lambda *a, **k: False)


@pytest.mark.parametrize("activations", [False, True], ids=["nvfp4a16", "w4a4-as-w4a16"])
@pytest.mark.parametrize("globals_", ["shared", "power-of-two"])
def test_compressed_nvfp4_checkpoint_is_pooled_as_it_is(  # type: ignore[no-untyped-def]
    sglang_context, checkpoint, below_blackwell, activations: bool, globals_: str
) -> None:
    """Served with --moe-expert-pool-weight-format nvfp4: SGLang's NVFP4 W4A16 scheme lays out the placeholders;
    packed weights and block scales land byte for byte, each global as its reciprocal (gate and up joined as for
    ModelOpt); the pooled layer equals SGLang's unquantized `FusedMoE` on the dequantized weights."""
    from pooled_runner.sglang.runtime import set_runtime

    dtype = torch.bfloat16
    ckpt, view = compressed_checkpoint(nvfp4_checkpoint(checkpoint, seed=11, globals_=globals_), activations)
    rt = nvfp4_runtime()
    try:
        config = quant_config(activations)
        pooled, ref = pooled_and_reference(config, ckpt, dequantized(view, dtype), dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == "nvfp4" and rt.loader is None
        for i in range(NUM_LAYERS):
            for e in range(E):
                assert_bank_row(moe.bank.row(i, e), expected_rows(view, i, e), f"layer {i} expert {e}")
        what = f"compressed nvfp4 ({globals_}, activations {activations})"
        assert_layers_agree(pooled, ref, checkpoint, dtype, seed=13, what=what, tolerance=TOLERANCE)
    finally:
        set_runtime(None)


def test_compressed_nvfp4_needs_the_nvfp4_pool_format(runtime) -> None:  # type: ignore[no-untyped-def]
    """A bf16 pool names the flag; an ignore entry naming a layer's experts keeps that layer on the device."""
    from pooled_runner.sglang.layer import not_pooled_reason

    args = {"quant_config": quant_config(False), "prefix": "model.layers.1.mlp.experts"}
    assert (
        not_pooled_reason(args, "bf16")
        == "quantization nvfp4 (serve it with --moe-expert-pool-weight-format nvfp4)"
    )
    assert not_pooled_reason(args, "nvfp4") is None
    ignored = {**args, "quant_config": quant_config(False, ignore=("re:model.layers.1.mlp.experts.*",))}
    assert not_pooled_reason(ignored, "nvfp4") == (
        "experts the checkpoint leaves unquantized (its ignore list): the nvfp4 pool would quantize them"
    )


def test_rows_are_gate_then_up_whatever_the_scheme_loads_first(  # type: ignore[no-untyped-def]
    sglang_context, checkpoint, below_blackwell, monkeypatch
) -> None:
    """SGLang's W4A4 NVFP4 scheme (Blackwell) loads w13 up first for CUTLASS, through a flag its loader reads off
    the layer's method; the pool's rows are [gate; up] whatever the scheme: a scheme asking for up first still
    gives the checkpoint's rows in the pool's order."""
    from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsW4A16Nvfp4MoE

    from pooled_runner.sglang.runtime import set_runtime

    monkeypatch.setattr(CompressedTensorsW4A16Nvfp4MoE, "load_up_proj_weight_first", True)
    ckpt, view = compressed_checkpoint(nvfp4_checkpoint(checkpoint, seed=17, globals_="shared"), False)
    rt = nvfp4_runtime()
    try:
        pooled_and_reference(quant_config(False), ckpt, dequantized(view, torch.bfloat16), torch.bfloat16)
        bank = rt.require_moe().bank
        assert bank is not None
        for e in range(E):
            assert_bank_row(bank.row(0, e), expected_rows(view, 0, e), f"expert {e}")
    finally:
        set_runtime(None)
