"""What the launcher reads from a checkpoint's config.json (and a legacy ModelOpt hf_quant_config.json) before
any weight is read (no SGLang import).

Used to refuse a bad `--moe-expert-pool-rows` (below top-k, above the experts there are), a model with no MoE
layer or a quantization the pool does not handle, all in one message, before the server starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pooled_runner.sglang.modelopt_facts import (
    HF_QUANT_CONFIG,
    is_modelopt,
    legacy_file_is_read,
    modelopt_facts,
    sglang_quant_algo,
)

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
# Mixtral-style configs give the expert size as intermediate_size (they have no separate dense MLP).
_EXPERT_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class ModelFacts:
    """MoE facts of a checkpoint's main model (draft/MTP layers excluded)."""

    num_moe_layers: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    # quant_method of quantization_config (else its quant_algo), or a legacy hf_quant_config.json's quant_algo
    quantization: str | None
    hidden_size: int = 0  # 0 when config.json does not say
    moe_intermediate_size: int = 0  # one routed expert's intermediate size (all TP ranks together)
    dtype: str = ""  # torch_dtype / dtype of config.json, "" when absent
    # why the router's logits are not the scores its top-k selects on ("" when they are: softmax routing)
    router_logits_differ: str = ""
    # the pool format a quantized checkpoint's experts already are ("fp8-b128" for DeepSeek-style fp8 blocks,
    # "nvfp4" for ModelOpt NVFP4), "" when the pool cannot take them as they are
    native_format: str = ""
    # config.json does not settle the experts' format (compressed-tensors groups, or ignore / exclude entries
    # that could name experts): each layer decides, and the launcher does not refuse on the format
    native_format_per_layer: bool = False

    @property
    def num_total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _moe_layers(config: dict[str, Any], num_layers: int) -> list[int]:
    """The indices of the main model's MoE layers."""
    if "first_k_dense_replace" in config:  # DeepSeek / GLM family
        freq = int(config.get("moe_layer_freq", 1) or 1)
        first = int(config["first_k_dense_replace"])
        return [i for i in range(first, num_layers) if i % freq == 0]
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


# model_type values whose SGLang top-k selects on the gate's logits (softmax, or top-k then softmax) with no
# correction bias: an allowlist, since a bias or a grouped sigmoid top-k is not always visible in config.json
# (GLM-4.5 and Ernie-4.5 add a correction bias with no key saying so)
_LOGIT_ROUTERS = ("qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "olmoe", "gpt_oss", "deepseek_v2")


def _router_logits_differ(text: dict[str, Any]) -> str:
    """Why the router's logits may not be what its top-k is taken on (a planner policy reading them would rank
    by the wrong scores), or "" for softmax routing over the logits (an allowlisted `model_type`)."""
    model_type = text.get("model_type")
    if model_type not in _LOGIT_ROUTERS:
        return f"model_type {model_type!r} is not one known to select on its logits ({', '.join(_LOGIT_ROUTERS)})"
    reasons = []
    scoring = text.get("scoring_func")
    if scoring not in (None, "softmax"):
        reasons.append(f"scoring_func {scoring}")
    if text.get("topk_method") not in (None, "greedy"):  # DeepSeek-V2's group_limited_greedy, V3's noaux_tc
        reasons.append(f"topk_method {text.get('topk_method')}")
    groups, top_groups = int(text.get("n_group") or 1), int(text.get("topk_group") or 0)
    if groups > 1 and 0 < top_groups < groups:
        reasons.append(f"group-limited top-k ({top_groups} of {groups} groups)")
    return "; ".join(reasons)


def _native_format(quant: dict[str, Any], moe_layers: list[int]) -> tuple[str, bool]:
    """(the pool format of a quantization_config's experts or "", whether only the layers can tell): fp8 e4m3
    in square blocks the pool's fp8 format has (DeepSeek-V3, Qwen3-*-FP8: `weight_block_size` [128, 128], scales
    `weight_scale_inv` per block), or with one scale per tensor (no `weight_block_size`: the per-channel "fp8"
    format); llm-compressor's fp8 (compressed-tensors) per tensor, channel or square block; NVIDIA ModelOpt's
    NVFP4 ("nvfp4"; a config.json one, or the legacy hf_quant_config.json's)."""
    from pooled_runner.formats.fp8 import checkpoint_format

    if quant.get("quant_method") == "compressed-tensors":
        from pooled_runner.sglang.compressed_facts import compressed_tensors_facts

        facts = compressed_tensors_facts(quant)
        return facts.native_format, facts.per_layer
    if is_modelopt(quant):
        modelopt = modelopt_facts(quant, moe_layers)
        return modelopt.native_format, modelopt.per_layer
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        return "", False
    if quant.get("moe_quant_algo"):  # SGLang's hybrid fp8 + NVFP4 experts (DeepSeek-V4-Pro-NVFP4): not fp8
        return "", False
    return checkpoint_format(quant.get("weight_block_size")), False


def facts_from_config(config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None) -> ModelFacts:
    """MoE facts from a config.json dict (a `text_config` inside it wins for multimodal checkpoints);
    `hf_quant_config`: the checkpoint's parsed legacy ModelOpt `hf_quant_config.json`, which SGLang reads only
    when config.json has no quantization_config (nor compression_config), and only for a quant_algo it knows."""
    quant = config.get("quantization_config")
    quant_name = None
    if isinstance(quant, dict):
        quant_name = str(quant.get("quant_method") or quant.get("quant_algo") or "unknown")
    elif (
        config.get("compression_config") is None
        and hf_quant_config is not None
        and legacy_file_is_read(hf_quant_config)
    ):
        quant, quant_name = hf_quant_config, sglang_quant_algo(hf_quant_config)
    text = config.get("text_config") or config
    num_experts = _first(text, _EXPERT_KEYS)
    num_layers = int(text.get("num_hidden_layers", 0) or 0)
    moe_layers = _moe_layers(text, num_layers) if num_experts > 0 else []
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or ""
    native, per_layer = _native_format(quant, moe_layers) if isinstance(quant, dict) else ("", False)
    return ModelFacts(
        len(moe_layers),
        num_experts,
        _first(text, _TOP_K_KEYS),
        quant_name,
        hidden_size=_first(text, ("hidden_size",)),
        moe_intermediate_size=_first(text, _EXPERT_INTERMEDIATE_KEYS),
        dtype=str(dtype),
        router_logits_differ=_router_logits_differ(text),
        native_format=native,
        native_format_per_layer=per_layer,
    )


def read_model_facts(model_path: str) -> ModelFacts | None:
    """Facts of a local checkpoint directory (its config.json, and a legacy ModelOpt hf_quant_config.json beside
    it where SGLang reads one); None when the path is not a local directory with config.json."""
    folder = Path(model_path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    config = _read_json(folder / "config.json")
    legacy = folder / HF_QUANT_CONFIG
    read_legacy = config.get("quantization_config") is None and legacy.is_file()
    return facts_from_config(config, _read_json(legacy) if read_legacy else None)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data
