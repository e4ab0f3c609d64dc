"""Routing traces: record them from a run, synthesize them, and score pool policies on them against Belady.

A trace is `ids [S, L, T, K]` int32: S decode steps, each through L pooled layers in order, T tokens per step,
K routed experts per token (-1 padding). One planned "tick" is one (step, layer). Hit rate = hits / (hits +
misses) over distinct (tick, expert) accesses, the definition of `PoolStats` and the planner's counters.

- `TraceRecorder`: `record(layer, topk_ids)` from any run (outside graphs), `trace()`, `save` / `load`.
- `synthetic_trace`: per-layer Zipf skew, token-to-token reuse, popularity drift (recency-dominated traces).
- `belady_hit_rate`: offline MIN with bypass over the shared pool (the best hit rate for a trace and R, given
  that a step's own experts cannot be evicted by that step).
- `policy_hit_rate`: the shipped `DevicePlanner` (torch ops on the CPU) with a policy, on a tiny pool.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from pooled_runner.bank import ExpertBank
from pooled_runner.formats.base import OperandSpec
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import Policy
from pooled_runner.pool import ExpertPool


@dataclass
class Trace:
    """`ids [S, L, T, K]` int32 routed ids and the experts of each layer; optionally the router's scores
    `[S, L, T, E_max]` float32 (the scores the top-k was taken on; for `RouterAdaptivePolicy`)."""

    ids: torch.Tensor
    num_experts_per_layer: list[int]
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ids.dim() != 4 or self.ids.shape[1] != len(self.num_experts_per_layer):
            raise ValueError(
                f"trace ids have shape {tuple(self.ids.shape)}, expected [S, {len(self.num_experts_per_layer)}, T, K]"
            )
        want = (*self.ids.shape[:3], max(self.num_experts_per_layer, default=0))
        if self.scores is not None and tuple(self.scores.shape) != want:
            raise ValueError(
                f"trace scores have shape {tuple(self.scores.shape)}, expected {want} (ids' [S, L, T], E_max)"
            )

    @property
    def num_steps(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    def save(self, path: str) -> None:
        data = {"ids": self.ids, "num_experts_per_layer": self.num_experts_per_layer}
        torch.save(data if self.scores is None else {**data, "scores": self.scores}, path)

    @classmethod
    def load(cls, path: str) -> Trace:
        data = torch.load(path)
        return cls(data["ids"], list(data["num_experts_per_layer"]), data.get("scores"))


class TraceRecorder:
    """Collects `record(layer, topk_ids [T, K], router_scores [T, E] | None)` calls; a step ends when layer 0
    comes round again. Scores are kept only if every call of the trace's complete steps gave them."""

    def __init__(self, num_experts_per_layer: list[int]):
        self.num_experts_per_layer = list(num_experts_per_layer)
        self._steps: list[list[torch.Tensor]] = []
        self._scores: list[list[torch.Tensor | None]] = []

    def record(self, layer: int, topk_ids: torch.Tensor, router_scores: torch.Tensor | None = None) -> None:
        if not 0 <= layer < len(self.num_experts_per_layer):
            raise ValueError(
                f"record(layer={layer}): the trace has layers 0..{len(self.num_experts_per_layer) - 1}"
            )
        E, EM = self.num_experts_per_layer[layer], max(self.num_experts_per_layer)
        if router_scores is not None and tuple(router_scores.shape) != (topk_ids.shape[0], E):
            raise ValueError(
                f"router_scores has shape {tuple(router_scores.shape)}, expected [T={topk_ids.shape[0]}, E={E}]"
            )
        if layer == 0:
            self._steps.append([])
            self._scores.append([])
        if not self._steps or len(self._steps[-1]) != layer:
            raise ValueError(f"record(layer={layer}) out of order: layers of a step must come 0, 1, ...")
        if router_scores is not None:
            padded = torch.full((topk_ids.shape[0], EM), float("-inf"))
            padded[:, :E] = router_scores.detach().to("cpu", torch.float32)
            router_scores = padded
        self._steps[-1].append(topk_ids.detach().to("cpu", torch.int32))
        self._scores[-1].append(router_scores)

    def trace(self) -> Trace:
        L = len(self.num_experts_per_layer)
        full = [i for i, s in enumerate(self._steps) if len(s) == L]
        if not full:
            raise ValueError("no complete step recorded")
        ids = torch.stack([torch.stack(self._steps[i]) for i in full])
        given = [t for i in full for t in self._scores[i]]
        scores = None
        if all(t is not None for t in given):
            scores = torch.stack([torch.stack(self._scores[i]) for i in full])  # type: ignore[misc]
        return Trace(ids, self.num_experts_per_layer, scores)


def synthetic_trace(
    num_steps: int,
    num_layers: int = 24,
    num_experts: int = 128,
    top_k: int = 8,
    tokens_per_step: int = 1,
    skew: tuple[float, float] = (0.8, 1.4),
    reuse: float = 0.3,
    drift_every: int = 0,
    seed: int = 0,
    with_scores: bool = False,
    noise_scale: tuple[float, float] | None = None,
) -> Trace:
    """A routing trace with controllable skew and temporal reuse.

    Each layer draws a Zipf exponent from `skew` and a random popularity order; a token picks its top-k by
    Gumbel-top-k on the Zipf log-probabilities, after keeping each of the previous token's experts (same
    lane, same layer) with probability `reuse`. `drift_every > 0` redraws every layer's popularity order every
    that many steps (the recent past then predicts better than the long-run frequency).
    `with_scores`: the trace also carries each token's router scores, the Zipf log-probability + Gumbel noise
    the top-k is taken on (before the reuse boost). `noise_scale (lo, hi)`: each (layer, expert)'s noise is
    scaled by a factor from U[lo, hi] (drawn from a generator of its own, so the ids change only through the
    scaled noise): experts whose scores spread differently, whose mean score no longer orders them by how
    often they are picked.
    """
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    g = torch.Generator().manual_seed(seed)
    L, E, T, K = num_layers, num_experts, tokens_per_step, top_k
    lo, hi = skew
    alpha = lo + (hi - lo) * torch.rand(L, 1, generator=g)  # [L, 1]
    base = -alpha * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[None, :]  # [L, E] by rank

    def popularity() -> torch.Tensor:  # [L, E] log-prob of each expert id
        ranks = torch.argsort(torch.rand(L, E, generator=g), dim=1)
        return torch.gather(base, 1, ranks)

    logp = popularity()
    scale = torch.ones(L, 1, E, dtype=torch.float64)
    if noise_scale is not None:
        side = torch.Generator().manual_seed(seed + 12345)
        lo_s, hi_s = noise_scale
        scale = lo_s + (hi_s - lo_s) * torch.rand(L, 1, E, generator=side, dtype=torch.float64)
    prev = torch.full((L, T, K), -1, dtype=torch.int64)
    out = torch.empty((num_steps, L, T, K), dtype=torch.int32)
    scores = torch.empty((num_steps, L, T, E), dtype=torch.float32) if with_scores else None
    for s in range(num_steps):
        if drift_every and s and s % drift_every == 0:
            logp = popularity()
        gumbel = -torch.log(-torch.log(torch.rand(L, T, E, generator=g, dtype=torch.float64)))
        score = logp[:, None, :] + scale * gumbel  # [L, T, E]
        if scores is not None:
            scores[s] = score.to(torch.float32)
        if s:
            keep = (torch.rand(L, T, K, generator=g) < reuse).to(torch.float64) * 1e9  # [L, T, K]
            score.scatter_add_(2, prev, keep)
        prev = torch.topk(score, K, dim=2).indices  # [L, T, K]
        out[s] = prev.to(torch.int32)
    return Trace(out, [E] * L, scores)


def _ticks(trace: Trace) -> list[list[int]]:
    """Distinct flat ids `l * E_max + e` of every tick, in order."""
    EM = max(trace.num_experts_per_layer)
    out = []
    for s in range(trace.num_steps):
        for layer, E in enumerate(trace.num_experts_per_layer):
            ids = trace.ids[s, layer].reshape(-1).tolist()
            out.append(sorted({layer * EM + e for e in ids if 0 <= e < E}))
    return out


def _neg(key: tuple[float, float]) -> tuple[float, float]:
    return (-key[0], -key[1])


def belady_hit_rate(trace: Trace, num_rows: int, warmup_steps: int = 0) -> float:
    """Offline MIN with bypass: on a miss with no free row, evict the row not used by this tick whose next
    use is farthest (ties: the use after that), unless the missed expert's own next use is farther (then read
    it in place). Misses of a tick are placed soonest-next-use first.

    In the sequential one-request-at-a-time setting this is Belady's optimum. Here a tick's experts arrive
    together and cannot evict each other, so it is a near-optimal clairvoyant reference rather than a proof
    of optimality (tests compare it with an exhaustive search on tiny traces)."""
    ticks = _ticks(trace)
    never = math.inf
    # next use of each item after tick t, refined by the use after that (ties of the next use are common,
    # and a tick's own experts cannot be swapped within the tick, so the tie matters).
    next_use: list[dict[int, tuple[float, float]]] = [{} for _ in ticks]
    last: dict[int, tuple[float, float]] = {}
    for t in range(len(ticks) - 1, -1, -1):
        for item in ticks[t]:
            next_use[t][item] = last.get(item, (never, never))
            last[item] = (t, next_use[t][item][0])
    cache: dict[int, tuple[float, float]] = {}
    heap: list[tuple[tuple[float, float], int]] = []  # ((-next, -next-next), item), lazily invalidated
    hits = misses = 0
    first_counted = warmup_steps * trace.num_layers
    for t, items in enumerate(ticks):
        protected = set(items)
        nu = next_use[t]
        tick_misses = []
        for item in items:
            if item in cache:
                cache[item] = nu[item]
                heapq.heappush(heap, (_neg(nu[item]), item))
                hits += t >= first_counted
            else:
                tick_misses.append(item)
                misses += t >= first_counted
        for item in sorted(tick_misses, key=lambda i: nu[i]):
            if len(cache) < num_rows:
                cache[item] = nu[item]
                heapq.heappush(heap, (_neg(nu[item]), item))
                continue
            victim, aside = None, []
            while heap:
                neg, cand = heapq.heappop(heap)
                if cache.get(cand) != _neg(neg):
                    continue  # stale entry
                if cand in protected:
                    aside.append((neg, cand))
                    continue
                victim = (neg, cand)
                break
            for entry in aside:
                heapq.heappush(heap, entry)
            if victim is None:
                break  # every row is used by this tick: the rest read in place
            if _neg(victim[0]) > nu[item]:
                del cache[victim[1]]
                cache[item] = nu[item]
                heapq.heappush(heap, (_neg(nu[item]), item))
            else:
                heapq.heappush(heap, victim)
                break  # later misses are used even later: bypass them too
    total = hits + misses
    return hits / total if total else 1.0


def tiny_pool(num_experts_per_layer: list[int], num_rows: int) -> ExpertPool:
    """An empty pool of 1-element rows (for policy simulation: tables and decisions only)."""
    operands = (OperandSpec("w", (1,), torch.float32),)
    bank = ExpertBank(operands, num_experts_per_layer, pin=False)
    bank.tensors_host["w"].copy_(torch.arange(bank.num_total_experts, dtype=torch.float32)[:, None])
    return ExpertPool(operands, num_experts_per_layer, num_rows, torch.device("cpu"), bank)


def policy_hit_rate(trace: Trace, num_rows: int, policy: Policy, warmup_steps: int = 0) -> float:
    """Hit rate of the shipped device planner with `policy`, run on the CPU from an empty pool (fed the trace's
    router scores where it carries them)."""
    pool = tiny_pool(trace.num_experts_per_layer, num_rows)
    T, K = trace.ids.shape[2], trace.ids.shape[3]
    planner = DevicePlanner(pool, policy, max_routed=T * K, debug_checks=False)
    ids = trace.ids.to(torch.int64)
    before = {"hits": 0, "misses": 0}
    for s in range(trace.num_steps):
        if s == warmup_steps:
            before = planner.counter_values()
        for layer in range(trace.num_layers):
            scores = None if trace.scores is None else trace.scores[s, layer]
            planner.plan(layer, ids[s, layer], router_scores=scores)
    after = planner.counter_values()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return hits / (hits + misses) if hits + misses else 1.0
