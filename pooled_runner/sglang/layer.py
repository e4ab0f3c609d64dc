"""`PooledFusedMoE`: SGLang's `FusedMoE`, with the pooled method for the layers the pool handles.

Installed with SGLang's `HookRegistry` class REPLACE (`install_layer_hook`), which also rewrites every stale
`from ... import FusedMoE` binding, so every model file builds this class. For each layer it decides, before
any weight exists, whether the pool handles it; if so it passes `quant_method=PooledMoEMethod(base)` to
`FusedMoE.__init__`, otherwise the layer is built exactly as SGLang would and keeps its experts on the device
(one warning for the whole model, from the runtime).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from sglang.srt.layers.moe import get_moe_runner_backend
from sglang.srt.layers.moe.fused_moe_triton import layer as fused_moe_layer
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE as _FusedMoE
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
from sglang.srt.runtime_context import get_flags, get_parallel

from pooled_runner.sglang.method import PooledMoEMethod
from pooled_runner.sglang.runtime import get_runtime

logger = logging.getLogger("pooled_runner")

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
_SIGNATURE = inspect.signature(_FusedMoE.__init__)


def native_quant_format(quant_config: Any) -> str:
    """The pool format a layer's quantized experts already are, or "": SGLang's `Fp8Config` of a checkpoint
    serialized in fp8 e4m3 with square blocks of a size the pool's fp8 format has (DeepSeek-V3, Qwen3-*-FP8), or
    with one scale per tensor (the per-channel "fp8" format)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from pooled_runner.formats.fp8 import checkpoint_format

    if not isinstance(quant_config, Fp8Config) or not quant_config.is_checkpoint_fp8_serialized:
        return ""
    if getattr(quant_config, "use_mxfp8", False) or getattr(quant_config, "is_fp4_experts", False):
        return ""
    return checkpoint_format(quant_config.weight_block_size)


def not_pooled_reason(args: dict[str, Any], weight_format: str = "bf16") -> str | None:
    """Why the pool cannot handle a layer built with these `FusedMoE.__init__` arguments (None: it can), its
    rows being in `weight_format`."""
    if get_flags().moe.in_speculative_scope:
        return "draft-model layer"
    if args.get("quant_method") is not None:
        return f"explicit quant method {type(args['quant_method']).__name__}"
    quant_config = _quant_config_of(args)
    if quant_config is not None:
        native = native_quant_format(quant_config)
        if not native:
            return f"quantization {quant_config.get_name()} (the pool takes unquantized experts, fp8 in blocks or per tensor)"
        if native != weight_format:
            return f"quantization {native} (serve it with --moe-expert-pool-weight-format {native})"
    if args.get("with_bias"):
        return "expert biases"
    if args.get("apply_router_weight_on_input"):
        return "router weight applied on the input"
    if args.get("activation", "silu") != "silu" or not args.get("is_gated", True):
        return f"activation {args.get('activation')!r} (the pool computes gated SiLU)"
    if args.get("num_fused_shared_experts", 0):
        return "fused shared experts (use --disable-shared-experts-fusion)"
    if args.get("use_weight_loader_fused"):
        return "fused expert weight loader"
    if args.get("gemm1_alpha") is not None or args.get("gemm1_clamp_limit") is not None:
        return "clamped/scaled gate activation"
    if (
        args.get("swiglu_limit") is not None
    ):  # DeepSeek-V2/V4 configs with swiglu_limit: a clamp before SiLU*up
        return "clamped SwiGLU (swiglu_limit)"
    backend = get_moe_runner_backend()
    if not (backend.is_auto() or backend.is_triton()):
        # the base method's loader follows the backend: flashinfer_cutlass puts up before gate, the TRT-LLM
        # backends swap w1/w3, pad I and fold the routed scaling into the top-k weights
        return f"--moe-runner-backend {backend.value} (the pool reads the triton layout: use --moe-runner-backend triton)"
    if get_parallel().moe_ep_size > 1:
        return "expert parallelism (--ep-size > 1)"
    return None


def _quant_config_of(args: dict[str, Any]) -> Any:
    """The layer's quant config, None for a layer its checkpoint leaves unquantized (`ignored_layers` /
    `modules_to_not_convert`: SGLang's `Fp8Config.get_quant_method` gives those the unquantized method)."""
    quant_config = args.get("quant_config")
    if quant_config is None or not hasattr(quant_config, "ignored_layers"):
        return quant_config
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    mapping = getattr(quant_config, "packed_modules_mapping", None) or {}
    if is_layer_skipped(args.get("prefix", ""), quant_config.ignored_layers, fused_mapping=mapping):
        return None
    return quant_config


def _base_method(quant_config: Any) -> Any:
    """The method that creates a pooled layer's one-expert placeholders (the loader's layout and tags):
    SGLang's fp8 method for an fp8 checkpoint (weights, and `weight_scale_inv` blocks or `weight_scale` per
    tensor), else the unquantized one."""
    if quant_config is not None:
        from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

        return Fp8MoEMethod(quant_config)
    backend = get_moe_runner_backend()
    return UnquantizedFusedMoEMethod(
        backend.is_triton_kernels(),
        backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed(),
        backend.is_deep_gemm() or backend.is_lora(),
    )


class PooledFusedMoE(_FusedMoE):
    """`FusedMoE` whose routed experts live in the shared pool when the pool handles the layer."""

    def __init__(self, *args: Any, **kwargs: Any):
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        runtime = get_runtime()
        if runtime is not None:
            reason = not_pooled_reason(values, runtime.config.weight_format)
            if reason is None:
                values["quant_method"] = PooledMoEMethod(_base_method(_quant_config_of(values)), runtime)
            else:
                runtime.note_not_pooled(values.get("prefix", "") or f"layer {values['layer_id']}", reason)
        super().__init__(**values)

    @property
    def is_pooled(self) -> bool:
        return isinstance(self.quant_method, PooledMoEMethod)


def install_layer_hook() -> None:
    """Replace `FusedMoE` by `PooledFusedMoE` everywhere (HookRegistry REPLACE); raise if it did not take."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pooled_runner.patches._check import require_hook_target

    if fused_moe_layer.FusedMoE is PooledFusedMoE:
        return
    require_hook_target(TARGET, "layer hook (PooledFusedMoE)")  # the SGLang version it was written for
    HookRegistry.register(TARGET, PooledFusedMoE, HookType.REPLACE)
    HookRegistry.apply_hooks()  # logs (does not raise) on failure: check below
    if fused_moe_layer.FusedMoE is not PooledFusedMoE:
        raise RuntimeError(f"pooled_runner: HookRegistry did not replace {TARGET}; see the log above")
    logger.info("pooled_runner: %s replaced by PooledFusedMoE", TARGET)
