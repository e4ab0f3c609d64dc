"""The decode bench's harness (bench/decode.py): the stack's shape, the shared bank, ours at given decode lanes
(optionally with MTP draft-lane pruning), and the timing of a trace's steps (a CUDA graph of one step replayed
with each step's routing, or eager).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.baselines import AllResident, Ours, Traffic
from bench.decode_traces import FAMILIES, TraceKey
from bench.kernels import random_rows
from bench.spec import expected_tokens_per_step
from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.bank import ExpertBank
from pooled_runner.draft_prune import emitted_per_request
from pooled_runner.formats import make_format

FMT = "bf16"


@dataclass(frozen=True)
class Shape:
    """The stack: H, I, E experts per layer, top-k, L layers."""

    H: int = 2048
    I: int = 768
    E: int = 128
    K: int = 8
    L: int = 12


def make_bank(shape: Shape, device: torch.device, g: torch.Generator) -> ExpertBank:
    """Bank of L layers of random bf16 experts (pinned on CUDA), generated on `device` layer by layer."""
    H, I, E = shape.H, shape.I, shape.E
    bank = ExpertBank(
        make_format(FMT, torch.bfloat16).operands(H, I), [E] * shape.L, pin=device.type == "cuda"
    )
    for layer in range(shape.L):
        rows = random_rows(FMT, H, I, E, device.type, g)
        lo, hi = bank.layer_offsets[layer], bank.layer_offsets[layer + 1]
        for name, t in rows.items():
            bank.tensors_host[name][lo:hi].copy_(t)
    sync(device)
    return bank


class OursDraftPruned(Ours):
    """Ours with MTP draft-lane pruning (`pooled_runner/draft_prune.py`): every step is a verify step of
    `num_spec` drafts per request. After each timed step its live lanes are copied on the device (a tiny
    D2D copy, no sync); `take_emitted` reads them after the timed region and turns them into the expected
    accepted tokens per request per step: `1 + sum_{j=1..m} accept^j`, m = the request's last live lane."""

    name = "pooled (ours), draft pruning"  # budget 0; `named(budget)` otherwise

    def __init__(self, moe: PooledMoE, num_spec: int, accept: float):
        super().__init__(moe)
        self.num_spec, self.accept = num_spec, accept
        self.name = self.named(moe.config.max_draft_misses)
        self._alive: list[torch.Tensor] = []

    @classmethod
    def named(cls, max_draft_misses: int) -> str:
        """The system name of draft pruning with this budget (unpaid routes per draft lane and step)."""
        return cls.name if max_draft_misses == 0 else f"{cls.name}, budget {max_draft_misses}"

    def begin_step(self) -> None:
        self.moe.begin_verify_step(self.num_spec)

    def end_step(self) -> None:
        self._alive.append(self.moe.draft_lane_alive().clone())

    def clear(self) -> None:
        """Forget recorded steps (a failed measurement leaves some)."""
        self._alive.clear()

    def take_emitted(self) -> tuple[float, float]:
        """(accepted tokens per request per step, live drafts per request per step), averaged over the steps
        since the last call (each request and step once); clears them."""
        if not self._alive:
            raise RuntimeError("no timed verify step recorded")
        alive = torch.stack(self._alive).cpu()  # [S, T]
        self._alive.clear()
        lanes = 1 + self.num_spec
        emitted = [
            e for step in alive.tolist() for e in emitted_per_request(step, self.num_spec, self.accept)
        ]
        live_drafts = alive.view(alive.shape[0], -1, lanes)[:, :, 1:].int().cummin(-1).values.sum(-1)
        return sum(emitted) / len(emitted), live_drafts.float().mean().item()


@dataclass(frozen=True)
class Mtp:
    """MTP rows: `num_spec` chain drafts accepted w.p. `accept` each, on `families`; all-host-view and per-layer
    slots rows only at bs <= `reference_max_bs` (ours and all-resident at every bs); `draft_budgets`: ours with
    draft-lane pruning (MTP rows only) for each budget (unpaid routes a draft lane may have per step)."""

    num_spec: int = 3
    accept: float = 0.6
    families: tuple[str, ...] = FAMILIES
    reference_max_bs: int = 4
    draft_budgets: tuple[int, ...] = (0,)

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens_per_step(self.num_spec, self.accept)

    def runs(self, system: str, key: TraceKey) -> bool:
        """Whether `system` gets a row for trace `key`."""
        if system.startswith(OursDraftPruned.name):
            return key.num_spec > 0
        if key.num_spec == 0 or system in (Ours.name, AllResident.name):
            return True
        return key.bs <= self.reference_max_bs


NO_MTP = Mtp(num_spec=0, families=())


def make_ours(
    bank: ExpertBank,
    shape: Shape,
    rows: int,
    lanes: int,
    device: torch.device,
    pruning: tuple[int, float] | None = None,
    max_draft_misses: int = 0,
) -> Ours:
    """PooledMoE over a copy of `bank` with `lanes` decode lanes (steps of up to that many tokens are
    device-planned and captured); rows start with experts 0.. of every layer (as the slots do). `pruning`
    (num_spec, acceptance): ours with draft-lane pruning (`max_draft_misses` unpaid routes per lane and step), every step a
    verify step."""
    L, E = shape.L, shape.E
    moe = PooledMoE(
        PoolConfig(
            pool_rows=rows,
            weight_format=FMT,
            device=device.type,
            prefill_staging=False,
            draft_pruning=pruning is not None,
            max_draft_misses=max_draft_misses,
        ),
        shape.H,
        shape.I,
        top_k=shape.K,
        dtype=torch.bfloat16,
    )
    for _ in range(L):
        moe.register_layer(E)
    moe.set_decode_lanes(lanes)
    moe.allocate()
    assert moe.bank is not None, f"pool_rows={rows} holds every expert: no bank"
    for name, t in moe.bank.tensors_host.items():
        t.copy_(bank.tensors_host[name])
    moe.finalize(priority=[(layer, e) for e in range(E) for layer in range(L)])
    return Ours(moe) if pruning is None else OursDraftPruned(moe, *pruning)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepTimer:
    """Milliseconds between `start()` and `stop()`: CUDA events on a GPU, the host clock elsewhere (CPU tests)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._start, self._end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (time.perf_counter() - self._t0) * 1e3


def time_steps(
    system, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor, warm: int
) -> tuple[float, Traffic]:  # type: ignore[no-untyped-def]
    """Mean ms per step of the trace `ids [S, L, T, K]` after `warm` steps, and the timed steps' traffic.

    A capturable system on CUDA runs one step captured in a CUDA graph, replayed with each step's routing copied
    into its static ids; the others (and every system off CUDA) run eagerly. A system's optional `begin_step()`
    runs at the start of every step (inside the graph), its `end_step()` after every timed step (outside it).
    """
    S, L = ids.shape[:2]
    capture = system.capturable and ids.is_cuda
    static_ids = ids[0].clone()  # [L, T, K]
    begin, end = getattr(system, "begin_step", None), getattr(system, "end_step", None)

    def eager(step_ids: torch.Tensor) -> None:
        if begin is not None:
            begin()
        for layer in range(L):
            system.forward(layer, x[layer], step_ids[layer], w[layer])

    graph = None
    if capture:
        eager(static_ids)  # compiles the kernels; ours hands its tables to the device planner (trace step 0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager(static_ids)

    def step(s: int) -> None:
        if graph is None:
            eager(ids[s])
        else:
            static_ids.copy_(ids[s])
            graph.replay()

    for s in range(1 if capture else 0, warm):
        step(s)
    sync(ids.device)
    before = system.traffic()  # ours: a boundary read of the planner's counters (syncs)
    timer = StepTimer(ids.device)
    timer.start()
    for s in range(warm, S):
        step(s)
        if end is not None:
            end()
    ms = timer.stop() / (S - warm)
    if hasattr(system, "account"):  # forward never syncs: count the timed steps' traffic from the trace
        ids_cpu = ids[warm:].cpu()
        for s in range(ids_cpu.shape[0]):
            for layer in range(L):
                system.account(layer, ids_cpu[s, layer])
    return ms, system.traffic() - before


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
