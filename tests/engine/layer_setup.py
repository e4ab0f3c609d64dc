"""The layer tests' shared pieces (tests/engine/test_layer*.py): the embedded model's MoE sizes, a layer built
as SGLang's model code builds it, loaded through its real weight loader, and the pooled-against-reference check."""

from __future__ import annotations

import torch

E, H, I, K = 16, 64, 32, 4
NUM_LAYERS = 2


def build(cls: type, layer_id: int, dtype: torch.dtype, **kwargs: object) -> torch.nn.Module:
    """A layer of the embedded model's sizes, as its model code builds it (`kwargs` add to or override them)."""
    sizes: dict[str, object] = {"num_experts": E, "hidden_size": H, "intermediate_size": I, "top_k": K}
    return cls(
        layer_id=layer_id,
        params_dtype=dtype,
        prefix=f"model.layers.{layer_id}.mlp.experts",
        **{**sizes, **kwargs},
    )


def load(
    layer: torch.nn.Module,
    layer_id: int,
    sd: dict[str, torch.Tensor],
    skip: str | None = None,
    num_experts: int = E,
) -> None:
    """Feed the layer's expert tensors through `param.weight_loader`, as Qwen3MoeForCausalLM.load_weights does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=num_experts,
    )
    params = dict(layer.named_parameters())
    prefix = f"model.layers.{layer_id}.mlp."
    for name, weight in sd.items():
        if not name.startswith(prefix + "experts.") or name == skip:
            continue
        short = name[len(prefix) :]
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in short:
                local = short.replace(weight_name, param_name)[len("experts.") :]
                param = params[local]
                param.weight_loader(param, weight, local, shard_id=shard_id, expert_id=expert_id)  # type: ignore[operator]
                break


def pooled_and_reference(
    quant_config: object,
    checkpoint: dict[str, torch.Tensor],
    dequantized: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """NUM_LAYERS pooled layers built with `quant_config` and loaded from the quantized `checkpoint` (the runtime
    set), and SGLang's unquantized `FusedMoE` layers loaded from its `dequantized` weights, both processed after
    loading as SGLang's model loader does."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from pooled_runner.sglang.layer import PooledFusedMoE

    with set_default_torch_dtype(dtype):  # as SGLang's loader builds and loads the model
        pooled = [build(PooledFusedMoE, i, dtype, quant_config=quant_config) for i in range(NUM_LAYERS)]
        assert all(p.is_pooled for p in pooled)  # type: ignore[attr-defined]
        for i, layer in enumerate(pooled):
            load(layer, i, checkpoint)
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    return pooled, reference_layers(dequantized, dtype)


def reference_layers(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> list[torch.nn.Module]:
    """NUM_LAYERS of SGLang's unquantized `FusedMoE`, loaded from `weights` and processed as its loader does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        ref = [build(FusedMoE, i, dtype) for i in range(NUM_LAYERS)]
        for i, layer in enumerate(ref):
            load(layer, i, weights)
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    return ref


def tp_rank_loaded(quant_config: object, checkpoint: dict[str, torch.Tensor], rank: int) -> torch.nn.Module:
    """Layer 0 as rank `rank` of TP=2 builds it (half of I; the layer's moe_tp_rank/size, which SGLang's loader
    narrows by), pooled with `quant_config` and loaded from `checkpoint` (the runtime set)."""
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.bfloat16, quant_config=quant_config, intermediate_size=I // 2)
    assert layer.is_pooled  # type: ignore[attr-defined]
    layer.moe_tp_size, layer.moe_tp_rank = 2, rank
    load(layer, 0, checkpoint)
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    return layer


def assert_bank_row(row: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """A bank row holds `expected` (operand -> tensor) byte for byte, shapes included."""
    for name, tensor in expected.items():
        assert row[name].shape == tensor.shape, (what, name, tuple(row[name].shape), tuple(tensor.shape))
        assert torch.equal(row[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (what, name)


def assert_layers_agree(
    pooled: list[torch.nn.Module],
    ref: list[torch.nn.Module],
    sd: dict,
    dtype: torch.dtype,
    seed: int,
    what: str,
    tolerance: float = 2e-2,
) -> None:
    """Each pooled layer against its reference layer on fresh random tokens (T = 1, 7, 33), routed by the
    checkpoint's gate. bf16 rounding of two implementations stays <= 0.0156 here (|out| up to 4.4) for the
    bf16 and fp8 weights, 0.031 (two bf16 steps at |out| 3.7) for NVFP4's; a reference left on unquantized
    weights was 0.057-0.17 away at T=1."""
    from sglang.srt.layers.moe.topk import TopK

    topks = [TopK(top_k=K, renormalize=True, layer_id=i) for i in range(len(pooled))]
    g = torch.Generator().manual_seed(seed)
    for T in (1, 7, 33):
        for i, (mine, theirs) in enumerate(zip(pooled, ref, strict=True)):
            x = torch.randn(T, H, generator=g).to(dtype)
            routing = topks[i](x, x.float() @ sd[f"model.layers.{i}.mlp.gate.weight"].float().T)
            diff = (mine(x, routing).float() - theirs(x, routing).float()).abs()
            assert diff.max() <= tolerance, (
                f"{what} T={T} layer {i}: max diff {diff.max():.3g} at (token, col) {divmod(int(diff.argmax()), H)}"
            )
