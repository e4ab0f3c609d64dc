"""transformers adapter: swap the routed experts of a transformers MoE model for pooled experts.

transformers 5 keeps a layer's routed experts in one `<Arch>Experts` module (`model.layers.N.mlp.experts`,
`block_sparse_moe.experts` in Granite) with `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]` and
`forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`: the same layout and contract as
`PooledMoE.forward`. `pool_experts(model, config)` moves every such module's experts into one shared
`PooledMoE` (bank + pool) and leaves the rest of the model untouched (routers, shared experts, attention,
mamba/linear-attention layers). Build the model on the CPU, pool it, then move the model to the GPU: the
pooled modules hold no parameters, so `model.to("cuda")` moves only the non-expert weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pooled_runner.config import PoolConfig
from pooled_runner.moe import PooledMoE

logger = logging.getLogger("pooled_runner")


def _is_experts_module(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        type(module).__name__.endswith("Experts")
        and isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
    )


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(qualified name, module)` of every routed-experts module, in model order."""
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


class PooledExperts(nn.Module):
    """Stands in for one `<Arch>Experts` module; runs `PooledMoE.forward` for its pooled layer."""

    def __init__(self, moe: PooledMoE, layer: int, num_experts: int):
        super().__init__()
        self.moe = moe  # not a submodule: the pool's tensors must not follow model.to()
        self.layer = layer
        self.num_experts = num_experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # transformers marks "no expert" with id E (one_hot over E + 1 classes); the pool uses -1.
        ids = torch.where(top_k_index == self.num_experts, -1, top_k_index)  # [T, K]
        return self.moe.forward(self.layer, hidden_states, ids, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, pool_rows={self.moe.config.pool_rows}"


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of an experts module."""
    gate_up, down = getattr(module, "gate_up_proj"), getattr(module, "down_proj")  # noqa: B009
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


def _expert_shape(name: str, module: nn.Module) -> tuple[int, int, int]:
    gate_up, down = _weights(module)
    E, two_i, H = gate_up.shape
    if tuple(down.shape) != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
        )
    extra = sorted(
        n for n, _ in module.named_parameters(recurse=False) if n not in ("gate_up_proj", "down_proj")
    )
    if extra:
        raise ValueError(
            f"{name}: parameters {extra} besides gate_up_proj and down_proj (biases?): the pool computes "
            "bias-free experts; keep this model unpooled"
        )
    gate = getattr(type(module), "_apply_gate", None)  # transformers' experts decorator sets a default one
    custom_gate = gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"
    if custom_gate or getattr(module, "limit", None) is not None:
        # e.g. DeepSeek-V4's and gpt-oss's experts clamp gate and up (swiglu_limit) before the product
        raise ValueError(
            f"{name}: {type(module).__name__} gates its experts its own way (`_apply_gate` / a clamp limit); "
            "the pool computes silu(gate) * up unclamped: keep this model unpooled"
        )
    act = getattr(module, "act_fn", None)
    if (
        act is not None
        and not isinstance(act, nn.SiLU)
        and type(act).__name__ not in ("SiLUActivation", "SiLU")
    ):
        raise ValueError(
            f"{name}: activation {type(act).__name__} is not SiLU; the pool computes SiLU-gated MLPs"
        )
    return E, two_i // 2, H


def _top_k(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", cfg)
    for attr in ("num_experts_per_tok", "moe_topk", "top_k"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("model config has no num_experts_per_tok: cannot size the pool's top-k check")


def pool_experts(model: nn.Module, config: PoolConfig) -> PooledMoE:
    """Replace every routed-experts module of `model` with pooled experts sharing one PooledMoE.

    The experts are copied one at a time into the bank (or straight into rows when they all fit), in
    `config.weight_format` (a quantized format quantizes each expert on the way: the model then computes with
    the dequantized weights), then the original modules are dropped. Raises ValueError when the model has no
    experts module the pool handles. Returns the PooledMoE (for stats).
    """
    found = find_experts_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no routed-experts module (an '*Experts' module with 3-D gate_up_proj "
            "and down_proj): nothing to pool"
        )
    shapes = [_expert_shape(name, m) for name, m in found]
    H, inter = shapes[0][2], shapes[0][1]
    if any((s[1], s[2]) != (inter, H) for s in shapes):
        raise ValueError(f"experts modules differ in (I, H): {sorted({(s[1], s[2]) for s in shapes})}")
    dtype = _weights(found[0][1])[0].dtype
    moe = PooledMoE(config, H, inter, top_k=_top_k(model), dtype=dtype)
    for E, _, _ in shapes:
        moe.register_layer(E)

    def load(layer: int, expert: int) -> dict[str, torch.Tensor]:
        gate_up, down = _weights(found[layer][1])
        # the format's rows of the dense expert (bf16: the weights themselves; int4/fp8/NVFP4: quantized)
        return moe.format.quantize(
            gate_up[expert].detach().to("cpu", dtype).contiguous(),
            down[expert].detach().to("cpu", dtype).contiguous(),
        )

    with torch.no_grad():
        moe.install(load)
    for layer, (name, _) in enumerate(found):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PooledExperts(moe, layer, shapes[layer][0]))
    logger.info(
        "pooled %d experts modules of %s (%d experts)",
        len(found),
        type(model).__name__,
        moe.num_total_experts,
    )
    return moe
