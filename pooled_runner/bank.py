"""The expert bank: every routed expert of every pooled layer, in host memory, one row per expert.

One flat host tensor per operand, `[num_total_experts, *row_shape]`, with one view per layer laid out exactly
like the GPU weights (`[E, 2I, H]` for w13, `[E, H, I]` for w2). With CUDA present the memory is allocated
pageable and then page-locked with `cudaHostRegister` (exact size; `pin_memory=True` would round every block
up to a power of two through torch's caching host allocator), so kernels can read a host row through its
device address. Without CUDA it stays pageable, and the log says so.

The bank is filled expert by expert (`write_expert`), so a loader never needs a second copy of a layer.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from pooled_runner.formats.base import OperandSpec

logger = logging.getLogger("pooled_runner")

GiB = 1 << 30


def check_expert_counts(num_experts_per_layer: list[int]) -> None:
    """ValueError unless there is at least one layer and every layer has at least one expert."""
    if not num_experts_per_layer:
        raise ValueError("num_experts_per_layer is empty: register at least one pooled layer")
    for layer, n in enumerate(num_experts_per_layer):
        if n <= 0:
            raise ValueError(f"layer {layer} has num_experts={n}; every pooled layer needs >= 1 expert")


class ExpertBank:
    """Host rows for every (layer, expert), per operand.

    Args:
      operands: the operand specs of one expert row (from the weight format).
      num_experts_per_layer: E of each pooled layer, in pooled-layer order.
      pin: page-lock the memory (needs CUDA). False keeps it pageable.
    """

    def __init__(self, operands: tuple[OperandSpec, ...], num_experts_per_layer: list[int], pin: bool):
        check_expert_counts(num_experts_per_layer)
        self.operands = operands
        self.num_experts_per_layer = list(num_experts_per_layer)
        self.layer_offsets = [0]
        for n in self.num_experts_per_layer:
            self.layer_offsets.append(self.layer_offsets[-1] + n)
        self.num_total_experts = self.layer_offsets[-1]
        self.pinned = False
        self._registered_ptrs: list[int] = []
        start = time.perf_counter()
        # Pageable allocation first; registration below page-locks exactly these bytes.
        self.tensors_host: dict[str, torch.Tensor] = {
            spec.name: torch.empty((self.num_total_experts, *spec.row_shape), dtype=spec.dtype)
            for spec in operands
        }
        if pin:
            self._pin_all()
        logger.info(
            "expert bank: %d layers, %d experts, %.3f GiB host memory, %s (%.2f s)",
            len(self.num_experts_per_layer),
            self.num_total_experts,
            self.nbytes / GiB,
            "pinned (cudaHostRegister)" if self.pinned else "pageable (pin=False)",
            time.perf_counter() - start,
        )

    @property
    def num_layers(self) -> int:
        return len(self.num_experts_per_layer)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors_host.values())

    def row_bytes(self) -> int:
        """Bytes of one expert row over all operands."""
        return sum(spec.row_bytes for spec in self.operands)

    def _pin_all(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("ExpertBank(pin=True) needs CUDA; pass pin=False on a machine without a GPU")
        cudart = torch.cuda.cudart()
        total, done = self.nbytes, 0
        for name, tensor in self.tensors_host.items():
            size = tensor.numel() * tensor.element_size()
            if size == 0:
                continue
            err = cudart.cudaHostRegister(tensor.data_ptr(), size, 0)
            if int(err) != 0:
                self.close()
                raise RuntimeError(
                    f"cudaHostRegister failed for bank operand {name!r} ({size / GiB:.2f} GiB): error {int(err)}; "
                    "is there enough lockable host memory (ulimit -l)?"
                )
            self._registered_ptrs.append(tensor.data_ptr())
            done += size
            logger.info("pinning expert bank: %.1f / %.1f GiB", done / GiB, total / GiB)
        self.pinned = True

    def close(self) -> None:
        """Unregister the page-locked memory (before the tensors are freed). Idempotent."""
        if self._registered_ptrs:
            cudart = torch.cuda.cudart()
            for ptr in self._registered_ptrs:
                cudart.cudaHostUnregister(ptr)
            self._registered_ptrs = []
        self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn CUDA down already
            self.close()

    def _check_index(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        num_experts = self.num_experts_per_layer[layer]
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} out of range [0, {num_experts}) for layer {layer}")

    def flat_index(self, layer: int, expert: int) -> int:
        """Index of (layer, expert) in the flat per-operand tensors."""
        self._check_index(layer, expert)
        return self.layer_offsets[layer] + expert

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Views `[E, *row_shape]` of one layer's host rows, per operand (the layer's *host view*)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        lo, hi = self.layer_offsets[layer], self.layer_offsets[layer + 1]
        return {name: t[lo:hi] for name, t in self.tensors_host.items()}

    def row(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Views of one expert's host row, per operand."""
        idx = self.flat_index(layer, expert)
        return {name: t[idx] for name, t in self.tensors_host.items()}

    def write_expert(self, layer: int, expert: int, weights: dict[str, torch.Tensor]) -> None:
        """Copy one expert's operands into its host row (shapes and dtypes must match the specs exactly)."""
        dst = self.row(layer, expert)
        check_expert_weights(self.operands, weights, f"layer {layer} expert {expert}")
        for spec in self.operands:
            dst[spec.name].copy_(weights[spec.name])


def check_expert_weights(
    operands: tuple[OperandSpec, ...], weights: dict[str, torch.Tensor], where: str
) -> None:
    """ValueError unless `weights` holds exactly the operands, each contiguous with its spec's shape and dtype."""
    expected = {spec.name for spec in operands}
    if set(weights) != expected:
        raise ValueError(f"{where}: operands {sorted(weights)} given, expected {sorted(expected)}")
    for spec in operands:
        w = weights[spec.name]
        if tuple(w.shape) != spec.row_shape:
            raise ValueError(f"{where}: {spec.name} has shape {tuple(w.shape)}, expected {spec.row_shape}")
        if w.dtype != spec.dtype:
            raise ValueError(f"{where}: {spec.name} has dtype {w.dtype}, expected {spec.dtype}")
        if not w.is_contiguous():
            raise ValueError(
                f"{where}: {spec.name} with shape {tuple(w.shape)} and strides {w.stride()} is not "
                "contiguous; pass .contiguous()"
            )
