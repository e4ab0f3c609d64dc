"""llm-compressor fp8 checkpoints (quant_method compressed-tensors, SGLang's `CompressedTensorsW8A8Fp8MoE`) at
layer level, against the real SGLang classes on CPU: strategy tensor and channel served as they are in the "fp8"
format, block in fp8-b{block}; the bank rows hold the checkpoint's bytes and the pooled layer equals SGLang's
unquantized `FusedMoE` on the dequantized weights. Shared pieces in `layer_setup.py`, fixtures in conftest.py."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig
from tests.engine.layer_setup import (
    NUM_LAYERS,
    E,
    H,
    I,
    assert_bank_row,
    assert_layers_agree,
    build,
    pooled_and_reference,
    tp_rank_loaded,
)

E4M3_MAX = 448.0
BLOCK = 16
# weights and input activations of each strategy, as llm-compressor writes them in config.json
SCHEMES = {
    "tensor": (
        {"strategy": "tensor"},
        {"strategy": "tensor", "dynamic": False},
    ),
    "channel": ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}),
    "block": (
        {"strategy": "block", "block_structure": [BLOCK, BLOCK]},
        {"strategy": "group", "group_size": BLOCK, "dynamic": True},
    ),
}
FORMATS = {"tensor": "fp8", "channel": "fp8", "block": f"fp8-b{BLOCK}"}


def compressed_config(strategy: str, ignore: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    weights, inputs = SCHEMES[strategy]
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {
        "targets": ["Linear"],
        "weights": {**fp8, "dynamic": False, **weights},
        "input_activations": {**fp8, **inputs},
    }
    return CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", *ignore],
        }
    )


def scales_of(w: torch.Tensor, strategy: str) -> torch.Tensor:
    """amax / 448 per tensor ([1]), per output channel ([N, 1]) or per [BLOCK, BLOCK] tile."""
    a = w.float().abs()
    if strategy == "tensor":
        return (a.amax() / E4M3_MAX).reshape(1)
    if strategy == "channel":
        return a.amax(dim=1, keepdim=True) / E4M3_MAX
    n, k = w.shape
    return a.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3)) / E4M3_MAX


def expand(scale: torch.Tensor, shape: torch.Size, strategy: str) -> torch.Tensor:
    """A scale tensor broadcast to the weight's shape."""
    if strategy == "block":
        return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return scale.reshape(-1, 1).expand(shape) if strategy == "channel" else scale.reshape(()).expand(shape)


def compressed_checkpoint(sd: dict[str, torch.Tensor], strategy: str, seed: int) -> dict[str, torch.Tensor]:
    """The experts of `sd` quantized here in plain torch (not the pool's quantizer) as llm-compressor stores
    them: `weight` e4m3, `weight_scale` fp32 (w = q * scale), and a static `input_scale` for strategy tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sd.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            scale = scales_of(w, strategy)
            q = (w.float() / expand(scale, w.shape, strategy)).clamp(-E4M3_MAX, E4M3_MAX)
            out[name] = q.to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale
            if strategy == "tensor":
                out[name.removesuffix("weight") + "input_scale"] = torch.rand(1, generator=g) + 0.01
        else:
            out[name] = w
    return out


def dequantized(ckpt: dict[str, torch.Tensor], strategy: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in ckpt.items():
        if name.endswith(("weight_scale", "input_scale")):
            continue
        scale = ckpt.get(name + "_scale")
        out[name] = (
            (w.float() * expand(scale, w.shape, strategy)).to(dtype) if scale is not None else w.to(dtype)
        )
    return out


@pytest.mark.parametrize("strategy", list(SCHEMES))
def test_compressed_tensors_fp8_is_pooled_as_it_is(sglang_context, checkpoint, strategy: str) -> None:  # type: ignore[no-untyped-def]

    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    dtype, fmt = torch.bfloat16, FORMATS[strategy]
    ckpt = compressed_checkpoint(checkpoint, strategy, seed=11)
    reference = dequantized(ckpt, strategy, dtype)
    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format=fmt), cpu=True)
    )
    set_runtime(rt)
    try:
        pooled, ref = pooled_and_reference(compressed_config(strategy), ckpt, reference, dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == fmt and rt.loader is None
        for i in range(NUM_LAYERS):
            for e in range(E):
                prefix = f"model.layers.{i}.mlp.experts.{e}."
                gate, up, down = (ckpt[prefix + p + "_proj.weight"] for p in ("gate", "up", "down"))
                gate_s, up_s, down_s = (
                    ckpt[prefix + p + "_proj.weight_scale"] for p in ("gate", "up", "down")
                )
                if strategy == "tensor":
                    gate_s, up_s, down_s = gate_s.expand(I), up_s.expand(I), down_s.expand(H)
                expected = {
                    "w13": torch.cat([gate, up]),
                    "w13_s": torch.cat([gate_s, up_s]).reshape(moe.bank.row(i, e)["w13_s"].shape),
                    "w2": down,
                    "w2_s": down_s.reshape(moe.bank.row(i, e)["w2_s"].shape),
                }
                assert_bank_row(moe.bank.row(i, e), expected, f"layer {i} expert {e}")
        assert_layers_agree(
            pooled, ref, checkpoint, dtype, seed=19, what=f"compressed-tensors fp8 {strategy}"
        )
        assert moe.stats().misses > 0
    finally:
        set_runtime(None)


def test_compressed_tensors_fp8_needs_its_pool_format(runtime) -> None:  # type: ignore[no-untyped-def]
    """The default bf16 pool: the layer stays on the device, naming the flag."""
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=compressed_config("channel"))
    assert not layer.is_pooled
    assert runtime.not_pooled == {
        "quantization fp8 (serve it with --moe-expert-pool-weight-format fp8)": ["model.layers.0.mlp.experts"]
    }


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_compressed_tensors_fp8_under_tensor_parallelism(
    sglang_context, checkpoint, strategy: str, rank: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank r of TP=2: gate/up rows [r*I/2, (r+1)*I/2) and the same columns of down, byte for byte, with the
    matching slice of the per-channel scales (down's [H, 1] whole) or of the block scales."""
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    half, fmt = I // 2, FORMATS[strategy]
    ckpt = compressed_checkpoint(checkpoint, strategy, seed=13)
    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format=fmt), cpu=True)
    )
    set_runtime(rt)
    try:
        tp_rank_loaded(compressed_config(strategy), ckpt, rank)
        bank = rt.require_moe().bank
        assert bank is not None
        rows = slice(rank * half, (rank + 1) * half)
        scale_rows = (
            rows if strategy == "channel" else slice(rank * half // BLOCK, (rank + 1) * half // BLOCK)
        )
        for e in range(E):
            prefix = f"model.layers.0.mlp.experts.{e}."
            gate, up, down = (ckpt[prefix + p + "_proj.weight"] for p in ("gate", "up", "down"))
            gate_s, up_s, down_s = (ckpt[prefix + p + "_proj.weight_scale"] for p in ("gate", "up", "down"))
            row = bank.row(0, e)
            expected = {
                "w13": torch.cat([gate[rows], up[rows]]),
                "w13_s": torch.cat([gate_s[scale_rows], up_s[scale_rows]]).reshape(row["w13_s"].shape),
                "w2": down[:, rows],
                "w2_s": (down_s if strategy == "channel" else down_s[:, scale_rows]).reshape(
                    row["w2_s"].shape
                ),
            }
            assert_bank_row(row, expected, f"rank {rank} expert {e}")
    finally:
        set_runtime(None)


def test_compressed_tensors_layers_left_unquantized_or_mxfp4(runtime) -> None:  # type: ignore[no-untyped-def]
    """A MoE layer the `ignore` list leaves in bf16 stays on the device in an fp8 pool (it would be quantized)
    and is pooled in a bf16 one; an MXFP4 checkpoint (SGLang's own Mxfp4MoEMethod, no scheme) is not pooled,
    with its reason, rather than failing in the scheme choice."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from pooled_runner.sglang.layer import not_pooled_reason

    config = compressed_config("channel", ignore=("re:model.layers.1.mlp.experts.*",))
    layer1 = {"quant_config": config, "prefix": "model.layers.1.mlp.experts"}
    assert not_pooled_reason(layer1, "fp8") == (
        "experts the checkpoint leaves unquantized (its ignore list): the fp8 pool would quantize them"
    )
    assert not_pooled_reason(layer1, "bf16") is None
    assert not_pooled_reason({**layer1, "prefix": "model.layers.0.mlp.experts"}, "fp8") is None
    mxfp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}
    mx_config = CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": mxfp4}},
            "ignore": ["lm_head"],
        }
    )
    reason = not_pooled_reason({"quant_config": mx_config, "prefix": "model.layers.0.mlp.experts"}, "fp8")
    assert reason is not None and reason.startswith("quantization compressed_tensors"), reason
