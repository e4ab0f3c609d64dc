"""What the launcher can tell from an NVIDIA ModelOpt quantization config alone: the pool format its MoE experts
already are, or that only the layers can tell (no SGLang import).

It reads the config as SGLang 0.5.23 does (`ModelConfig._parse_quant_hf_config` picks the method,
`ModelOptFp4Config.from_config` reads it): config.json's `quantization_config` when its `quant_method` is
"modelopt" or absent, in the flat form (`quant_algo`, `group_size`, `ignore` / `modules_to_not_convert` /
`exclude_modules` at the top) or the nested one; else, when config.json has none, the legacy
`hf_quant_config.json` beside it (`{"producer": ..., "quantization": {"quant_algo", "group_size",
"exclude_modules", ...}}`). A pre-quantized NVFP4 checkpoint (quant_algo NVFP4 or W4A16_NVFP4, groups of 16: packed
e2m1 `weight`, e4m3 `weight_scale` per 16 values, fp32 `weight_scale_2`) is the pool's "nvfp4" as it is.
ModelOpt FP8 (quant_algo FP8: e4m3 weights with one `weight_scale` and `input_scale` per tensor) is the pool's
"fp8" as it is (per-tensor scales widened to its per-channel ones on load). NVFP4_AWQ (pre-quant scales),
MIXED_PRECISION, MXFP8 and other NVFP4 group sizes are not served. For FP8, an `exclude_modules` pattern that
could name an MoE layer's experts (matched as `ModelOptQuantConfig.is_layer_excluded` matches a FusedMoE prefix)
leaves the format to the layers; for NVFP4 it does only where every MoE layer is excluded, since a layer left
to SGLang's own NVFP4 method fails to build on Hopper with the pool's triton runner (the nvfp4 pool keeps the
excluded layers' bf16 experts on the device).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HF_QUANT_CONFIG = "hf_quant_config.json"
SERVED_ALGOS = ("NVFP4", "W4A16_NVFP4")  # NVFP4_AWQ carries pre_quant_scale: not the pool's layout
GROUP = 16
# where SGLang's MoE models put their FusedMoE layers (its `prefix`), with and without a multimodal wrapper
LAYER_STACKS = ("model.layers", "language_model.model.layers", "model.language_model.layers")
EXPERT_CONTAINERS = ("mlp.experts", "block_sparse_moe.experts")


@dataclass(frozen=True)
class ModelOptFacts:
    native_format: str  # "fp8" or "nvfp4", or "" when the pool cannot take the experts as they are
    per_layer: bool = False  # an exclude pattern may name experts: the layers decide


def is_modelopt(quant: dict[str, Any]) -> bool:
    """Whether SGLang reads a config.json `quantization_config` as ModelOpt's: quant_method "modelopt" or none."""
    return "quant_method" not in quant or quant["quant_method"] == "modelopt"


def sglang_quant_algo(quant: dict[str, Any]) -> str | None:
    """The quant_algo SGLang picks the method by (`unwrap_modelopt_quantization_config`: flat, or nested once or
    twice under "quantization")."""
    inner = quant.get("quantization", quant)
    if not isinstance(inner, dict):
        return None
    nested = inner.get("quantization")
    algo = (nested if isinstance(nested, dict) else inner).get("quant_algo")
    return algo if isinstance(algo, str) else None


def legacy_file_is_read(quant_file: dict[str, Any]) -> bool:
    """Whether SGLang takes an `hf_quant_config.json` as a quantization at all (`_parse_modelopt_quant_config`
    returns None, and the model is served unquantized, for a quant_algo it does not know, e.g. null with only a
    kv-cache algo)."""
    algo = sglang_quant_algo(quant_file)
    return algo is not None and (algo in ("MIXED_PRECISION", "FP8", "MXFP8") or "FP4" in algo)


def modelopt_facts(quant: dict[str, Any], moe_layers: Sequence[int]) -> ModelOptFacts:
    """The experts' pool format from a ModelOpt config (config.json's `quantization_config` or the parsed
    `hf_quant_config.json`); `moe_layers`: the main model's MoE layer indices, whose experts' prefixes the exclude
    patterns are tested against."""
    algo = sglang_quant_algo(quant)
    if algo == "FP8":  # SGLang's modelopt_fp8: e4m3 weights, one weight_scale and input_scale per tensor
        exclude, native = _fp8_exclude(quant), "fp8"
    elif algo is not None and "FP4" in algo:
        read = _fp4_config(quant)
        if read is None or read[0] not in SERVED_ALGOS or read[1] != GROUP:
            return ModelOptFacts("")
        exclude, native = read[2], "nvfp4"
    else:  # modelopt_mixed, w4afp8 or mxfp8
        return ModelOptFacts("")
    if exclude is None:  # SGLang's from_config raises, or reads no list of patterns
        return ModelOptFacts("")
    excluded = [i for i in moe_layers if any(_may_name_experts(str(p), _expert_names([i])) for p in exclude)]
    # FP8: a layer an exclude pattern names is bf16, so the layers decide. NVFP4: SGLang's own NVFP4 experts
    # cannot be built on Hopper with the pool's triton runner, so the pool must take every NVFP4 layer (the
    # excluded ones stay on the device); only a checkpoint whose every MoE layer is excluded leaves it to them
    if excluded and (native == "fp8" or len(excluded) == len(moe_layers)):
        return ModelOptFacts("", per_layer=True)
    return ModelOptFacts(native)


def _fp8_exclude(config: dict[str, Any]) -> list[Any] | None:
    """The exclude patterns as `ModelOptFp8Config.from_config` reads them: `ignore` of the flat form,
    `quantization.exclude_modules` of the nested one (absent or null: none); None for a value that is no list."""
    if config.get("quant_algo") is not None:
        exclude = config.get("ignore")
    else:
        nested = config.get("quantization")
        exclude = nested.get("exclude_modules") if isinstance(nested, dict) else None
    if exclude is None:
        return []
    return exclude if isinstance(exclude, list) else None


def _fp4_config(config: dict[str, Any]) -> tuple[str, object, list[Any]] | None:
    """(quant_algo, group_size, exclude patterns) as `ModelOptFp4Config.from_config` reads them; None where it
    raises (an algo it does not take, no group size, a null exclude list) or the exclude list is not a list."""
    algo = config.get("quant_algo")
    if algo is not None:  # flat (config.json)
        group_size = config.get("group_size")
        if group_size is None:
            groups = config.get("config_groups") or {}
            first: Any = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
            weights = first.get("weights", {}) if isinstance(first, dict) else {}
            group_size = weights.get("group_size") if isinstance(weights, dict) else None
        if group_size is None and isinstance(algo, str) and "NVFP4" in algo:
            group_size = GROUP
        exclude = config.get(
            "ignore", config.get("modules_to_not_convert", config.get("exclude_modules", []))
        )
    else:  # nested (hf_quant_config.json)
        nested = config.get("quantization")
        if not isinstance(nested, dict) or "quant_algo" not in nested:
            return None
        algo = nested["quant_algo"]
        group_size = _common_group_size(config)
        exclude = nested.get("exclude_modules", [])
    if algo not in ("FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4") or group_size is None:
        return None
    if not isinstance(exclude, list):  # null: SGLang raises; a string or a mapping is no list of patterns
        return None
    return str(algo), group_size, exclude


def _common_group_size(config: dict[str, Any]) -> int | None:
    """`ModelOptFp4Config.common_group_size`: the one group size of the top level, the "quantization" block and
    the config groups (and their sub-dicts); None where it raises (none, or several)."""
    holders: list[Any] = [config, config.get("quantization")]
    for group in (config.get("config_groups") or {}).values():
        if isinstance(group, dict):
            holders += [group, *(sub for sub in group.values() if isinstance(sub, dict))]
    sizes = {
        h.get("group_size") for h in holders if isinstance(h, dict) and isinstance(h.get("group_size"), int)
    }
    return sizes.pop() if len(sizes) == 1 else None


def _expert_names(moe_layers: Sequence[int]) -> set[str]:
    """The FusedMoE prefixes of the MoE layers' experts, and each of their dotted parts."""
    prefixes = [f"{s}.{i}.{c}" for s in LAYER_STACKS for i in moe_layers for c in EXPERT_CONTAINERS]
    return set(prefixes) | {part for prefix in prefixes for part in prefix.split(".")}


def _may_name_experts(pattern: str, names: set[str]) -> bool:
    """Whether `ModelOptQuantConfig.is_layer_excluded` would take an MoE layer's FusedMoE prefix for this pattern:
    glob-style ("." literal, "*" any run), matched whole against the prefix or one of its dotted parts. (Its
    fused-module rule, for MLA's q_a_proj etc., never names "experts".)"""
    try:
        compiled = re.compile(pattern.replace(".", r"\.").replace("*", r".*"))
    except re.error:
        return True  # SGLang would fail on it: leave it to the layers
    return any(compiled.fullmatch(name) for name in names)
