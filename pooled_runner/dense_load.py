"""Dense expert weights delivered shard by shard, into a pool of any weight format.

An engine's loader (SGLang's per-expert `weight_loader`) writes each checkpoint shard of an expert (`w1`, `w3`
into `w13 [2I, H]`, `w2` into `w2 [H, I]`) in its own call. In the bf16 format that dense layout IS the
expert's row, so the shards land in place. A quantized format's row (int4, fp8, NVFP4) can only be computed
from the whole projection (a global scale, or groups spanning gate and up): the shards go to a dense buffer of
that expert, and the expert is quantized into its row (`WeightFormat.quantize`) when its last shard arrives,
then the buffer is freed. Host memory beyond the bank: one dense expert per expert whose shards are in flight
(checkpoints store an expert's shards together, so few at a time; `peak_pending` says how many there were).

Nothing here imports SGLang.
"""

from __future__ import annotations

import torch

from pooled_runner.bank import check_expert_weights
from pooled_runner.formats import Bf16Format
from pooled_runner.moe import PooledMoE

# dense operand -> the checkpoint shards that write it (SGLang's shard ids)
DENSE_SHARDS: dict[str, tuple[str, ...]] = {"w13": ("w1", "w3"), "w2": ("w2",)}
ALL_SHARDS = frozenset(s for shards in DENSE_SHARDS.values() for s in shards)


class DenseLoader:
    """Shard-by-shard loading of one `PooledMoE` (between its `allocate()` and `finalize()`).

    Use: `rows(layer, expert)[operand]` is where the engine writes a shard of `operand` ("w13" or "w2"), then
    `written(layer, expert, shard)`; `missing(layer)` before finalizing names what never arrived.
    """

    def __init__(self, moe: PooledMoE):
        if not moe.allocated:
            raise RuntimeError("DenseLoader needs an allocated PooledMoE (call allocate() first)")
        self.moe = moe
        self.in_place = isinstance(moe.format, Bf16Format)
        two_i, hidden = 2 * moe.intermediate_size, moe.hidden_size
        self.dense_shapes = {"w13": (two_i, hidden), "w2": (hidden, moe.intermediate_size)}
        self._shards: dict[tuple[int, int], set[str]] = {}  # (layer, expert) -> shards written
        self._pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # dense buffers in flight
        self.peak_pending = 0
        self.num_quantized = 0

    def rows(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Writable dense views `{"w13": [2I, H], "w2": [H, I]}` of one expert, in the model's dtype."""
        if self.in_place:
            return self.moe.expert_rows(layer, expert)
        key = (layer, expert)
        if self._shards.get(key) == ALL_SHARDS:
            raise ValueError(
                f"layer {layer} expert {expert}: a shard arrived after the expert was complete and quantized "
                f"into the {self.moe.format.name} format; the checkpoint provides one of its tensors twice"
            )
        self.moe.expert_rows(layer, expert)  # range checks, with the layer's numbers
        buffers = self._pending.get(key)
        if buffers is None:
            # zeros, not empty: a shard the checkpoint lacks must not quantize garbage (it is reported anyway)
            buffers = {
                op: torch.zeros(shape, dtype=self.moe.dtype) for op, shape in self.dense_shapes.items()
            }
            self._pending[key] = buffers
            self.peak_pending = max(self.peak_pending, len(self._pending))
        return buffers

    def written(self, layer: int, expert: int, shard: str) -> None:
        """Shard `shard` (one of w1, w3, w2) of an expert is in `rows(layer, expert)`; the last one quantizes."""
        if shard not in ALL_SHARDS:
            raise ValueError(f"shard {shard!r} is not one of {sorted(ALL_SHARDS)}")
        key = (layer, expert)
        done = self._shards.setdefault(key, set())
        done.add(shard)
        if self.in_place or done != ALL_SHARDS:
            return
        buffers = self._pending.pop(key)
        quantized = self.moe.format.quantize(buffers["w13"], buffers["w2"])
        check_expert_weights(self.moe.operands, quantized, f"layer {layer} expert {expert} quantized")
        for name, dst in self.moe.expert_rows(layer, expert).items():
            dst.copy_(quantized[name])
        self.num_quantized += 1

    def missing(self, layer: int) -> list[str]:
        """`"expert e shard"` for every shard of the layer's experts not written yet, in expert order."""
        return [
            f"expert {e} {shard}"
            for e in range(self.moe.num_experts_per_layer[layer])
            for shards in DENSE_SHARDS.values()
            for shard in shards
            if shard not in self._shards.get((layer, e), ())
        ]

    @property
    def num_pending(self) -> int:
        """Experts with some shards written but not all (their dense buffers are held)."""
        return len(self._pending)
