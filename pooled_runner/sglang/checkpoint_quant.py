"""A MoE layer's quantized checkpoint, seen from the pool: which pool format its experts already are, and which
SGLang method lays out the one-expert placeholders its loader writes through (`PooledMoEMethod`).

Served as they are (the e4m3 weights are the rows; W8A16, activations stay in the model's dtype):
- SGLang's `Fp8Config` of an fp8-serialized checkpoint: square blocks (`weight_block_size`, scales
  `weight_scale_inv`) are fp8-b{block}; one `weight_scale` per tensor is fp8 (each scale on every row of the
  per-channel scales);
- `CompressedTensorsConfig` whose MoE scheme is `CompressedTensorsW8A8Fp8MoE` (llm-compressor's FP8 /
  FP8-dynamic / FP8-block checkpoints): strategy tensor (`weight_scale` [1]) or channel ([N, 1]) is fp8, block
  is fp8-b{block} (`weight_scale` per tile); or an NVFP4 one (`CompressedTensorsW4A16Nvfp4MoE`, which SGLang
  also picks for W4A4 checkpoints below Blackwell, or `CompressedTensorsW4A4Nvfp4MoE`; llm-compressor's NVFP4
  and NVFP4A16): nvfp4, `weight_packed` and `weight_scale` as they are, `weight_global_scale` the reciprocal
  of the format's global (w = e2m1 * s / global_scale);
- NVIDIA ModelOpt's `ModelOptFp4Config` of an NVFP4 checkpoint (quant_algo NVFP4 or W4A16_NVFP4, groups of 16):
  nvfp4, its packed e2m1 `weight`, e4m3 `weight_scale` per 16 values and fp32 `weight_scale_2` are the format's
  `w`, `w_s` and `w_g` (W4A16: activations stay in the model's dtype, input scales are checked and not used).
  SGLang's own NVFP4 method refuses to be built on Hopper with the triton runner, so `Nvfp4Placeholders` lays
  out the one-expert placeholders in its layout;
- ModelOpt's `ModelOptFp8Config` (quant_algo FP8): fp8, as an fp8 checkpoint per tensor (its tensors are the
  same: e4m3 `weight`, `weight_scale` and `input_scale` per tensor).
Anything else quantized is not pooled (the layer keeps SGLang's own method).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.moe import get_moe_runner_backend
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

from pooled_runner.formats.fp8 import block_format, checkpoint_format


class _FusedMoEName:
    """Matches a compressed-tensors target "FusedMoE" (its class name is what the config compares)."""


_FusedMoEName.__name__ = "FusedMoE"


def layer_quant(args: dict[str, Any]) -> tuple[Any, Any]:
    """`(quant_config, scheme)` of a layer built with these `FusedMoE.__init__` arguments: `(None, None)` for a
    layer its checkpoint leaves unquantized (Fp8Config's `ignored_layers`, compressed-tensors' `ignore`), and
    for compressed-tensors the MoE scheme SGLang would give the layer (else None)."""
    quant_config = args.get("quant_config")
    if quant_config is None:
        return None, None
    prefix = args.get("prefix", "") or ""
    if hasattr(quant_config, "ignored_layers"):
        from sglang.srt.layers.quantization.utils import is_layer_skipped

        mapping = getattr(quant_config, "packed_modules_mapping", None) or {}
        if is_layer_skipped(prefix, quant_config.ignored_layers, fused_mapping=mapping):
            return None, None
    if _is_modelopt(quant_config) and quant_config.is_layer_excluded(prefix):  # its exclude_modules
        return None, None
    if not _is_compressed_tensors(quant_config):
        return quant_config, None
    if quant_config._is_mxfp4_moe(layer_name=prefix):  # SGLang gives these its Mxfp4MoEMethod, no scheme
        return quant_config, None
    # SGLang decides the scheme with the layer built (`get_quant_method(layer, prefix)`); the config's targets
    # read only its class name, so a stand-in of that name takes its place before the layer exists
    scheme = quant_config.get_moe_scheme(layer=_FusedMoEName(), layer_name=prefix)
    return (quant_config, scheme) if scheme is not None else (None, None)


def native_quant_format(quant_config: Any, scheme: Any = None) -> str:
    """The pool format a layer's quantized experts already are (see the module docstring), or ""."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if isinstance(quant_config, Fp8Config):
        if hasattr(quant_config, "nvfp4_config"):  # HybridFp8NvFp4Config: fp8 layers, NVFP4 experts
            return ""
        if not quant_config.is_checkpoint_fp8_serialized:
            return ""
        if getattr(quant_config, "use_mxfp8", False) or getattr(quant_config, "is_fp4_experts", False):
            return ""
        return checkpoint_format(quant_config.weight_block_size)
    if _is_compressed_tensors(quant_config) and scheme is not None:
        return _compressed_tensors_format(scheme)
    if _is_modelopt_nvfp4(quant_config):
        return "nvfp4"
    if _is_modelopt_fp8(quant_config):
        return "fp8"
    return ""


def base_method(quant_config: Any, scheme: Any = None) -> Any:
    """The method that creates a pooled layer's one-expert placeholders (the loader's layout and tags): SGLang's
    fp8 method for an fp8 checkpoint, the compressed-tensors method with the layer's scheme, else the
    unquantized one."""
    if quant_config is None:
        return UnquantizedFusedMoEMethod(*_unquantized_args())
    if _is_modelopt_nvfp4(quant_config):
        return Nvfp4Placeholders(quant_config.group_size)
    if _is_modelopt_fp8(quant_config):
        # the same tensors as an fp8 checkpoint per tensor with static activations (weight_scale [2] and [],
        # input_scale per shard): SGLang's fp8 method lays them out without ModelOpt's read-only loader property
        from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

        return Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static"))
    if _is_compressed_tensors(quant_config):
        return _scheme_method(quant_config, scheme)
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    return Fp8MoEMethod(quant_config)


class Nvfp4Placeholders(UnquantizedFusedMoEMethod):
    """One-expert placeholders in SGLang's ModelOpt NVFP4 layout (`ModelOptNvFp4FusedMoEMethod.create_weights`,
    which cannot be built on Hopper with the triton runner): `w13_weight [1, 2I, H/2]` and `w2_weight
    [1, H, I/2]` uint8, block scales `w13_weight_scale [1, 2I, H/16]` and `w2_weight_scale [1, H, I/16]` e4m3
    (tagged BLOCK: SGLang's loader shards them as the weights), globals `w13_weight_scale_2 [1, 2]` (gate, up)
    and `w2_weight_scale_2 [1]`, input scales `w13_input_scale [1, 2]` and `w2_input_scale [1]` fp32. The rest
    (the runner) is the unquantized method's; the pooled forward does not use it."""

    def __init__(self, group_size: int):
        super().__init__(*_unquantized_args())
        self.group_size = group_size

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported
        from sglang.srt.utils import set_weight_attrs

        two_i, h, i, g = (
            2 * intermediate_size_per_partition,
            hidden_size,
            intermediate_size_per_partition,
            self.group_size,
        )
        block = FusedMoeWeightScaleSupported.BLOCK.value
        shapes = {
            "w13_weight": ((num_experts, two_i, h // 2), torch.uint8, None),
            "w2_weight": ((num_experts, h, i // 2), torch.uint8, None),
            "w13_weight_scale": ((num_experts, two_i, h // g), torch.float8_e4m3fn, block),
            "w2_weight_scale": ((num_experts, h, i // g), torch.float8_e4m3fn, block),
            "w13_weight_scale_2": ((num_experts, 2), torch.float32, None),
            "w2_weight_scale_2": ((num_experts,), torch.float32, None),
            "w13_input_scale": ((num_experts, 2), torch.float32, None),
            "w2_input_scale": ((num_experts,), torch.float32, None),
        }
        for name, (shape, dtype, quant_method) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(
                param, {**extra_weight_attrs, **({"quant_method": quant_method} if quant_method else {})}
            )


def _unquantized_args() -> tuple[bool, bool, bool]:
    backend = get_moe_runner_backend()
    return (
        backend.is_triton_kernels(),
        backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed(),
        backend.is_deep_gemm() or backend.is_lora(),
    )


def _is_modelopt(quant_config: Any) -> bool:
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptQuantConfig

    return isinstance(quant_config, ModelOptQuantConfig)


def _is_modelopt_nvfp4(quant_config: Any) -> bool:
    """A pre-quantized ModelOpt NVFP4 checkpoint in the pool's layout: serialized e2m1 with groups of 16 and no
    AWQ pre-quant scales (the nvfp4_online subclass quantizes a bf16/fp8 checkpoint on load: not served)."""
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    return (
        type(quant_config) is ModelOptFp4Config
        and bool(quant_config.is_checkpoint_nvfp4_serialized)
        and not quant_config.is_awq
        and quant_config.group_size == 16
    )


def _is_modelopt_fp8(quant_config: Any) -> bool:
    """A ModelOpt FP8 checkpoint: e4m3 weights with one `weight_scale` and one `input_scale` per tensor."""
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config

    return type(quant_config) is ModelOptFp8Config and bool(quant_config.is_checkpoint_fp8_serialized)


def _is_compressed_tensors(quant_config: Any) -> bool:
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    return isinstance(quant_config, CompressedTensorsConfig)


def _compressed_tensors_format(scheme: Any) -> str:
    from compressed_tensors.quantization import QuantizationStrategy
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW4A4Nvfp4MoE,
        CompressedTensorsW4A16Nvfp4MoE,
        CompressedTensorsW8A8Fp8MoE,
    )

    if type(scheme) in (CompressedTensorsW4A16Nvfp4MoE, CompressedTensorsW4A4Nvfp4MoE):
        return "nvfp4"  # SGLang picks them for groups of 16 only
    if type(scheme) is not CompressedTensorsW8A8Fp8MoE:
        return ""
    weights = scheme.weight_quant
    if weights.num_bits != 8 or not weights.symmetric or weights.dynamic:
        return ""
    if weights.strategy in (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL):
        return "fp8"
    if weights.strategy == QuantizationStrategy.BLOCK:
        return block_format(scheme.weight_block_size)
    return ""


def _scheme_method(quant_config: Any, scheme: Any) -> Any:
    """SGLang's `CompressedTensorsFusedMoEMethod`, which reads the layer's scheme from `layer.scheme` (set by
    `get_quant_method` for a layer SGLang builds itself): set here before the placeholders are made."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsFusedMoEMethod,
    )

    class SchemeMethod(CompressedTensorsFusedMoEMethod):
        def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> None:
            layer.scheme = scheme
            super().create_weights(layer, *args, **kwargs)
            # the pool's rows are [gate; up] whatever runner the scheme was made for (SGLang's w4a4 NVFP4
            # scheme loads up first for CUTLASS; its loader reads this flag off the method)
            self.load_up_proj_weight_first = False

    return SchemeMethod(quant_config)
