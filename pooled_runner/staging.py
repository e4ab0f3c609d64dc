"""Prefill staging: stream each layer's routed non-resident experts through a small ring of chunk buffers.

Why: a GEMM reads its weight operand once per M-block, so in a large step every expert read through the host
view crosses PCIe several times. Staging copies each routed non-resident expert once, at copy-engine bandwidth,
into a device buffer. Full-layer buffers would cost two layers of experts of VRAM that could be pool rows;
instead a ring of `num_buffers` chunk buffers of `chunk_experts` (C) experts each streams the layer through:

  - the MoE over the layer's resident experts (pool rows) runs while the first chunks copy (side stream);
  - each chunk: the compute stream waits for its copy, then gemm1+gemm2 run only for the pairs whose expert
    is in the chunk (a per-chunk location table: chunk experts -> `R + slot`, every other expert -> -1), writing
    only those pairs' rows of the per-pair output; once that compute is enqueued the buffer is free and the
    next chunk's copy (this layer's, else the next layer's first chunks: prefetch) is issued behind an event;
  - after all chunks the caller combines over top-k once, in k order, so the output is bitwise the unstaged one.

Host planning (large, uncaptured steps only): `begin_step` reads every layer's location table once (one host
sync per prefill step; none in decode). A layer's chunks are planned from the experts the step routes there
(`layer_passes(layer, routed)`); the next layer's first chunks are prefetched before its routing is known, from
its non-resident experts in ascending order (a prefetched expert the step then does not route was copied for
nothing: `StagingStats.rows_unused`). Residency must not change during a staged step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pooled_runner.bank import ExpertBank
from pooled_runner.config import PoolConfig
from pooled_runner.formats.base import OperandSpec

logger = logging.getLogger("pooled_runner")

NUM_BUFFERS = 3  # chunk buffers in the ring: one computing, two copying ahead


@dataclass(frozen=True)
class Run:
    """Experts `[start, start + length)` of one layer, copied as one block."""

    start: int
    length: int


def consecutive_runs(experts: list[int]) -> list[Run]:
    """Coalesce ascending distinct expert ids into runs of consecutive ids (exact and minimal)."""
    runs: list[Run] = []
    for e in experts:
        if runs and runs[-1].start + runs[-1].length == e:
            runs[-1] = Run(runs[-1].start, runs[-1].length + 1)
        else:
            runs.append(Run(e, 1))
    return runs


def nonresident_experts(codes: list[int], num_rows: int) -> list[int]:
    """Ascending experts whose location code is a host row (`>= num_rows`; padding -1 and rows skipped)."""
    return [e for e, c in enumerate(codes) if c >= num_rows]


def check_fits(needed_bytes: int, free_bytes: int) -> None:
    """ValueError with the numbers and the flags to fix it when the chunk buffers do not fit."""
    if needed_bytes > free_bytes:
        raise ValueError(
            f"prefill staging needs {needed_bytes} bytes ({needed_bytes / (1 << 30):.2f} GiB) of device memory "
            f"for its ring of chunk buffers but {free_bytes} bytes are free; lower --moe-expert-pool-rows or "
            "--moe-expert-pool-staging-chunk-experts, or pass --no-moe-expert-pool-prefill-staging"
        )


def check_chunk_experts(chunk_experts: int, max_experts: int) -> None:
    """ValueError naming the flag unless `1 <= chunk_experts <= max_experts` (the largest layer's E)."""
    if not 1 <= chunk_experts <= max_experts:
        raise ValueError(
            f"staging chunk of {chunk_experts} experts: must be in [1, {max_experts}] (the largest layer's "
            f"expert count); pass --moe-expert-pool-staging-chunk-experts N with 1 <= N <= {max_experts}"
        )


@dataclass
class StagingStats:
    steps_staged: int = 0
    layers_staged: int = 0
    chunks_staged: int = 0  # chunk copies issued
    rows_staged: int = 0  # expert rows copied into chunk buffers
    rows_unused: int = 0  # of those, prefetched for a layer that then did not route them
    bytes_staged: int = 0


@dataclass
class Chunk:
    """Up to C experts of one layer, in slots 0..n-1 of one ring buffer."""

    layer: int
    experts: list[int]
    buffer: int = -1  # ring buffer index once issued
    copied: torch.cuda.Event | None = None  # recorded on the copy stream after the copy


@dataclass
class StagedPass:
    """One compute pass of a staged layer.

    `slots[e]`: the row of routed expert e in this pass's source: a pool row when `rows` is None (the resident
    pass), else a slot of the chunk buffer `rows[op] [C, ...]`. `l2p_gpu [E_max]` int32 (kernel path only):
    e -> its pool row (resident pass) or `R + slot` (chunk pass), every other expert -1 (not computed here).
    """

    slots: dict[int, int]
    rows: dict[str, torch.Tensor] | None
    l2p_gpu: torch.Tensor | None = None


@dataclass
class _StepPlan:
    codes: list[list[int]]  # per layer, the location codes read at begin_step
    nonresident: list[list[int]]  # per layer, ascending host experts
    speculated: dict[int, int] = field(default_factory=dict)  # layer -> experts prefetched so far


class LayerStager:
    """A ring of chunk buffers per operand, filled from the bank chunk by chunk with prefetch.

    Args:
      operands: operand specs of one expert row. bank: the host bank (source of the copies).
      num_rows: R (codes >= R are host rows). device: the pool device; on a CPU device the copies are
        synchronous (tests). min_tokens: smallest staged step. chunk_experts: C, experts per chunk buffer,
        in [1, largest layer's E] (ValueError otherwise). prefetch: False copies each chunk on the compute
        stream when it is needed, nothing ahead (benchmarks compare). num_buffers: chunk buffers in the ring.
    """

    NUM_BUFFERS = NUM_BUFFERS

    def __init__(
        self,
        operands: tuple[OperandSpec, ...],
        bank: ExpertBank,
        num_rows: int,
        device: torch.device,
        min_tokens: int,
        chunk_experts: int = 16,
        prefetch: bool = True,
        num_buffers: int = NUM_BUFFERS,
    ):
        max_experts = max(bank.num_experts_per_layer)
        check_chunk_experts(chunk_experts, max_experts)
        if num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers} must be >= 1")
        self.operands, self.bank, self.num_rows, self.device = operands, bank, num_rows, device
        self.min_tokens, self.chunk_experts, self.prefetch = min_tokens, chunk_experts, prefetch
        self.max_experts = max_experts
        self.buffers_gpu: list[dict[str, torch.Tensor]] = [
            {
                s.name: torch.empty((chunk_experts, *s.row_shape), dtype=s.dtype, device=device)
                for s in operands
            }
            for _ in range(num_buffers)
        ]
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.is_cuda and prefetch else None
        # Per buffer: recorded on the compute stream after the last pass that read it (a copy into it waits).
        self._read_done: list[torch.cuda.Event | None] = [None] * num_buffers
        self._free: deque[int] = deque(range(num_buffers))  # buffers whose last reader is enqueued
        self._inflight: deque[Chunk] = deque()  # issued chunks not yet computed, in issue order
        self._plan: _StepPlan | None = None
        self.stats = StagingStats()

    @staticmethod
    def buffer_bytes(
        operands: tuple[OperandSpec, ...], chunk_experts: int, num_buffers: int = NUM_BUFFERS
    ) -> int:
        """Device bytes of the ring: `num_buffers` chunk buffers of `chunk_experts` expert rows."""
        return num_buffers * chunk_experts * sum(s.row_bytes for s in operands)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for buf in self.buffers_gpu for t in buf.values())

    @property
    def num_buffers(self) -> int:
        return len(self.buffers_gpu)

    @property
    def active(self) -> bool:
        """True between a qualifying `begin_step` and the next `begin_step` / `end_step`."""
        return self._plan is not None

    def qualifies(self, num_tokens: int) -> bool:
        capturing = self.is_cuda and torch.cuda.is_current_stream_capturing()
        return num_tokens >= self.min_tokens and not capturing

    def begin_step(self, num_tokens: int, l2p_gpu: torch.Tensor) -> bool:
        """Start a step of `num_tokens` tokens; returns whether it is staged (see module docstring)."""
        self.end_step()
        if not self.qualifies(num_tokens):
            return False
        codes_host = l2p_gpu.cpu().tolist()  # the one host sync of a staged step
        codes = [codes_host[layer][:n] for layer, n in enumerate(self.bank.num_experts_per_layer)]
        self._plan = _StepPlan(codes, [nonresident_experts(c, self.num_rows) for c in codes])
        self.stats.steps_staged += 1
        return True

    def end_step(self) -> None:
        """Stop staging; chunks copied ahead for a layer that will not run are dropped (their rows unused)."""
        self._drop_inflight(keep_layer=-1)
        self._plan = None

    def _drop_inflight(self, keep_layer: int) -> None:
        kept: deque[Chunk] = deque()
        for chunk in self._inflight:
            if chunk.layer == keep_layer:
                kept.append(chunk)
            else:  # its buffer's readers are all enqueued already: free now (copies into it stay ordered)
                self._free.append(chunk.buffer)
                self.stats.rows_unused += len(chunk.experts)
        self._inflight = kept

    # ---- copies ---------------------------------------------------------------------------------------------
    def _issue(self, chunk: Chunk) -> None:
        """Copy `chunk` into a free buffer: on the copy stream after the buffer's last reader, or in place."""
        chunk.buffer = self._free.popleft()
        dst, src = self.buffers_gpu[chunk.buffer], self.bank.layer(chunk.layer)
        if self.copy_stream is not None:
            read_done = self._read_done[chunk.buffer]
            if read_done is not None:
                self.copy_stream.wait_event(read_done)
            with torch.cuda.stream(self.copy_stream):
                self._copy(dst, src, chunk.experts)
                chunk.copied = torch.cuda.Event()
                chunk.copied.record(self.copy_stream)
        else:  # on the compute stream (stream order after the last reader) or on the CPU
            self._copy(dst, src, chunk.experts)
        self._inflight.append(chunk)
        self.stats.chunks_staged += 1
        self.stats.rows_staged += len(chunk.experts)
        self.stats.bytes_staged += len(chunk.experts) * sum(s.row_bytes for s in self.operands)

    def _copy(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], experts: list[int]) -> None:
        slot = 0
        for run in consecutive_runs(experts):
            lo, hi = run.start, run.start + run.length
            for name, t in dst.items():
                t[slot : slot + run.length].copy_(src[name][lo:hi], non_blocking=self.is_cuda)
            slot += run.length

    def _speculate(self, layer: int) -> Chunk | None:
        """The next chunk of `layer`'s non-resident experts, before its routing is known (prefetch)."""
        assert self._plan is not None
        if layer >= len(self._plan.nonresident):
            return None
        done = self._plan.speculated.get(layer, 0)
        experts = self._plan.nonresident[layer][done : done + self.chunk_experts]
        if not experts:
            return None
        self._plan.speculated[layer] = done + len(experts)
        return Chunk(layer, experts)

    def _fill_ring(self, todo: deque[Chunk], layer: int) -> None:
        """Issue `todo` (this layer's unissued chunks) into free buffers, then prefetch the next layer's."""
        while self._free and todo:
            self._issue(todo.popleft())
        while self.prefetch and self._free and not todo:
            chunk = self._speculate(layer + 1)
            if chunk is None:
                return
            self._issue(chunk)

    # ---- the passes of one layer ----------------------------------------------------------------------------
    def plan_layer(self, layer: int, routed: list[int]) -> tuple[list[int], list[Chunk], deque[Chunk]]:
        """(routed resident experts, this layer's chunks already issued, chunks still to issue)."""
        if self._plan is None:
            raise RuntimeError("layer_passes() outside a staged step: call begin_step() first")
        if not 0 <= layer < len(self._plan.codes):
            raise ValueError(f"layer {layer} out of range [0, {len(self._plan.codes)})")
        codes = self._plan.codes[layer]
        routed_set = set(routed)
        if len(routed_set) != len(routed) or any(not 0 <= e < len(codes) for e in routed):
            raise ValueError(
                f"layer {layer}: routed experts {routed} must be distinct ids in [0, {len(codes)})"
            )
        self._drop_inflight(
            keep_layer=layer
        )  # a layer out of order: what was prefetched for another is dropped
        issued = list(self._inflight)
        covered = {e for c in issued for e in c.experts}
        self.stats.rows_unused += len(covered - routed_set)
        remaining = [e for e in sorted(routed_set) if codes[e] >= self.num_rows and e not in covered]
        C = self.chunk_experts
        todo = deque(Chunk(layer, remaining[i : i + C]) for i in range(0, len(remaining), C))
        # This layer is now planned from its routing: it is not speculated any further.
        self._plan.speculated[layer] = len(self._plan.nonresident[layer])
        resident = sorted(e for e in routed_set if 0 <= codes[e] < self.num_rows)
        return resident, issued, todo

    def layer_passes(self, layer: int, routed: list[int], with_tables: bool) -> Iterator[StagedPass]:
        """The passes of `layer` for distinct `routed` experts: the resident pass (if any), then one per chunk.

        A generator: when the caller asks for the next pass, the previous one's compute is taken as enqueued
        (its buffer is freed behind an event and the next copy issued). Exhaust it. `with_tables`: build each
        pass's `l2p_gpu` (the kernel path; one pinned host->device copy per layer).
        """
        resident, issued, todo = self.plan_layer(layer, routed)
        routed_set = set(routed)
        chunks = issued + list(todo)
        codes = self._plan.codes[layer] if self._plan is not None else []
        slot_maps = [{e: s for s, e in enumerate(c.experts) if e in routed_set} for c in chunks]
        tables = self._tables(layer, {e: codes[e] for e in resident}, slot_maps) if with_tables else None
        self.stats.layers_staged += 1
        if self.prefetch:
            self._fill_ring(todo, layer)
        if resident:
            yield StagedPass({e: codes[e] for e in resident}, None, None if tables is None else tables[0])
        for i, (chunk, slots) in enumerate(zip(chunks, slot_maps)):
            if chunk.buffer < 0:  # no prefetch: copy now, on the compute stream
                assert todo and todo[0] is chunk, "chunks are issued in order"
                self._issue(todo.popleft())
            assert self._inflight[0] is chunk, "chunks are computed in issue order"
            compute = torch.cuda.current_stream(self.device) if self.is_cuda else None
            if slots:  # a prefetched chunk holding no expert this layer routes is not computed
                if compute is not None and chunk.copied is not None:
                    compute.wait_event(chunk.copied)
                yield StagedPass(
                    slots, self.buffers_gpu[chunk.buffer], None if tables is None else tables[1 + i]
                )
            self._inflight.popleft()
            if compute is not None:
                done = torch.cuda.Event()
                done.record(compute)
                self._read_done[chunk.buffer] = done
            self._free.append(chunk.buffer)
            if self.prefetch:
                self._fill_ring(todo, layer)

    def _tables(self, layer: int, resident: dict[int, int], slot_maps: list[dict[int, int]]) -> torch.Tensor:
        """`[1 + chunks, E_max]` int32 location tables of the passes on the device (row 0: the resident pass)."""
        host = torch.full((1 + len(slot_maps), self.max_experts), -1, dtype=torch.int32)
        for e, row in resident.items():
            host[0, e] = row
        for i, slots in enumerate(slot_maps):
            for e, s in slots.items():
                host[1 + i, e] = self.num_rows + s
        if not self.is_cuda:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)


def make_stager(
    operands: tuple[OperandSpec, ...],
    bank: ExpertBank,
    num_rows: int,
    max_experts: int,
    config: PoolConfig,
    device: torch.device,
) -> LayerStager:
    """The pool's stager, its ring allocated now (before an engine sizes its KV cache); ValueError with the
    numbers and the flags to change when the ring does not fit in the device's free memory (`check_fits`)."""
    # A chunk larger than the largest layer would only waste VRAM: the default (16) is cut to E on small
    # models; LayerStager itself refuses C > E.
    chunk = min(config.staging_chunk_experts, max_experts)
    needed = LayerStager.buffer_bytes(operands, chunk)
    if device.type == "cuda":
        check_fits(needed, torch.cuda.mem_get_info(device)[0])
    stager = LayerStager(operands, bank, num_rows, device, config.staging_min_tokens, chunk)
    logger.info(
        "prefill staging: %d chunk buffers of %d experts, %d bytes (%.3f GiB) on %s, steps >= %d tokens",
        stager.num_buffers,
        chunk,
        stager.nbytes,
        stager.nbytes / (1 << 30),
        device,
        config.staging_min_tokens,
    )
    return stager
