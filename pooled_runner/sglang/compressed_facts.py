"""What the launcher can tell from an llm-compressor (compressed-tensors) `quantization_config` alone: the pool
format its MoE experts already are, or that only the layers can tell.

It follows SGLang's NVFP4 MoE schemes (`nvfp4-pack-quantized`: e2m1 weights in groups of 16 with a global
scale, with NVFP4 activations or none: "nvfp4") and `CompressedTensorsW8A8Fp8MoE`: fp8 e4m3 weights (8-bit
float, symmetric, static) with fp8 activations in a format that carries them, paired as SGLang pairs them:
weights per tensor with activations per tensor ("fp8"), per channel with dynamic per-token activations ("fp8"),
square blocks ("fp8-b{block}"). Each group is normalised as compressed-tensors normalises it (strategy
defaults, upper case, "128x128" blocks). The layers decide (`checkpoint_quant`), and the launcher does not
refuse, when config.json does not settle one format for every expert: several groups of different formats, or
an `ignore` entry that could name expert projections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# formats whose checkpoints carry activation quantization (SGLang's `is_activation_quantization_format`)
ACTIVATION_FORMATS = (
    "naive-quantized",
    "int-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "pack-quantized",
)
# expert projection names of the common MoE model files, to test `ignore` regexes against
EXPERT_NAMES = (
    "model.layers.1.mlp.experts.0.gate_proj",
    "model.layers.1.mlp.experts.0.down_proj",
    "model.layers.1.block_sparse_moe.experts.0.w1",
)


@dataclass(frozen=True)
class CompressedFacts:
    native_format: str  # "" when not one format the pool serves as it is (fp8, fp8-b{block}, nvfp4)
    per_layer: bool = False  # config.json does not settle the experts' format: the layers decide


def compressed_tensors_facts(quant: dict[str, Any]) -> CompressedFacts:
    """The experts' pool format from a compressed-tensors `quantization_config` dict (see the module docstring)."""
    groups = [
        g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")
    ]
    formats = {_group_format(g, g.get("format") or quant.get("format")) for g in groups}
    ignore = [str(entry) for entry in quant.get("ignore") or []]
    # no weight groups (a kv-cache scheme alone): the experts are not quantized, and the layers pool them as such
    if not groups or len(formats) > 1 or any(_may_name_experts(entry) for entry in ignore):
        return CompressedFacts("", per_layer=True)
    return CompressedFacts(formats.pop() if formats else "")


def _group_format(group: dict[str, Any], fmt: object) -> str:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

    from pooled_runner.formats.fp8 import block_format

    try:
        weights = QuantizationArgs.model_validate(group["weights"])
        inputs = group.get("input_activations")
        acts = QuantizationArgs.model_validate(inputs) if isinstance(inputs, dict) else None
    except ValueError:  # pydantic's ValidationError: SGLang's own parse refuses it too
        return ""
    if fmt == "nvfp4-pack-quantized" and _is_nvfp4(weights) and (acts is None or _is_nvfp4(acts)):
        return "nvfp4"  # NVFP4A16, or NVFP4 (W4A4; SGLang serves it weight-only below Blackwell, as the pool does)
    if fmt not in ACTIVATION_FORMATS or acts is None:
        return ""
    if not (_is_e4m3(weights) and _is_e4m3(acts) and weights.symmetric and not weights.dynamic):
        return ""
    if weights.strategy == QuantizationStrategy.TENSOR and acts.strategy == QuantizationStrategy.TENSOR:
        return "fp8"
    if weights.strategy == QuantizationStrategy.CHANNEL and acts.strategy == QuantizationStrategy.TOKEN:
        return "fp8" if acts.dynamic else ""
    if weights.strategy == QuantizationStrategy.BLOCK:
        return block_format(weights.block_structure)
    return ""


def _is_nvfp4(args: Any) -> bool:
    """e2m1 values in groups of 16 with a global scale (strategy tensor_group), symmetric: SGLang's
    `_is_fp4a16_nvfp4` / `_is_fp4a4_nvfp4`."""
    from compressed_tensors.quantization import QuantizationStrategy

    return (
        args.num_bits == 4
        and str(getattr(args.type, "value", args.type)) == "float"
        and args.strategy == QuantizationStrategy.TENSOR_GROUP
        and args.group_size == 16
        and bool(args.symmetric)
    )


def _is_e4m3(args: Any) -> bool:
    return args.num_bits == 8 and str(getattr(args.type, "value", args.type)) == "float"


def _may_name_experts(entry: str) -> bool:
    if entry.startswith("re:"):
        try:
            pattern = re.compile(entry[3:])
        except re.error:
            return True
        return any(pattern.match(name) for name in EXPERT_NAMES)
    return "expert" in entry.lower()
