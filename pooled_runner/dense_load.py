"""Expert weights delivered shard by shard by an engine's loader, into a pool of any weight format.

An engine's loader (SGLang's per-expert `weight_loader`) writes each checkpoint shard of an expert (`w1`, `w3`
into `w13 [2I, H]`, `w2` into `w2 [H, I]`) in its own call. Where the checkpoint's layout IS the expert's row
(the bf16 format; an fp8 checkpoint in square blocks, whose weights and `weight_scale_inv` blocks are the
fp8-b{block} format's `w13`, `w13_s`, `w2`, `w2_s`; an fp8 checkpoint per channel or per tensor in the fp8
format, a per-tensor scale written on every row of its shard by the engine's loader), the shards land in place. A quantized format's row of a
dense checkpoint (int4, fp8, NVFP4) can only be computed from the whole projection (a global scale, or groups
spanning gate and up): the shards go to a dense buffer of that expert, and the expert is quantized into its row
(`WeightFormat.quantize`) when its last shard arrives, then the buffer is freed. Host memory beyond the bank:
one dense expert per expert whose shards are in flight (checkpoints store an expert's shards together, so few
at a time; `peak_pending` says how many there were, and a warning says when they pass `PENDING_WARN_BYTES`).
The quantization runs on the host's CPU (15-166 ms per Qwen3-30B-sized expert on one core, fp8 to NVFP4;
torch spreads it over the host's cores): on the H200 (2026-12-05) the same ops on the GPU rounded a few fp8
and NVFP4 values the other way, and the rows must be the format's converter's, whichever machine loads them.

Nothing here imports SGLang.
"""

from __future__ import annotations

import logging
import threading

import torch

from pooled_runner.bank import check_expert_weights
from pooled_runner.moe import PooledMoE

# dense operand -> the checkpoint shards that write it (SGLang's shard ids)
DENSE_SHARDS: dict[str, tuple[str, ...]] = {"w13": ("w1", "w3"), "w2": ("w2",)}
ALL_SHARDS = frozenset(s for shards in DENSE_SHARDS.values() for s in shards)
# dense bytes in flight above which loading warns (once): the checkpoint keeps an expert's tensors far apart
PENDING_WARN_BYTES = 4 << 30

logger = logging.getLogger("pooled_runner")


def operand_shards(operand: str) -> tuple[str, ...]:
    """The shards that write an operand: `w13*` (weights, scales) gate and up, `w2*` down."""
    for prefix, shards in DENSE_SHARDS.items():
        if operand == prefix or operand.startswith(prefix + "_"):
            return shards
    raise ValueError(f"operand {operand!r} is not one of w13, w2 or their scales (w13_*, w2_*)")


class DenseLoader:
    """Shard-by-shard loading of one `PooledMoE` (between its `allocate()` and `finalize()`).

    Each layer's engine writes either the dense `("w13", "w2")` of an expert (quantized into its rows when the
    format is not bf16), or exactly the format's operands (in place: an fp8 checkpoint's weights and scales into
    its fp8-b{block} or fp8 format); `set_operands(layer, operands)` says which (default: dense). Use:
    `expert_views(layer, expert)[operand]` is where the engine writes a shard of `operand`, then
    `written(layer, expert, shard, operand)`; `missing(layer)` names what never arrived.
    """

    def __init__(self, moe: PooledMoE):
        if not moe.allocated:
            raise RuntimeError("DenseLoader needs an allocated PooledMoE (call allocate() first)")
        self.moe = moe
        self.row_operands = tuple(spec.name for spec in moe.operands)
        self._operands: dict[int, tuple[str, ...]] = {}  # layer -> what its engine writes (absent: dense)
        two_i, hidden = 2 * moe.intermediate_size, moe.hidden_size
        self.dense_shapes = {"w13": (two_i, hidden), "w2": (hidden, moe.intermediate_size)}
        itemsize = torch.empty((), dtype=moe.dtype).element_size()
        self.dense_bytes = sum(a * b for a, b in self.dense_shapes.values()) * itemsize  # one expert's
        self._shards: dict[tuple[int, int], set[tuple[str, str]]] = {}  # (layer, expert) -> (operand, shard)
        self._pending_host: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # dense buffers in flight
        self.peak_pending = 0
        self.num_quantized = 0
        self._warned = False
        # engines may load from several threads (DeepSeek's loader submits each expert tensor to a thread pool):
        # the bookkeeping is under this lock, the copies into the views and the quantization are not
        self._lock = threading.Lock()

    def set_operands(self, layer: int, operands: tuple[str, ...]) -> None:
        """What `layer`'s engine writes of each expert: the dense `("w13", "w2")` or the format's operands."""
        if set(operands) != set(self.row_operands) and set(operands) != set(DENSE_SHARDS):
            raise ValueError(
                f"layer {layer} writes operands {sorted(operands)}: neither the {self.moe.format.name} "
                f"format's {sorted(self.row_operands)} (in place) nor the dense {sorted(DENSE_SHARDS)} "
                "(quantized on load)"
            )
        with self._lock:
            known = self._operands.setdefault(layer, tuple(operands))
        if set(known) != set(operands):
            raise ValueError(f"layer {layer} writes operands {sorted(operands)}, and before {sorted(known)}")

    def operands(self, layer: int) -> tuple[str, ...]:
        return self._operands.get(layer, tuple(DENSE_SHARDS))

    def in_place(self, layer: int) -> bool:
        """Whether `layer`'s shards land in its rows as they are (no quantization on load)."""
        return set(self.operands(layer)) == set(self.row_operands)

    def _all_shards(self, layer: int) -> frozenset[tuple[str, str]]:
        return frozenset((op, s) for op in self.operands(layer) for s in operand_shards(op))

    def expert_views(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Writable `{operand: row}` of one expert: its bank rows in place (host, or the pool's device when
        every expert is resident), else dense host buffers `{"w13": [2I, H], "w2": [H, I]}` in the model's
        dtype that `written` quantizes into them once every shard is in."""
        if self.in_place(layer):
            return self.moe.expert_rows(layer, expert)
        key = (layer, expert)
        self.moe.expert_rows(layer, expert)  # range checks, with the layer's numbers
        with self._lock:
            if self._shards.get(key) == self._all_shards(layer):
                raise ValueError(
                    f"layer {layer} expert {expert}: a shard arrived after the expert was complete and "
                    f"quantized into the {self.moe.format.name} format; the checkpoint provides one of its "
                    "tensors twice"
                )
            buffers = self._pending_host.get(key)
            if buffers is None:
                buffers = self._new_buffers()
                self._pending_host[key] = buffers
                self.peak_pending = max(self.peak_pending, len(self._pending_host))
                self._warn_if_many_pending()
        return buffers

    def written(self, layer: int, expert: int, shard: str, operand: str | None = None) -> None:
        """Shard `shard` (w1, w3 or w2) of `operand` (default: the dense one it writes) of an expert is in its
        `expert_views` (called first); the expert's last shard quantizes it into its rows."""
        if shard not in ALL_SHARDS:
            raise ValueError(f"shard {shard!r} is not one of {sorted(ALL_SHARDS)}")
        if operand is None:
            operand = next(op for op, shards in DENSE_SHARDS.items() if shard in shards)
        all_shards = self._all_shards(layer)
        if (operand, shard) not in all_shards:
            raise ValueError(
                f"shard {shard!r} of operand {operand!r}: layer {layer} takes {sorted(all_shards)}"
            )
        key = (layer, expert)
        in_place = self.in_place(layer)
        with self._lock:
            if not in_place and key not in self._pending_host:
                raise RuntimeError(
                    f"written(layer={layer}, expert={expert}, {shard!r}) without expert_views() of that "
                    "expert first"
                )
            done = self._shards.setdefault(key, set())
            done.add((operand, shard))
            if in_place or done != all_shards:
                return
            buffers = self._pending_host.pop(key)  # this thread quantizes it: every shard's copy is in
        quantized = self.moe.format.quantize(buffers["w13"], buffers["w2"])
        check_expert_weights(self.moe.operands, quantized, f"layer {layer} expert {expert} quantized")
        for name, dst in self.moe.expert_rows(layer, expert).items():
            dst.copy_(quantized[name])
        with self._lock:
            self.num_quantized += 1

    def missing(self, layer: int, names: dict[str, str] | None = None) -> list[str]:
        """`"expert e shard"` (`"expert e shard operand"` for a scale; the operand as `names` calls it, e.g. the
        engine's parameter name, where given) for every shard of the layer's experts not written yet, in expert
        order."""
        names = names or {}
        return [
            f"expert {e} {shard}" + ("" if op in DENSE_SHARDS else f" {names.get(op, op)}")
            for e in range(self.moe.num_experts_per_layer[layer])
            for op in self.operands(layer)
            for shard in operand_shards(op)
            if (op, shard) not in self._shards.get((layer, e), ())
        ]

    @property
    def num_pending(self) -> int:
        """Experts with some shards written but not all (their dense buffers are held)."""
        return len(self._pending_host)

    def _new_buffers(self) -> dict[str, torch.Tensor]:
        # zeros, not empty: a shard the checkpoint lacks must not quantize garbage (it is reported anyway)
        return {op: torch.zeros(shape, dtype=self.moe.dtype) for op, shape in self.dense_shapes.items()}

    def _warn_if_many_pending(self) -> None:
        pending_bytes = len(self._pending_host) * self.dense_bytes
        if self._warned or pending_bytes <= PENDING_WARN_BYTES:
            return
        self._warned = True
        logger.warning(
            "pooled_runner: %d experts are waiting for their last tensor (%.1f GiB of dense buffers on the "
            "host, beyond the bank): the checkpoint stores an expert's gate, up and down tensors far apart. "
            "They are freed as each expert completes.",
            len(self._pending_host),
            pending_bytes / (1 << 30),
        )
