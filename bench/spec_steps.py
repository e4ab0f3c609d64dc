"""The verify-step harness of bench/spec_governed.py (issue #9's MTP target): the trace a request's drafts route
by, one CUDA graph per draft depth, and the stepping loop that a fixed depth or a `SpecGovernor` drives.

Trace: the decode bench's per-layer skew family (Zipf 0.4-1.6, reuse 0.3), one lane of consecutive tokens per
request (its true continuation) and one lane of other tokens from the same distribution (what rejected drafts
route like). A verify step at depth d of a request at position p whose acceptance (chain, `accept` per draft,
sampled and seeded) will be a drafts: tokens p .. p + a from its true lane (the committed token and the drafts
that are right), tokens p + a + 1 .. p + d from its other lane (wrong drafts route like some other token),
request-major; the request then advances by 1 + a, as a real verifier's does. So right drafts overlap their
neighbours' experts as adjacent tokens do, wrong ones do not, and the next step re-reads the corrected position.

Timing: one CUDA graph per depth (all on the same pool and device planner), replayed with the step's routing
copied into its static ids; CUDA events around each replay, read one step late (the governor is fed as an
overlapped server feeds it: the next step is chosen and launched before the last one's time is known), so the
GPU queue never drains. On the CPU each step runs eagerly, timed with the wall clock.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.baselines import Ours
from bench.decode_steps import Shape, sync
from bench.decode_traces import PER_LAYER, SYNTHETIC
from bench.spec_governor_model import sample_accepted
from bench.traces import synthetic_trace
from pooled_runner.spec_governor import SpecGovernor


def request_lanes(shape: Shape, bs: int, tokens: int) -> torch.Tensor:
    """`[tokens, L, 2 * bs, K]` on the CPU (the decode bench's per-layer skew family): lane b < bs is request b's
    true continuation, lane bs + b the tokens its wrong drafts route like (same layers' popularity)."""
    spec = SYNTHETIC[PER_LAYER]
    trace = synthetic_trace(tokens, shape.L, shape.E, shape.K, 2 * bs, seed=17 + bs, **spec)  # type: ignore[arg-type]
    return trace.ids.long()


def verify_ids(lanes: torch.Tensor, positions: list[int], depth: int, accepted: list[int]) -> torch.Tensor:
    """A verify step's routing `[L, bs * (1 + depth), K]`, request-major: request b's tokens p .. p + a_b from its
    true lane b, then p + a_b + 1 .. p + depth from its other lane bs + b (`lanes [tokens, L, 2 * bs, K]`)."""
    n, bs = 1 + depth, len(positions)
    token = torch.tensor([p + j for p in positions for j in range(n)])
    lane = torch.tensor([b if j <= a else bs + b for b, a in enumerate(accepted) for j in range(n)])
    return lanes[token, :, lane, :].permute(1, 0, 2)


class DepthGraphs:
    """One captured verify step per depth, all on one `Ours` (pool and device planner shared between them)."""

    def __init__(self, system: Ours, shape: Shape, bs: int, depths: tuple[int, ...], lanes: torch.Tensor, device: torch.device, g):  # type: ignore[no-untyped-def]  # fmt: skip
        self.system, self.L, self.device, self.bs = system, shape.L, device, bs
        self.cuda = device.type == "cuda"
        self.static: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.x: dict[int, torch.Tensor] = {}
        self.w: dict[int, torch.Tensor] = {}
        for d in depths:
            width = bs * (1 + d)
            self.x[d] = torch.randn(shape.L, width, shape.H, generator=g, device=device).bfloat16()
            self.w[d] = torch.softmax(torch.randn(shape.L, width, shape.K, generator=g, device=device), -1)
            self.static[d] = verify_ids(lanes, [0] * bs, d, [d] * bs).to(device)
            self._eager(d)  # compiles; on CUDA the planner takes the tables at the first step
            if self.cuda:
                sync(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._eager(d)
                self.graphs[d] = graph

    def _eager(self, d: int) -> None:
        for layer in range(self.L):
            self.system.forward(layer, self.x[d][layer], self.static[d][layer], self.w[d][layer])

    def launch(self, d: int, ids: torch.Tensor) -> Callable[[], float]:
        """Enqueue one verify step at depth `d` with routing `ids` (CPU); returns a function giving its
        milliseconds (on CUDA it waits for the step's end event: call it after enqueueing the next step)."""
        if not self.cuda:
            t0 = time.perf_counter()
            self.static[d].copy_(ids)
            self._eager(d)
            ms = (time.perf_counter() - t0) * 1e3
            return lambda: ms
        self.static[d].copy_(ids.pin_memory(), non_blocking=True)  # stream-ordered after the last replay
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graphs[d].replay()
        end.record()

        def elapsed() -> float:
            end.synchronize()
            return start.elapsed_time(end)

        return elapsed


@dataclass
class PolicyRun:
    policy: str
    steps: int = 0
    tokens: float = 0.0  # accepted tokens per request, summed over counted steps
    ms: float = 0.0
    misses: int = 0  # pool misses over the counted steps
    at_depth: dict[int, int] = field(default_factory=dict)

    def add(self, other: PolicyRun) -> None:
        """Sum `other` (another round of the same policy) into this one."""
        assert other.policy == self.policy, (other.policy, self.policy)
        self.steps += other.steps
        self.tokens += other.tokens
        self.ms += other.ms
        self.misses += other.misses
        for d, n in other.at_depth.items():
            self.at_depth[d] = self.at_depth.get(d, 0) + n

    @property
    def tok_s_req(self) -> float:
        return self.tokens / (self.ms * 1e-3) if self.ms > 0 else math.nan


def run_steps(graphs: DepthGraphs, lanes: torch.Tensor, governor: SpecGovernor | None, fixed: int | None, num_steps: int, warm: int, accept: float, seed: int, out: PolicyRun | None, start: int = 0) -> int:  # fmt: skip
    """`num_steps` verify steps from trace position `start` at `fixed` or the governor's choice (the first
    `warm` at the smallest depth, not observed); the later ones observed by the governor and, with `out`,
    counted there. Stops early when a request's lanes have fewer than 1 + max depth tokens left; returns the
    steps run. Each step's time is read after the next step is enqueued (the governor's overlapped-caller
    contract)."""
    depths = tuple(sorted(graphs.static))
    bs = lanes.shape[2] // 2
    rng = random.Random(seed)
    positions = [start] * bs
    pending: tuple[int, int, list[int], Callable[[], float]] | None = None
    misses_before = graphs.system.traffic().misses  # uncounted steps, if any, are taken off below

    def finish(step: int, d: int, accepted: list[int], elapsed: Callable[[], float]) -> None:
        ms = elapsed()
        if step < warm:  # the pool follows the working set; the governor has not started
            return
        if governor is not None:
            governor.observe(d, accepted, ms * 1e-3)
        if out is not None:
            out.steps += 1
            out.tokens += 1.0 + sum(accepted) / bs
            out.ms += ms
            out.at_depth[d] = out.at_depth.get(d, 0) + 1

    ran = 0
    for step in range(num_steps):
        if step == warm and warm > 0:
            if pending is not None:  # the last uncounted step's time before the boundary read
                finish(*pending)
                pending = None
            misses_before = graphs.system.traffic().misses
        # warm-up steps run where the policy starts: its fixed depth, or the governor's first (smallest) depth
        d = fixed if governor is None else depths[0] if step < warm else governor.choose()
        assert d is not None
        if max(positions) + 1 + max(depths) > lanes.shape[0]:
            break
        accepted = [
            sample_accepted(d, rng, accept) for _ in range(bs)
        ]  # known to the trace, not to the governor
        elapsed = graphs.launch(d, verify_ids(lanes, positions, d, accepted))
        positions = [p + 1 + a for p, a in zip(positions, accepted)]
        if pending is not None:
            finish(*pending)
        pending = (step, d, accepted, elapsed)
        ran += 1
    if pending is not None:
        finish(*pending)
    if out is not None:
        out.misses += graphs.system.traffic().misses - misses_before
    return ran
