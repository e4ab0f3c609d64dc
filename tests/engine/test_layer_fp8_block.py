"""DeepSeek-style fp8 block checkpoints at layer level, against the real SGLang classes on CPU: served as they are
(weights and block scales straight into the bank rows), each tensor-parallel rank's blocks, and the flag a
default pool needs. Shared pieces in `layer_setup.py`, fixtures in conftest.py."""

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
    pooled_and_reference,
    tp_rank_loaded,
)


def fp8_block_checkpoint(sd: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """The experts of `sd` as a DeepSeek-style fp8 checkpoint: each projection e4m3 with an fp32
    `weight_scale_inv` per [block, block] tile (w = q * scale_inv); everything else as it was."""
    from pooled_runner.formats.quant import quantize_fp8

    out = {}
    for name, w in sd.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_fp8(w, block)
        else:
            out[name] = w
    return out


def test_fp8_block_checkpoint_is_pooled_as_it_is(sglang_context, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """An fp8 checkpoint in 16x16 blocks, served with --moe-expert-pool-weight-format fp8-b16: SGLang's fp8
    method lays out the placeholders and its loader writes weights and block scales straight into the bank rows
    (no dequantize, no requantize); the pooled layer equals SGLang's unquantized `FusedMoE` on the dequantized
    weights."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    dtype, block = torch.bfloat16, 16
    fp8 = fp8_block_checkpoint(checkpoint, block)
    dequantized = {  # SGLang's own block dequantization: the reference does not share ours
        name: block_quant_dequant(w, fp8[name + "_scale_inv"], [block, block], dtype)
        if name + "_scale_inv" in fp8
        else w.to(dtype)
        for name, w in fp8.items()
        if not name.endswith("_scale_inv")
    }
    quant_config = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[block, block]
    )
    rt = PoolRuntime(
        ServeConfig(
            pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format=f"fp8-b{block}"), cpu=True
        )
    )
    set_runtime(rt)
    try:
        pooled, ref = pooled_and_reference(quant_config, fp8, dequantized, dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == f"fp8-b{block}" and rt.loader is None
        for i in range(NUM_LAYERS):
            for e in range(E):
                prefix = f"model.layers.{i}.mlp.experts.{e}."
                expected = {
                    "w13": torch.cat([fp8[prefix + "gate_proj.weight"], fp8[prefix + "up_proj.weight"]]),
                    "w13_s": torch.cat(
                        [fp8[prefix + "gate_proj.weight_scale_inv"], fp8[prefix + "up_proj.weight_scale_inv"]]
                    ),
                    "w2": fp8[prefix + "down_proj.weight"],
                    "w2_s": fp8[prefix + "down_proj.weight_scale_inv"],
                }
                assert_bank_row(moe.bank.row(i, e), expected, f"layer {i} expert {e}")
        assert_layers_agree(pooled, ref, checkpoint, dtype, seed=13, what="fp8 checkpoint")
        assert moe.stats().misses > 0
    finally:
        set_runtime(None)


@pytest.mark.parametrize("rank", [0, 1])
def test_fp8_block_checkpoint_under_tensor_parallelism_takes_each_ranks_blocks(
    sglang_context, checkpoint, rank: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank r of TP=2 (the layer's moe_tp_rank/size, which SGLang's loader narrows by): its bank rows are the
    checkpoint's gate/up rows [r*I/2, (r+1)*I/2), the same columns of down, and the matching block rows and
    columns of the `weight_scale_inv` tiles, byte for byte."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    block, half = 16, I // 2
    fp8 = fp8_block_checkpoint(checkpoint, block)
    config = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[block, block]
    )
    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format="fp8-b16"), cpu=True)
    )
    set_runtime(rt)
    try:
        tp_rank_loaded(config, fp8, rank)
        bank = rt.require_moe().bank
        assert bank is not None
        rows, blocks = (
            slice(rank * half, (rank + 1) * half),
            slice(rank * half // block, (rank + 1) * half // block),
        )
        for e in range(E):
            prefix = f"model.layers.0.mlp.experts.{e}."
            gate, up, down = (fp8[prefix + p + "_proj.weight"] for p in ("gate", "up", "down"))
            gate_s, up_s, down_s = (
                fp8[prefix + p + "_proj.weight_scale_inv"] for p in ("gate", "up", "down")
            )
            expected = {
                "w13": torch.cat([gate[rows], up[rows]]),
                "w13_s": torch.cat([gate_s[blocks], up_s[blocks]]),
                "w2": down[:, rows],
                "w2_s": down_s[:, blocks],
            }
            assert_bank_row(bank.row(0, e), expected, f"rank {rank} expert {e}")
    finally:
        set_runtime(None)


def test_fp8_block_checkpoint_needs_its_own_pool_format(runtime) -> None:  # type: ignore[no-untyped-def]
    """The default bf16 pool cannot take fp8 experts as they are: the layer stays on the device, saying the flag."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from pooled_runner.sglang.layer import PooledFusedMoE

    quant_config = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[16, 16]
    )
    layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config)
    assert not layer.is_pooled
    assert runtime.not_pooled == {
        "quantization fp8-b16 (serve it with --moe-expert-pool-weight-format fp8-b16)": [
            "model.layers.0.mlp.experts"
        ]
    }
