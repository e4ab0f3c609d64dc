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
from sglang.srt.runtime_context import get_flags, get_parallel

from pooled_runner.sglang.checkpoint_quant import base_method, layer_quant, native_quant_format
from pooled_runner.sglang.method import PooledMoEMethod
from pooled_runner.sglang.runtime import get_runtime

logger = logging.getLogger("pooled_runner")

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
_SIGNATURE = inspect.signature(_FusedMoE.__init__)


def not_pooled_reason(args: dict[str, Any], weight_format: str = "bf16") -> str | None:
    """Why the pool cannot handle a layer built with these `FusedMoE.__init__` arguments (None: it can), its
    rows being in `weight_format`."""
    return _decide(args, weight_format)[0]


def _decide(args: dict[str, Any], weight_format: str) -> tuple[str | None, tuple[Any, Any]]:
    """`(not_pooled_reason, layer_quant(args))`, the layer's quantization looked up once."""
    if get_flags().moe.in_speculative_scope:
        return "draft-model layer", (None, None)
    if args.get("quant_method") is not None:
        return f"explicit quant method {type(args['quant_method']).__name__}", (None, None)
    try:
        quant = layer_quant(args)
    # SGLang's scheme choice refuses some configurations (ValueError, NotImplementedError) and asserts or trips
    # on others; it raises again, in its own words, when it builds the layer itself
    except (ValueError, NotImplementedError, AssertionError, AttributeError) as exc:
        return f"quantization scheme refused by SGLang: {exc}", (None, None)
    return _reason(args, weight_format, *quant), quant


def _reason(args: dict[str, Any], weight_format: str, quant_config: Any, scheme: Any) -> str | None:
    """`not_pooled_reason` given the layer's `(quant_config, scheme)`."""
    if quant_config is None and args.get("quant_config") is not None and weight_format != "bf16":
        # a layer the checkpoint's ignore list leaves in bf16: SGLang serves it so, and the pool would quantize it
        return (
            f"experts the checkpoint leaves unquantized (its ignore list): the {weight_format} pool would "
            "quantize them"
        )
    if quant_config is not None:
        native = native_quant_format(quant_config, scheme)
        if not native:
            return (
                f"quantization {quant_config.get_name()} (the pool takes unquantized experts, fp8 ones in "
                "blocks, per channel or per tensor (ModelOpt FP8 too), and NVFP4 ones (ModelOpt, llm-compressor))"
            )
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


class PooledFusedMoE(_FusedMoE):
    """`FusedMoE` whose routed experts live in the shared pool when the pool handles the layer."""

    def __init__(self, *args: Any, **kwargs: Any):
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        runtime = get_runtime()
        reason = None
        if runtime is not None:
            reason, quant = _decide(values, runtime.config.weight_format)
            if reason is None:
                values["quant_method"] = PooledMoEMethod(base_method(*quant), runtime)
            else:
                runtime.note_not_pooled(values.get("prefix", "") or f"layer {values['layer_id']}", reason)
        try:
            super().__init__(**values)
        except ValueError as exc:
            if reason is None or native_quant_format(values.get("quant_config")) != "nvfp4":
                raise
            # SGLang's own NVFP4 experts need Blackwell or the marlin runner; the pool runs triton
            raise ValueError(
                f"{values.get('prefix') or 'a MoE layer'}: not pooled ({reason}), and SGLang's own NVFP4 experts "
                f"refused it: {exc}. Serve the checkpoint's NVFP4 experts from the pool (--moe-expert-pool-weight-"
                "format nvfp4, with settings the pool takes), or pass --no-moe-expert-pool"
            ) from exc

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
