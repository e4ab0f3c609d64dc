"""Prefill staging: copy each layer's non-resident expert rows into a device buffer before it computes.

Why: a GEMM reads its weight operand once per M-block, so in a large step every expert read through the host
view crosses PCIe several times. Staging copies each non-resident row once, at copy-engine bandwidth, into one
of two full-layer device buffers (alternating by layer); layer i+1 is copied on a side stream while layer i
computes. The staging buffer has the bank layer's layout (`[E_max, *row_shape]`, host row e at index e), so it
simply replaces the host view as the source of codes `R + e`: the kernel is unchanged.

Contract:
  - `begin_step(num_tokens)` at the first pooled layer of a step; it qualifies when staging is enabled, the step
    is not being captured and has >= `min_tokens` tokens. It reads every layer's location table once (one host
    sync per prefill step; none in decode) and turns each non-resident map into runs of consecutive rows.
  - `source(layer)` returns that layer's staged rows (waiting on its copy), after starting the next layer's copy.
  - Residency must not change during a staged step (the planner does not admit while a step is staged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pooled_runner.bank import ExpertBank
from pooled_runner.formats.base import OperandSpec

logger = logging.getLogger("pooled_runner")


@dataclass(frozen=True)
class Run:
    """Host rows `[start, start + length)` of one layer, copied as one block."""

    start: int
    length: int


def nonresident_runs(codes: list[int], num_rows: int) -> list[Run]:
    """Coalesce the non-resident experts of one layer's location codes into runs of consecutive experts.

    `codes[e]` is expert e's location code (`>= num_rows` = host row; padding `-1` and rows are skipped).
    The runs are exact (every non-resident expert in exactly one run) and minimal (no two runs touch).
    """
    runs: list[Run] = []
    start = -1
    for expert, code in enumerate([*codes, -1]):
        host = code >= num_rows
        if host and start < 0:
            start = expert
        elif not host and start >= 0:
            runs.append(Run(start, expert - start))
            start = -1
    return runs


def check_fits(needed_bytes: int, free_bytes: int) -> None:
    """ValueError with the numbers and the flag to turn staging off when the buffers do not fit."""
    if needed_bytes > free_bytes:
        raise ValueError(
            f"prefill staging needs {needed_bytes} bytes ({needed_bytes / (1 << 30):.2f} GiB) of device memory "
            f"for two full-layer buffers but {free_bytes} bytes are free; lower --moe-expert-pool-rows or pass "
            "--no-moe-expert-pool-prefill-staging"
        )


@dataclass
class StagingStats:
    steps_staged: int = 0
    layers_staged: int = 0
    rows_staged: int = 0
    bytes_staged: int = 0


class LayerStager:
    """Two full-layer device buffers per operand, filled from the bank layer by layer with prefetch.

    Args:
      operands: operand specs of one expert row.
      bank: the host bank (source of the copies).
      num_rows: R (codes >= R are host rows).
      device: the pool device. On a CPU device the copies are synchronous (used by tests).
      min_tokens: smallest staged step.
    """

    NUM_BUFFERS = 2

    def __init__(
        self,
        operands: tuple[OperandSpec, ...],
        bank: ExpertBank,
        num_rows: int,
        device: torch.device,
        min_tokens: int,
        prefetch: bool = True,
    ):
        self.operands = operands
        self.bank = bank
        self.num_rows = num_rows
        self.device = device
        self.min_tokens = min_tokens
        # prefetch=False copies each layer on the compute stream when it is needed (benchmarks compare).
        self.prefetch = prefetch
        max_experts = max(bank.num_experts_per_layer)
        self.buffers_gpu: list[dict[str, torch.Tensor]] = [
            {s.name: torch.empty((max_experts, *s.row_shape), dtype=s.dtype, device=device) for s in operands}
            for _ in range(self.NUM_BUFFERS)
        ]
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.is_cuda and prefetch else None
        self._copied: list[torch.cuda.Event | None] = [None] * self.NUM_BUFFERS
        self._runs: list[list[Run]] | None = None  # per layer, for the current staged step
        self._buffer_layer: list[int] = [-1] * self.NUM_BUFFERS  # layer each buffer holds this step
        self.stats = StagingStats()

    @staticmethod
    def buffer_bytes(operands: tuple[OperandSpec, ...], max_experts: int) -> int:
        """Device bytes the two buffers take."""
        return LayerStager.NUM_BUFFERS * max_experts * sum(s.row_bytes for s in operands)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for buf in self.buffers_gpu for t in buf.values())

    @property
    def active(self) -> bool:
        """True between a qualifying `begin_step` and the next `begin_step`."""
        return self._runs is not None

    def qualifies(self, num_tokens: int) -> bool:
        capturing = self.is_cuda and torch.cuda.is_current_stream_capturing()
        return num_tokens >= self.min_tokens and not capturing

    def begin_step(self, num_tokens: int, l2p_gpu: torch.Tensor) -> bool:
        """Start a step of `num_tokens` tokens; returns whether it is staged (see module docstring)."""
        self._runs = None
        self._buffer_layer = [-1] * self.NUM_BUFFERS
        if not self.qualifies(num_tokens):
            return False
        codes_host = l2p_gpu.cpu().tolist()  # the one host sync of a staged step
        self._runs = [
            nonresident_runs(codes_host[layer][:n], self.num_rows)
            for layer, n in enumerate(self.bank.num_experts_per_layer)
        ]
        self.stats.steps_staged += 1
        if self.prefetch:
            self._start_copy(0)
        return True

    def end_step(self) -> None:
        self._runs = None

    def _start_copy(self, layer: int) -> None:
        """Copy `layer`'s non-resident runs into buffer `layer % 2`, after the compute that used it last."""
        assert self._runs is not None
        slot = layer % self.NUM_BUFFERS
        dst, src = self.buffers_gpu[slot], self.bank.layer(layer)
        runs = self._runs[layer]
        if self.copy_stream is not None:
            # Everything enqueued so far on the compute stream includes the last reader of this buffer.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self._copy_runs(dst, src, runs)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self._copied[slot] = event
        else:
            self._copy_runs(dst, src, runs)
        self._buffer_layer[slot] = layer
        num_rows = sum(r.length for r in runs)
        self.stats.layers_staged += 1
        self.stats.rows_staged += num_rows
        self.stats.bytes_staged += num_rows * sum(s.row_bytes for s in self.operands)

    def _copy_runs(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], runs: list[Run]) -> None:
        for run in runs:
            lo, hi = run.start, run.start + run.length
            for name, t in dst.items():
                t[lo:hi].copy_(src[name][lo:hi], non_blocking=self.is_cuda)

    def source(self, layer: int) -> dict[str, torch.Tensor]:
        """The staged rows of `layer` (`[E_max, *row]` per operand) for the current compute stream.

        Waits (on the device) for the layer's copy, then starts the next layer's copy into the other buffer.
        A layer requested out of order is staged on the spot.
        """
        if self._runs is None:
            raise RuntimeError("source() outside a staged step: call begin_step() first")
        if not 0 <= layer < len(self._runs):
            raise ValueError(f"layer {layer} out of range [0, {len(self._runs)})")
        slot = layer % self.NUM_BUFFERS
        if self._buffer_layer[slot] != layer:
            self._start_copy(layer)
        event = self._copied[slot]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        nxt = layer + 1
        if self.prefetch and nxt < len(self._runs) and self._buffer_layer[nxt % self.NUM_BUFFERS] != nxt:
            self._start_copy(nxt)
        return self.buffers_gpu[slot]
