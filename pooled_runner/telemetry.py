"""Route telemetry: per-(layer, expert) routed counts and a routed bitmap, accumulated inside CUDA graphs.

Inside a graph (or any step) `record(layer, topk_ids)` only accumulates, with fixed-shape device ops: counts by
scatter-add (atomics on CUDA; integer adds, so the result does not depend on their order), the bitmap by an
index fill, and two sticky flags: *poison* (an id outside [-1, E) was seen; it contributes nothing) and
*overflow* (a counter reached `max_count`; counters saturate there). Reading and clearing happen only at a
coarse boundary outside capture: `snapshot()` returns host copies with the window's epoch, `reset()` clears
everything and starts the next epoch. Both refuse while a capture is in progress or inside `graph_region()`
(the runner wraps capture and replay in it) and then change nothing. A window with poison or overflow is
reported by its snapshot (`valid` False) and must be discarded, never applied (`residency_plan` refuses it).

Disabled telemetry records nothing and launches nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pooled_runner.kernels.route_count import count_routes

logger = logging.getLogger("pooled_runner")

POISON, OVERFLOW = 0, 1
DEFAULT_MAX_COUNT = (1 << 31) - 1


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Host copy of one telemetry window."""

    epoch: int
    counts: torch.Tensor  # [L, E_max] int64 routed (token, slot) pairs per (layer, expert)
    routed: torch.Tensor  # [L, E_max] bool: routed at least once in the window
    poisoned: bool
    overflowed: bool

    @property
    def valid(self) -> bool:
        """False when the window saw an out-of-range id or a saturated counter: discard it."""
        return not (self.poisoned or self.overflowed)

    def problems(self) -> list[str]:
        out = []
        if self.poisoned:
            out.append(f"epoch {self.epoch}: out-of-range expert ids were routed (poison bit)")
        if self.overflowed:
            out.append(f"epoch {self.epoch}: a counter saturated (overflow bit)")
        return out


class RouteTelemetry:
    """Per-(layer, expert) route counters on `device` (see module docstring).

    Args:
      num_experts_per_layer: E of each pooled layer.
      device: where the counters live (the pool device).
      enabled: False makes `record` a no-op (no tensors are touched).
      max_count: counters saturate here and set the overflow bit.
      fused: record with the one-launch kernel (`kernels/route_count.py`); None = on CUDA. True on the CPU runs
        it under the Triton interpreter (tests).
    """

    def __init__(
        self,
        num_experts_per_layer: list[int],
        device: torch.device,
        enabled: bool = True,
        max_count: int = DEFAULT_MAX_COUNT,
        fused: bool | None = None,
    ):
        if not num_experts_per_layer or min(num_experts_per_layer) < 1:
            raise ValueError(f"num_experts_per_layer={num_experts_per_layer} must be non-empty and positive")
        if max_count < 1:
            raise ValueError(f"max_count={max_count} must be >= 1")
        self.num_experts_per_layer = list(num_experts_per_layer)
        self.max_experts = max(num_experts_per_layer)
        self.enabled = enabled
        self.max_count = max_count
        size = len(num_experts_per_layer) * self.max_experts
        self.counts = torch.zeros(size + 1, dtype=torch.int64, device=device)  # last slot: dummy
        self.routed = torch.zeros(size + 1, dtype=torch.bool, device=device)
        self.flags = torch.zeros(2, dtype=torch.int32, device=device)  # poison, overflow (sticky)
        self.epoch = 0
        self._graph_depth = 0
        self.fused = torch.device(device).type == "cuda" if fused is None else fused

    @contextlib.contextmanager
    def graph_region(self) -> Iterator[None]:
        """Mark a capture or replay in progress: snapshot() and reset() are refused inside."""
        self._graph_depth += 1
        try:
            yield
        finally:
            self._graph_depth -= 1

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Accumulate one step of `layer`: `topk_ids [T, K]` (-1 padding). Graph-safe, no host sync."""
        if not self.enabled:
            return
        if not 0 <= layer < len(self.num_experts_per_layer):
            raise ValueError(f"layer {layer} out of range [0, {len(self.num_experts_per_layer)})")
        E, EM = self.num_experts_per_layer[layer], self.max_experts
        if self.fused:
            ids = topk_ids.reshape(-1)  # [T*K]
            if ids.dtype not in (torch.int32, torch.int64):
                ids = ids.to(torch.int64)
            count_routes(
                ids.contiguous(), self.counts, self.routed, self.flags, layer * EM, E, self.max_count
            )
            return
        dummy = self.counts.shape[0] - 1
        ids = topk_ids.reshape(-1).to(torch.int64)  # [T*K]
        routed = (ids >= 0) & (ids < E)
        bad = (ids < -1) | (ids >= E)
        flat = torch.where(routed, layer * EM + ids, dummy)
        self.counts.scatter_add_(0, flat, routed.to(torch.int64))
        self.routed.index_fill_(0, flat, True)
        layer_counts = self.counts[layer * EM : layer * EM + E]
        over = (layer_counts >= self.max_count).any()
        layer_counts.clamp_(max=self.max_count)
        sticky = torch.stack([bad.any(), over]).to(torch.int32)
        torch.maximum(self.flags, sticky, out=self.flags)

    def fused_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(counts, routed, flags, max_count) for a kernel that records `layer` itself (the fused planner);
        the layer's counters start at `layer * max_experts`. Same contract as `record`."""
        if not 0 <= layer < len(self.num_experts_per_layer):
            raise ValueError(f"layer {layer} out of range [0, {len(self.num_experts_per_layer)})")
        return self.counts, self.routed, self.flags, self.max_count

    def _refuse_in_graph(self, what: str) -> None:
        if capturing() or self._graph_depth:
            raise RuntimeError(
                f"telemetry {what}() during graph capture or replay is refused; call it at a boundary"
            )

    def snapshot(self) -> TelemetrySnapshot:
        """Host copy of the current window (syncs). Refused during capture/replay."""
        self._refuse_in_graph("snapshot")
        L, EM = len(self.num_experts_per_layer), self.max_experts
        flags = self.flags.tolist()
        snap = TelemetrySnapshot(
            epoch=self.epoch,
            # copy=True: on a CPU device .cpu() would alias the live counters, which reset() then zeroes.
            counts=self.counts[:-1].view(L, EM).to("cpu", copy=True),
            routed=self.routed[:-1].view(L, EM).to("cpu", copy=True),
            poisoned=bool(flags[POISON]),
            overflowed=bool(flags[OVERFLOW]),
        )
        for problem in snap.problems():
            logger.warning("route telemetry window discarded: %s", problem)
        return snap

    def reset(self) -> None:
        """Clear counters, bitmap and flags; start the next epoch. Refused (nothing changes) in a graph."""
        self._refuse_in_graph("reset")
        self.counts.zero_()
        self.routed.zero_()
        self.flags.zero_()
        self.epoch += 1
