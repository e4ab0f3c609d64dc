"""`PooledMoEMethod`: a `FusedMoEMethodBase` that runs a `FusedMoE` layer's experts out of the shared pool.

It wraps the layer's own quant method the way SGLang's paged experts does: the base method creates the
layer's parameters (with ONE expert: a placeholder that gives the loader its layout and tags), every expert
parameter's `weight_loader` is replaced by one that runs the layer's native per-expert loader
(`FusedMoE._weight_loader_impl`: TP sharding, w1/w3 placement) on a one-row view of the expert's dense rows
(`pooled_runner.dense_load`): its storage in the pool's bank where the checkpoint's layout is the format's (bf16;
an fp8-block checkpoint's weights and `weight_scale_inv` blocks into fp8-b{block}; an fp8 checkpoint with one
`weight_scale` per tensor into fp8, each scale written on every row of its shard; a ModelOpt NVFP4 checkpoint's
packed weights, `weight_scale` and `weight_scale_2` into nvfp4, gate and up sharing one global scale after
loading; an llm-compressor NVFP4 checkpoint's the same, its `weight_global_scale` as its reciprocal), so bank
rows have exactly the
layout the device weights would have, or a dense buffer that a quantized format (`--moe-expert-pool-weight-format`
int4/fp8/NVFP4) quantizes into the bank when the expert's last shard is in. `apply` runs the pooled forward
(`PooledMoE.forward`). Only `pooled_runner.sglang` imports SGLang.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from pooled_runner.dense_load import operand_shards
from pooled_runner.sglang.runtime import PoolRuntime

logger = logging.getLogger("pooled_runner")

# Our operand name -> the FusedMoE parameter holding it (its shards: dense_load.operand_shards): the weights,
# and an fp8-block checkpoint's `weight_scale_inv` blocks (the fp8-b{block} format's scales: w = q * s)
PARAMS = {
    "w13": "w13_weight",
    "w13_s": "w13_weight_scale_inv",
    "w2": "w2_weight",
    "w2_s": "w2_weight_scale_inv",
}
# Scales named `weight_scale` (SGLang's fp8 method per tensor; compressed-tensors per tensor, channel or block):
# one per tensor is `w13_weight_scale` [E, 2] (gate, up) and `w2_weight_scale` [E], which the "fp8" format's
# per-channel scales (w13_s [2I], w2_s [H]) hold on every row of each shard, exactly; per channel [E, N, 1] and
# per block [E, N/b, K/b] are the format's own scales
SCALES = {"w13_s": "w13_weight_scale", "w2_s": "w2_weight_scale"}
# a ModelOpt NVFP4 checkpoint's global scales (`weight_scale_2`, one per projection: w13 [E, 2] gate and up,
# w2 [E]), the nvfp4 format's `w13_g` [1] and `w2_g` [1]; gate and up share one when the layer is loaded
GLOBALS = {"w13_g": "w13_weight_scale_2", "w2_g": "w2_weight_scale_2"}
# compressed-tensors' NVFP4 (llm-compressor): the packed weights, and global scales that divide (w = e2m1 * s /
# global_scale): the format's w_g is their reciprocal
PACKED = {"w13": "w13_weight_packed", "w2": "w2_weight_packed"}
RECIPROCAL_GLOBALS = {"w13_g": "w13_weight_global_scale", "w2_g": "w2_weight_global_scale"}
# input scales of static-activation checkpoints (fp8's `input_scale`, NVFP4 W4A4's `input_global_scale`): the
# pool computes with activations in the model's dtype (W8A16, W4A16), so they are read, checked and not used
INPUT_SCALES = ("w13_input_scale", "w2_input_scale", "w13_input_global_scale", "w2_input_global_scale")


def method_scales_routed_output(layer: Any) -> bool:
    """Whether SGLang 0.5.23's own unquantized method multiplies a layer's routed output by
    `routed_scaling_factor`: its CUDA Triton runner does (`fused_experts(routed_scaling_factor=...)`), unless
    the factor is folded into the top-k weights; without CUDA it does not, the model does it after the experts
    (`deepseek_v2.py`, `glm4_moe.py`: `if not _is_cuda ...: final_hidden_states *= routed_scaling_factor`)."""
    from sglang.srt.utils import is_cuda

    return is_cuda() and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False)


class PooledMoEMethod(FusedMoEMethodBase, torch.nn.Module):
    """Experts of one `FusedMoE` layer served from the pool (an `nn.Module`, like the methods it wraps).

    Args:
      base_method: the layer's own method (SGLang's unquantized one, or its fp8 one for an fp8 checkpoint in
        blocks or per tensor); it creates the placeholder parameters and the runner, and decides the loader's
        layout.
      runtime: the process's pool runtime (`pooled_runner.sglang.runtime`).
    """

    def __init__(self, base_method: FusedMoEMethodBase, runtime: PoolRuntime):
        torch.nn.Module.__init__(self)
        self.base_method = base_method
        self.runtime = runtime
        self.index = -1  # pooled-layer index, set in create_weights
        self.num_experts = 0
        self.layer_name = ""
        self.routed_scaling_factor = 1.0
        self.operands: tuple[str, ...] = ()  # the PARAMS operands the layer's placeholders have
        # operand -> the layer's parameter (SCALES where the scales are named `weight_scale`)
        self.params = dict(PARAMS)
        self.tensor_scales = False  # an fp8 checkpoint with one scale per tensor (widened on load)
        self.reciprocal_globals = False  # NVFP4 global scales that divide (compressed-tensors')
        # an NVFP4 checkpoint's gate and up global scales per expert [E, 2] (nan: not loaded), joined into the
        # rows' one w13_g after loading (`_share_gate_up_globals`)
        self.gate_up_globals: torch.Tensor | None = None

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        self.num_experts = num_experts
        self.layer_name = getattr(layer, "layer_name", "") or f"layer {getattr(layer, 'layer_id', '?')}"
        self.index = self.runtime.register_layer(
            self.layer_name,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            int(layer.top_k),
            params_dtype,
        )
        # One placeholder expert on the device: the loader's layout and tags come from it.
        self.base_method.create_weights(
            layer=layer,
            num_experts=1,
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            params_dtype=params_dtype,
            **extra,
        )
        layer.weight_load_method = self.base_method
        layer._derived_weight_cache_error = (
            "Online weight updates are not supported for pooled MoE layers: pool rows would keep old weights."
        )
        if hasattr(layer, SCALES["w13_s"]) and not hasattr(layer, PARAMS["w13_s"]):
            self.params.update(SCALES)
            self.tensor_scales = tuple(getattr(layer, SCALES["w13_s"]).shape[1:]) == (2,)
        if hasattr(layer, PACKED["w13"]):
            self.params.update(PACKED)
        self.reciprocal_globals = hasattr(layer, RECIPROCAL_GLOBALS["w13_g"])
        if hasattr(layer, GLOBALS["w13_g"]) or self.reciprocal_globals:
            self.params.update(RECIPROCAL_GLOBALS if self.reciprocal_globals else GLOBALS)
            # fp32 on the host whatever the default dtype and device (SGLang builds the model under the model's
            # dtype, e.g. bf16, and its device)
            self.gate_up_globals = torch.full((num_experts, 2), math.nan, dtype=torch.float32, device="cpu")
        self.operands = tuple(op for op, name in self.params.items() if hasattr(layer, name))
        self._check_placeholders(layer, hidden_size, intermediate_size_per_partition, params_dtype)
        for operand in self.operands:
            param = getattr(layer, self.params[operand])
            if self.tensor_scales and operand in SCALES:
                param.weight_loader = self._make_tensor_scale_loader(operand)
            elif operand in GLOBALS:  # GLOBALS and RECIPROCAL_GLOBALS name the same operands
                param.weight_loader = self._make_global_loader(operand)
            else:
                param.weight_loader = self._make_bank_loader(layer, operand)
        for name in INPUT_SCALES:
            if isinstance(getattr(layer, name, None), torch.nn.Parameter):
                getattr(layer, name).weight_loader = self._make_input_scale_check(name)

    def _check_placeholders(self, layer: Any, hidden: int, inter: int, dtype: torch.dtype) -> None:
        """The base method's one-expert placeholders must have the layout the bank rows are written in: the
        pool format's rows (an fp8-block checkpoint in place; per-tensor fp8 scales [2] and [] widened to fp8's
        per-channel ones on load), or the dense `w13 [2I, H]`, `w2 [H, I]` in the model's dtype (quantized on
        load). A layout the pool does not know is refused here, with both."""
        moe = self.runtime.require_moe()
        row_specs = {spec.name: (spec.row_shape, spec.dtype) for spec in moe.operands}
        dense_specs = {"w13": ((2 * inter, hidden), dtype), "w2": ((hidden, inter), dtype)}
        got = {
            op: (tuple(getattr(layer, self.params[op]).shape[1:]), getattr(layer, self.params[op]).dtype)
            for op in self.operands
        }
        if moe.format.name == "fp8" and self.params["w13_s"] == SCALES["w13_s"]:
            # fp8's per-channel scale rows [N] take one scale per shard (w13 [2], w2 [], widened on load) or
            # per-channel scales [N, 1] (the loader writes the rows seen with that trailing 1)
            per_tensor = {"w13_s": (2,), "w2_s": ()} if self.tensor_scales else {}
            for op in SCALES:
                shape, dt = row_specs[op]
                if got.get(op) in ((per_tensor.get(op), dt), ((*shape, 1), dt)):
                    got[op] = row_specs[op]
        if moe.format.name == "nvfp4" and self.gate_up_globals is not None:
            # nvfp4's global rows [1] take a global per shard (w13 [2] gate and up, w2 [])
            for op, shape in (("w13_g", (2,)), ("w2_g", ())):
                if got.get(op) == (shape, torch.float32):
                    got[op] = row_specs[op]
        if got != row_specs and got != dense_specs:
            raise ValueError(
                f"{self.layer_name}: the {type(self.base_method).__name__} placeholders {got} are neither the "
                f"{moe.format.name} rows {row_specs} nor dense experts {dense_specs}; serve this model with "
                "--no-moe-expert-pool"
            )

    def _weight_loader(self, operand: str, load: Any) -> Any:
        """A `weight_loader` with SGLang's signature (`param, loaded_weight, weight_name, shard_id`, the expert
        positional or as `expert_id`) that checks the expert and the shard, then runs
        `load(param, loaded_weight, weight_name, shard_id, expert_id)`."""

        def weight_loader(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            *rest: Any,
            **kwargs: Any,
        ) -> None:
            expert_id = self._expert_id(weight_name, shard_id, operand, rest, kwargs)
            load(param, loaded_weight, weight_name, shard_id, expert_id)

        return weight_loader

    def _expert_id(
        self, weight_name: str, shard_id: str, operand: str, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> int:
        """The expert a loader call writes (SGLang passes it positionally or as `expert_id`), checked: one expert
        at a time, in range, and a shard the operand takes."""
        expert_id = kwargs.get("expert_id", rest[0] if rest else None)
        if expert_id is None:
            raise ValueError(
                f"{weight_name}: a stacked tensor of all experts (no expert_id) is not supported by the "
                "expert pool; pooled layers load one expert at a time: use a checkpoint with per-expert "
                "tensors, or serve without the pool (--no-moe-expert-pool)"
            )
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(
                f"{weight_name}: expert id {expert_id} out of range [0, {self.num_experts}) of {self.layer_name}"
            )
        if shard_id not in operand_shards(operand):
            raise ValueError(
                f"{weight_name}: shard {shard_id!r} for the {self.params.get(operand, operand)} parameter of "
                f"{self.layer_name}, which takes shards {list(operand_shards(operand))}"
            )
        return int(expert_id)

    def _make_bank_loader(self, layer: Any, operand: str) -> Any:
        """The loader of an operand whose rows have the parameter's layout: SGLang's own per-expert loader
        (`FusedMoE._weight_loader_impl`: TP sharding, w1/w3 placement) run on the expert's bank view."""

        def load(
            param: Any, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int
        ) -> None:
            storage = self._expert_view(expert_id, operand)
            # The native loader writes into expert 0 of a one-row view of the dense row, so the row gets the
            # layout (and the TP shard) the device weight would have; per-channel scales [N] are seen as the
            # parameter's [N, 1]. The view carries the parameter's tags.
            row = torch.nn.Parameter(storage.view(param.shape[1:]).unsqueeze(0), requires_grad=False)
            row.__dict__.update(param.__dict__)
            try:
                layer._weight_loader_impl(
                    param=row,
                    loaded_weight=loaded_weight,
                    weight_name=weight_name,
                    shard_id=shard_id,
                    expert_id=0,
                )
            except (RuntimeError, ValueError, AssertionError) as exc:
                raise ValueError(
                    f"{weight_name} (expert {expert_id}, shard {shard_id}, shape {tuple(loaded_weight.shape)}) "
                    f"does not fit {operand} rows of shape {tuple(storage.shape)}: {exc}"
                ) from exc
            self.runtime.ensure_loader().written(self.index, expert_id, shard_id, operand)

        return self._weight_loader(operand, load)

    def _expert_view(self, expert_id: int, operand: str) -> torch.Tensor:
        """Where a loader writes `operand` of an expert (`DenseLoader.expert_views`: its bank row in place, or a
        dense buffer quantized once the expert is complete)."""
        return self._expert_views(expert_id)[operand]

    def _expert_views(self, expert_id: int) -> dict[str, torch.Tensor]:
        loader = self.runtime.ensure_loader()
        loader.set_operands(self.index, self.operands)
        return loader.expert_views(self.index, expert_id)

    def _make_tensor_scale_loader(self, operand: str) -> Any:
        """The loader of a per-tensor fp8 scale (`w13_s` per shard, `w2_s`): the one value goes on every row of
        its shard in the bank's per-channel scales (gate rows [0, I), up rows [I, 2I) of this rank's w13)."""

        def load(
            param: Any, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int
        ) -> None:
            value = _one_scale(weight_name, loaded_weight, expert_id)
            storage = self._expert_view(expert_id, operand)  # [2I] or [H]
            if operand == "w13_s":
                half = storage.shape[0] // 2
                storage = storage[:half] if shard_id == "w1" else storage[half:]
            storage.fill_(value)
            self.runtime.ensure_loader().written(self.index, expert_id, shard_id, operand)

        return self._weight_loader(operand, load)

    def _make_global_loader(self, operand: str) -> Any:
        """The loader of an NVFP4 global scale (ModelOpt's `weight_scale_2`, or the reciprocal of compressed-tensors'
        `weight_global_scale`; one value per shard): w2's goes into its row; gate's and up's are kept until the
        layer is loaded, when `_share_gate_up_globals` joins them."""

        def load(
            param: Any, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int
        ) -> None:
            value = _one_scale(weight_name, loaded_weight, expert_id)
            if self.reciprocal_globals:  # compressed-tensors' global_scale divides: w = e2m1 * s / value
                value = float(
                    torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32)
                )
            if operand == "w2_g":
                self._expert_view(expert_id, operand).fill_(value)
            else:
                assert self.gate_up_globals is not None
                self.gate_up_globals[expert_id, 0 if shard_id == "w1" else 1] = value
            self.runtime.ensure_loader().written(self.index, expert_id, shard_id, operand)

        return self._weight_loader(operand, load)

    def _share_gate_up_globals(self) -> None:
        """Each expert's gate and up global scales become its row's one `w13_g`, the larger of the two; the other
        half's block scales are rescaled onto it (`formats.nvfp4.share_gate_up_global`: exact where they are
        equal, else rounded to e4m3, as TensorRT-LLM's fused MoE folds them). Logged where any differed."""
        from pooled_runner.formats.nvfp4 import share_gate_up_global

        assert self.gate_up_globals is not None
        num_rescaled, worst = 0, 0.0
        for expert_id, (gate, up) in enumerate(self.gate_up_globals.tolist()):
            rows = self._expert_views(expert_id)
            g, change = share_gate_up_global(rows["w13_s"], gate, up)
            rows["w13_g"].fill_(g)
            num_rescaled += gate != up
            worst = max(worst, change)
        if num_rescaled:
            # a rescaled block scale below e4m3's normal range (2^-6) keeps fewer bits, or none: say so louder
            (logger.warning if worst > 1 / 16 else logger.info)(
                "pooled_runner: %s: %d of %d experts have different gate and up global scales (%s); the smaller "
                "one's block scales were rescaled onto the larger, rounded to e4m3 (largest relative change of a "
                "block's scale: %.3g)",
                self.layer_name,
                num_rescaled,
                self.num_experts,
                self.params["w13_g"],
                worst,
            )

    def _make_input_scale_check(self, name: str) -> Any:
        """The loader of a static-activation checkpoint's input scale (`INPUT_SCALES`): checked (one value per
        shard; SGLang takes the largest, so an unused 0 is allowed) and dropped, since the pooled experts take
        activations in the model's dtype (W8A16, W4A16)."""

        def load(
            param: Any, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int
        ) -> None:
            if loaded_weight.numel() != 1:  # its value is not checked: some checkpoints leave 0 where unused
                raise ValueError(
                    f"{weight_name} (expert {expert_id}): an input scale is one value, got shape "
                    f"{tuple(loaded_weight.shape)}"
                )

        return self._weight_loader("w13" if name.startswith("w13") else "w2", load)

    def create_moe_runner(self, layer: Any, moe_runner_config: Any) -> None:
        self.base_method.create_moe_runner(layer, moe_runner_config)
        self.runner = self.base_method.runner
        self.routed_scaling_factor = (
            (moe_runner_config.routed_scaling_factor or 1.0) if method_scales_routed_output(layer) else 1.0
        )

    def get_moe_runner_backend(self, layer: Any) -> Any:
        return self.base_method.get_moe_runner_backend(layer)

    def process_weights_after_loading(self, layer: Any) -> None:
        loader = self.runtime.ensure_loader()
        loader.set_operands(self.index, self.operands)
        missing = loader.missing(self.index, self.params)  # scales by the layer's parameter names
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"{self.layer_name}: the checkpoint did not provide {shown}")
        if self.gate_up_globals is not None:
            self._share_gate_up_globals()
        # The placeholders are no longer needed: the experts live in the bank and the pool rows.
        for operand in self.operands:
            param = getattr(layer, self.params[operand])
            param.data = param.data.new_empty((0, *param.shape[1:]))
        self.runtime.layer_loaded(self.index)

    def apply(self, layer: Any, dispatch_output: Any) -> Any:  # type: ignore[override]
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        topk_output = dispatch_output.topk_output
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise ValueError(
                f"{self.layer_name}: the pooled forward needs standard top-k output, got "
                f"{type(topk_output).__name__}: use the default --moe-a2a-backend (none) and "
                "--moe-runner-backend triton, or --no-moe-expert-pool"
            )
        hidden = dispatch_output.hidden_states  # [T, H]
        moe = self.runtime.require_moe()
        # the router's logits [T, E] for a planner policy that reads them (ServeConfig.router_scores)
        scores = topk_output.router_logits if self.runtime.serve.router_scores else None
        out = moe.forward(
            self.index, hidden, topk_output.topk_ids, topk_output.topk_weights, router_scores=scores
        )  # [T, H]
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        self.runtime.after_forward(self.index, hidden.shape[0])
        return StandardCombineInput(hidden_states=out)


def _one_scale(weight_name: str, loaded_weight: torch.Tensor, expert_id: int) -> float:
    """The value of a per-tensor scale from a checkpoint: one positive finite number (shape [] or [1])."""
    if loaded_weight.numel() != 1:
        raise ValueError(
            f"{weight_name} (expert {expert_id}): a per-tensor scale is one value, got shape "
            f"{tuple(loaded_weight.shape)}; per-channel or grouped scales are not this checkpoint format's"
        )
    value = float(loaded_weight.reshape(()).float())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{weight_name} (expert {expert_id}): scale {value} is not a positive finite number")
    return value
