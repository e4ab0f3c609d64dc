"""llm-compressor NVFP4 checkpoints (quant_method compressed-tensors, format nvfp4-pack-quantized: NVFP4A16, and
NVFP4 W4A4, which SGLang serves weight-only below Blackwell with `CompressedTensorsW4A16Nvfp4MoE`) at layer level,
against the real SGLang classes on CPU: `weight_packed` and `weight_scale` go into the "nvfp4" rows as they are,
and `weight_global_scale` (which divides: w = e2m1 * s / global_scale) as its reciprocal. The checkpoints are
made by compressed-tensors' own `NVFP4PackedCompressor` and its `decompress` is the reference. Shared pieces in
`layer_setup.py`, fixtures in conftest.py."""

from __future__ import annotations

import pytest
import torch

from tests.engine.layer_setup import (
    NUM_LAYERS,
    E,
    I,
    assert_layers_agree,
    pooled_and_reference,
    tp_rank_loaded,
)
from tests.engine.test_layer_nvfp4_modelopt import TOLERANCE, dequantize, nvfp4_runtime

NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor_group",
    "group_size": 16,
    "dynamic": False,
}
PROJECTIONS = ("gate", "up", "down")


def compressed_checkpoint(
    sd: dict[str, torch.Tensor], activations: bool, shared: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the experts of `sd` compressed by compressed-tensors' `NVFP4PackedCompressor`: `weight_packed`,
    `weight_scale`, `weight_global_scale` [1] from its `generate_gparam`, and an `input_global_scale` [1] for W4A4;
    its `decompress` of them). `shared`: gate and up take one global scale (the smaller, as llm-compressor fuses
    them), else each its own."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    inputs = QuantizationArgs(**{**NVFP4_ARGS, "dynamic": "local"}) if activations else None
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**NVFP4_ARGS), input_activations=inputs
    )
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    dense = dict(out)
    experts = sorted({k.rsplit(".", 2)[0] for k in sd if ".mlp.experts." in k and k.endswith("_proj.weight")})
    for prefix in experts:
        w = {p: sd[f"{prefix}.{p}_proj.weight"].float() for p in PROJECTIONS}
        g = {p: generate_gparam(w[p].min(), w[p].max()) for p in PROJECTIONS}
        if shared:
            g["gate"] = g["up"] = torch.min(g["gate"], g["up"])
        for p in PROJECTIONS:
            n, k = w[p].shape
            amax = w[p].reshape(n, k // 16, 16).abs().amax(-1)
            scale = (amax / 6.0 * g[p]).clamp(max=448).to(torch.float8_e4m3fn).float()
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            state = {"weight": w[p], "weight_scale": scale, "weight_global_scale": g[p]}
            compressed = NVFP4PackedCompressor.compress(state, scheme)
            name = f"{prefix}.{p}_proj."
            for tensor in ("weight_packed", "weight_scale", "weight_global_scale"):
                out[name + tensor] = compressed[tensor]
            assert compressed["weight_global_scale"].shape == (1,)  # as real checkpoints carry it
            if activations:
                out[name + "input_global_scale"] = torch.tensor([123.0])
            copy = {key: value.clone() for key, value in compressed.items()}
            dense[name + "weight"] = NVFP4PackedCompressor.decompress(copy, scheme)["weight"]
    return out, dense


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


def row_weights(row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A bank row's (w13, w2), dequantized in plain torch (e2m1 * s * g) and rounded to bf16 as served."""
    w13 = dequantize(row["w13"], row["w13_s"], float(row["w13_g"]))
    w2 = dequantize(row["w2"], row["w2_s"], float(row["w2_g"]))
    return w13.bfloat16().float(), w2.bfloat16().float()


def assert_rows_hold(
    moe: object, dense: dict[str, torch.Tensor], layers: int, rows: slice = slice(None)
) -> None:
    """Each expert's rows dequantize to compressed-tensors' own decompress, both rounded to bf16 as served, exactly:
    its gate/up rows `rows` and the same columns of down. (compressed-tensors divides by the global scale, the
    rows multiply by its fp32 reciprocal: the fp32 results may differ in the last bit, which bf16 drops here.)"""
    bank = moe.bank  # type: ignore[attr-defined]
    assert bank is not None
    for i in range(layers):
        for e in range(E):
            w13, w2 = row_weights(bank.row(i, e))
            p = f"model.layers.{i}.mlp.experts.{e}."
            gate, up, down = (dense[f"{p}{q}_proj.weight"].bfloat16().float() for q in PROJECTIONS)
            for what, got, want in (
                ("w13", w13, torch.cat([gate[rows], up[rows]])),
                ("w2", w2, down[:, rows]),
            ):
                diff = (got - want).abs()
                assert torch.equal(got, want), f"layer {i} expert {e} {what}: {float(diff.max()):.3g} apart"


@pytest.mark.parametrize("activations", [False, True], ids=["nvfp4a16", "w4a4-as-w4a16"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-globals", "own-globals"])
def test_compressed_nvfp4_checkpoint_is_pooled_as_it_is(  # type: ignore[no-untyped-def]
    sglang_context, checkpoint, below_blackwell, activations: bool, shared: bool
) -> None:
    """Served with --moe-expert-pool-weight-format nvfp4: SGLang's NVFP4 W4A16 scheme lays out the placeholders;
    the rows dequantize to compressed-tensors' own decompress (gate and up with their own globals: joined onto
    one, the block scales rescaled, within 1/16 of a row's largest value); the pooled layer equals SGLang's
    unquantized `FusedMoE` on the decompressed weights."""
    from pooled_runner.sglang.runtime import set_runtime

    dtype = torch.bfloat16
    ckpt, dense = compressed_checkpoint(checkpoint, activations, shared)
    rt = nvfp4_runtime()
    try:
        reference = {k: v.to(dtype) for k, v in dense.items()}
        pooled, ref = pooled_and_reference(quant_config(activations), ckpt, reference, dtype)
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == "nvfp4" and rt.loader is None
        if shared:
            assert_rows_hold(moe, dense, NUM_LAYERS)
            what = f"compressed nvfp4 (activations {activations})"
            assert_layers_agree(pooled, ref, checkpoint, dtype, seed=13, what=what, tolerance=TOLERANCE)
            return
        for i in range(NUM_LAYERS):
            for e in range(E):
                w13, _ = row_weights(moe.bank.row(i, e))
                p = f"model.layers.{i}.mlp.experts.{e}."
                want = torch.cat([dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"]]).float()
                change = float(((w13 - want).abs().amax(1) / want.abs().amax(1)).max())
                assert change <= 1 / 16, (
                    f"layer {i} expert {e}: a row changed by {change:.3g} of its largest value"
                )
    finally:
        set_runtime(None)


@pytest.mark.parametrize("rank", [0, 1])
def test_compressed_nvfp4_checkpoint_under_tensor_parallelism(  # type: ignore[no-untyped-def]
    sglang_context, checkpoint, below_blackwell, rank: int
) -> None:
    """Rank r of TP=2 (SGLang's GROUP-tagged scales): its rows dequantize to its slices of the decompressed
    experts, gate/up rows [r*I/2, (r+1)*I/2) and the same columns of down."""
    from pooled_runner.sglang.runtime import set_runtime

    ckpt, dense = compressed_checkpoint(checkpoint, activations=True)
    rt = nvfp4_runtime()
    try:
        tp_rank_loaded(quant_config(True), ckpt, rank)
        assert_rows_hold(rt.require_moe(), dense, 1, slice(rank * I // 2, (rank + 1) * I // 2))
    finally:
        set_runtime(None)


def test_rows_are_gate_then_up_with_the_blackwell_w4a4_scheme(  # type: ignore[no-untyped-def]
    sglang_context, checkpoint, monkeypatch
) -> None:
    """On Blackwell SGLang builds its W4A4 NVFP4 scheme, which loads w13 up first for CUTLASS (through a flag its
    loader reads off the layer's method): the pool's rows stay [gate; up]. Blackwell is simulated (the scheme's
    capability and platform checks answered as there)."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW4A4Nvfp4MoE,
        compressed_tensors_w4a4_nvfp4_moe,
    )

    from pooled_runner.sglang.runtime import set_runtime

    class Blackwell:
        is_blackwell = True
        is_sm100 = True

    monkeypatch.setattr(CompressedTensorsConfig, "_check_scheme_supported", lambda *a, **k: True)
    monkeypatch.setattr(compressed_tensors_w4a4_nvfp4_moe, "get_platform", lambda: Blackwell())
    dtype = torch.bfloat16
    ckpt, dense = compressed_checkpoint(checkpoint, activations=True)
    rt = nvfp4_runtime()
    try:
        reference = {k: v.to(dtype) for k, v in dense.items()}
        pooled, ref = pooled_and_reference(quant_config(True), ckpt, reference, dtype)
        assert type(pooled[0].scheme) is CompressedTensorsW4A4Nvfp4MoE  # type: ignore[attr-defined]
        assert pooled[0].scheme.load_up_proj_weight_first  # type: ignore[attr-defined]
        assert_rows_hold(rt.require_moe(), dense, NUM_LAYERS)
        what = "compressed nvfp4 (Blackwell's W4A4 scheme)"
        assert_layers_agree(pooled, ref, checkpoint, dtype, seed=3, what=what, tolerance=TOLERANCE)
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
