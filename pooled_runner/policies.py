"""Residency policies of the planner: which misses to admit first, which rows to give up first, and whether a
candidate may displace a victim. Each policy has a device form (torch ops on the planner's device, graph-safe:
fixed shapes, in-place state, no host sync) and a host form (plain Python, the twin's), with identical integer
semantics so the device planner and the host twin produce identical tables from identical traces.

Decision rule of one planned step (layer l, `now` = the step's clock value; see `planner.py`):
  1. `observe(l, present, now)`: the policy updates its statistics.
  2. hits are stamped `now`; candidates = misses passing the byte-cost rule.
  3. candidates ordered by `candidate_key` ascending, ties by expert id;
     victims = rows not used by this step, ordered free rows first, then `victim_key` ascending, then last-use
     stamp, then row index.
  4. candidate i pairs with victim i; admitted if the victim is free or `accept(candidate, victim's key)`.
Flat ids: `l * E_max + e` for (layer l, expert e).
"""

from __future__ import annotations

import torch

from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.policy_adaptive import AdaptivePolicy
from pooled_runner.policy_base import NEVER as NEVER  # re-exported
from pooled_runner.policy_base import Policy as Policy  # re-exported
from pooled_runner.policy_base import check_policy_rows as check_policy_rows  # re-exported
from pooled_runner.policy_base import shift_ticks
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy


class LRUPolicy:
    """Least recently used row first (ties by row index); misses admitted by expert id; always admit."""

    name = "lru"

    def clock_reset(self, shift: int) -> None:
        pass

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        pass

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        pass

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        return None

    def victim_key(
        self, row_owner: torch.Tensor, row_stamp: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor | None:
        return None

    def accept(self, cand_flat: torch.Tensor, victim_key: torch.Tensor) -> torch.Tensor | None:
        return None

    def evicted(self, victim_key: torch.Tensor, evicted: torch.Tensor) -> None:
        pass

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        pass

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        pass

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return 0

    def host_victim_key(self, owner_flat: int, stamp: int, now: int) -> int:
        return 0

    def host_accept(self, cand_flat: int, victim_key: int) -> bool:
        return True

    def host_evicted(self, victim_key: int) -> None:
        pass

    def host_state(self) -> dict[str, list[int]]:
        return {}


class FreqDecayPolicy:
    """Frequency with decay (uncorrelated references only) plus a recency bonus, with value-based admission.

    Counted in decode steps (one step = one planned tick of every layer; ticks = steps x L, set at bind).
    Every (layer, expert) has an integer counter: +1 for each planned tick that routes it, unless it was
    already routed within the last `correlated_steps` (a reuse chain counts once: LRU-K's correlated
    reference period, so bursts do not look like popularity); every `decay_steps` all counters are halved.
    The value of a resident expert is `min(counter, cap) + recent_bonus * [routed within the last
    recent_steps]`; the row of lowest value is evicted first (ties: least recently used, then row index). A
    missed expert (routed now, so recent) is worth `min(counter, cap) + recent_bonus`; candidates of highest
    value are admitted first, and one displaces its victim only if its value is >= the victim's +
    `admit_margin`. Integer arithmetic only, so device and host agree exactly.
    """

    name = "freq"

    def __init__(
        self,
        decay_steps: int = 128,
        recent_steps: int = 1,
        recent_bonus: int = 32,
        correlated_steps: int = 1,
        admit_margin: int = 0,
        cap: int = 1 << 40,
    ):
        if decay_steps < 1 or cap < 1 or min(recent_steps, recent_bonus, correlated_steps) < 0:
            raise ValueError(
                f"decay_steps={decay_steps}, cap={cap} must be >= 1; recent_steps={recent_steps}, "
                f"recent_bonus={recent_bonus}, correlated_steps={correlated_steps} must be >= 0"
            )
        self.decay_steps, self.recent_steps, self.recent_bonus = decay_steps, recent_steps, recent_bonus
        self.correlated_steps, self.admit_margin, self.cap = correlated_steps, admit_margin, cap
        self.freq: torch.Tensor | None = None  # [L * E_max + 1] int64; last slot is a dummy
        self.last_use: torch.Tensor | None = None  # [L * E_max] int64 tick of the last routing (-inf: never)
        self._max_experts = 0
        self._ticks = (0, 0, 0)  # decay, recent, correlated in ticks
        self._freq_host: list[int] = []
        self._last_host: list[int] = []

    def _set_ticks(self, num_layers: int, max_experts: int) -> None:
        self._max_experts = max_experts
        L = num_layers
        self._ticks = (self.decay_steps * L, self.recent_steps * L, self.correlated_steps * L)

    def clock_reset(self, shift: int) -> None:
        """The planner renumbered its clock: move the last-use ticks with it (ages survive a host-planned step;
        the decay's phase, `now % decay_steps`, moves by `shift`)."""
        shift_ticks(self.last_use, shift)

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        self._set_ticks(num_layers, max_experts)
        size = num_layers * max_experts
        self.freq = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.last_use = torch.full((size,), NEVER, dtype=torch.int64, device=device)

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.freq is None or self.last_use is None:
            raise RuntimeError("FreqDecayPolicy used before bind()")
        return self.freq, self.last_use

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        freq, last_use = self._state()
        decay_ticks, _, correlated_ticks = self._ticks
        decay = torch.remainder(now, decay_ticks) == 0  # [1]
        freq.copy_(torch.where(decay, freq >> 1, freq))
        base = layer * self._max_experts
        last = last_use[base : base + present.shape[0]]  # [E] view
        fresh = present & (now - last >= correlated_ticks)
        freq[base : base + present.shape[0]] += fresh.to(torch.int64)
        last.copy_(torch.where(present, now, last))

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        base = layer * self._max_experts
        return -self._state()[0][base : base + num_experts].clamp(max=self.cap)

    def victim_key(
        self, row_owner: torch.Tensor, row_stamp: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor | None:
        freq = self._state()[0]
        dummy = freq.shape[0] - 1
        value = freq[torch.where(row_owner >= 0, row_owner, dummy)].clamp(max=self.cap)
        recent = (now - row_stamp) < self._ticks[1]  # [R]
        return value + self.recent_bonus * recent.to(torch.int64)

    def accept(self, cand_flat: torch.Tensor, victim_key: torch.Tensor) -> torch.Tensor | None:
        value = self._state()[0][cand_flat].clamp(max=self.cap) + self.recent_bonus
        return value >= victim_key + self.admit_margin

    def evicted(self, victim_key: torch.Tensor, evicted: torch.Tensor) -> None:
        pass

    def state_tensors(self) -> dict[str, torch.Tensor]:
        freq, last_use = self._state()
        return {"freq": freq[:-1], "last_use": last_use}

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        self._set_ticks(num_layers, max_experts)
        self._freq_host = [0] * (num_layers * max_experts)
        self._last_host = [NEVER] * (num_layers * max_experts)

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        decay_ticks, _, correlated_ticks = self._ticks
        if now % decay_ticks == 0:
            self._freq_host = [f >> 1 for f in self._freq_host]
        for e in present:
            flat = layer * self._max_experts + e
            if now - self._last_host[flat] >= correlated_ticks:
                self._freq_host[flat] += 1
            self._last_host[flat] = now

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return -min(self._freq_host[layer * self._max_experts + expert], self.cap)

    def host_victim_key(self, owner_flat: int, stamp: int, now: int) -> int:
        recent = now - stamp < self._ticks[1]
        return min(self._freq_host[owner_flat], self.cap) + self.recent_bonus * recent

    def host_accept(self, cand_flat: int, victim_key: int) -> bool:
        value = min(self._freq_host[cand_flat], self.cap) + self.recent_bonus
        return value >= victim_key + self.admit_margin

    def host_evicted(self, victim_key: int) -> None:
        pass

    def host_state(self) -> dict[str, list[int]]:
        return {"freq": list(self._freq_host), "last_use": list(self._last_host)}


class AgingFreqPolicy:
    """Frequency with dynamic aging (LFU-DA): no decay clock, an inflation value instead.

    Every (layer, expert) keeps a count of uncorrelated routings (as `FreqDecayPolicy`, counts halved every
    `decay_steps`) and a key set when it is routed: `key = inflation + count`. Rows are evicted lowest key
    first (ties: least recently used, then row index); after each step the inflation rises to the largest key
    evicted. Stale experts keep the key of their last routing, so once churn lifts the inflation past it they
    go, at a speed set by the churn itself (adapts to drift without a tuned decay). A candidate (key just set)
    displaces a victim only if its key is >= the victim's + `admit_margin`.
    """

    name = "aging"

    def __init__(
        self,
        decay_steps: int = 1 << 30,
        correlated_steps: int = 1,
        admit_margin: int = 0,
        recent_steps: int = 0,
        recent_bonus: int = 0,
    ):
        if decay_steps < 1 or min(correlated_steps, admit_margin, recent_steps, recent_bonus) < 0:
            raise ValueError(
                f"decay_steps={decay_steps} must be >= 1 and correlated_steps={correlated_steps}, "
                f"admit_margin={admit_margin}, recent_steps={recent_steps}, recent_bonus={recent_bonus} >= 0"
            )
        self.decay_steps, self.correlated_steps, self.admit_margin = (
            decay_steps,
            correlated_steps,
            admit_margin,
        )
        self.recent_steps, self.recent_bonus = recent_steps, recent_bonus
        self.freq: torch.Tensor | None = None  # [L * E_max + 1]
        self.key: torch.Tensor | None = None  # [L * E_max + 1]
        self.last_use: torch.Tensor | None = None  # [L * E_max]
        self.inflation: torch.Tensor | None = None  # [1]
        self._max_experts = 0
        self._ticks = (0, 0, 0)
        self._h_freq: list[int] = []
        self._h_key: list[int] = []
        self._h_last: list[int] = []
        self._h_inflation = 0

    def _set(self, num_layers: int, max_experts: int) -> None:
        self._max_experts = max_experts
        L = num_layers
        self._ticks = (self.decay_steps * L, self.correlated_steps * L, self.recent_steps * L)

    def clock_reset(self, shift: int) -> None:
        """The planner renumbered its clock: move the last-use ticks with it (ages survive a host-planned step;
        the decay's phase, `now % decay_steps`, moves by `shift`)."""
        shift_ticks(self.last_use, shift)

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        self._set(num_layers, max_experts)
        size = num_layers * max_experts
        self.freq = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.key = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.last_use = torch.full((size,), NEVER, dtype=torch.int64, device=device)
        self.inflation = torch.zeros(1, dtype=torch.int64, device=device)

    def _state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.freq is None or self.key is None or self.last_use is None or self.inflation is None:
            raise RuntimeError("AgingFreqPolicy used before bind()")
        return self.freq, self.key, self.last_use, self.inflation

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        freq, key, last_use, inflation = self._state()
        decay_ticks, correlated_ticks, _ = self._ticks
        freq.copy_(torch.where(torch.remainder(now, decay_ticks) == 0, freq >> 1, freq))
        lo, hi = layer * self._max_experts, layer * self._max_experts + present.shape[0]
        last = last_use[lo:hi]
        fresh = present & (now - last >= correlated_ticks)
        freq[lo:hi] += fresh.to(torch.int64)
        key[lo:hi] = torch.where(present, inflation + freq[lo:hi], key[lo:hi])
        last.copy_(torch.where(present, now, last))

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        lo = layer * self._max_experts
        return -self._state()[1][lo : lo + num_experts]

    def victim_key(
        self, row_owner: torch.Tensor, row_stamp: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor | None:
        key = self._state()[1]
        recent = (now - row_stamp) < self._ticks[2]  # [R]
        value = key[torch.where(row_owner >= 0, row_owner, key.shape[0] - 1)]
        return value + self.recent_bonus * recent.to(torch.int64)

    def accept(self, cand_flat: torch.Tensor, victim_key: torch.Tensor) -> torch.Tensor | None:
        return self._state()[1][cand_flat] + self.recent_bonus >= victim_key + self.admit_margin

    def evicted(self, victim_key: torch.Tensor, evicted: torch.Tensor) -> None:
        inflation = self._state()[3]
        top = torch.where(evicted, victim_key, inflation).max()
        torch.maximum(inflation, top, out=inflation)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        freq, key, last_use, inflation = self._state()
        return {"freq": freq[:-1], "key": key[:-1], "last_use": last_use, "inflation": inflation}

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        self._set(num_layers, max_experts)
        size = num_layers * max_experts
        self._h_freq, self._h_key, self._h_last = [0] * size, [0] * size, [NEVER] * size
        self._h_inflation = 0

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        decay_ticks, correlated_ticks, _ = self._ticks
        if now % decay_ticks == 0:
            self._h_freq = [f >> 1 for f in self._h_freq]
        for e in present:
            flat = layer * self._max_experts + e
            if now - self._h_last[flat] >= correlated_ticks:
                self._h_freq[flat] += 1
            self._h_key[flat] = self._h_inflation + self._h_freq[flat]
            self._h_last[flat] = now

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return -self._h_key[layer * self._max_experts + expert]

    def host_victim_key(self, owner_flat: int, stamp: int, now: int) -> int:
        return self._h_key[owner_flat] + self.recent_bonus * (now - stamp < self._ticks[2])

    def host_accept(self, cand_flat: int, victim_key: int) -> bool:
        return self._h_key[cand_flat] + self.recent_bonus >= victim_key + self.admit_margin

    def host_evicted(self, victim_key: int) -> None:
        self._h_inflation = max(self._h_inflation, victim_key)

    def host_state(self) -> dict[str, list[int]]:
        return {
            "freq": list(self._h_freq),
            "key": list(self._h_key),
            "last_use": list(self._h_last),
            "inflation": [self._h_inflation],
        }


POLICIES: dict[str, type] = {
    "lru": LRUPolicy,
    "lru-cycle": CycleLRUPolicy,
    "freq": FreqDecayPolicy,
    "aging": AgingFreqPolicy,
    "adaptive": AdaptivePolicy,  # needs num_rows=
    "adaptive-router": RouterAdaptivePolicy,  # needs num_rows=; reads router scores (plan(router_scores=))
    "adaptive-router-duel": MemoryDuelPolicy,  # the same, two router memories dueled (policy_duel.py)
}


def make_policy(name: str, **kwargs: int) -> Policy:
    """A fresh policy by name (a key of `POLICIES`); the adaptive ones ("adaptive", "adaptive-router",
    "adaptive-router-duel") need `num_rows=` (the pool's rows)."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is not one of {sorted(POLICIES)}")
    if name.startswith("adaptive") and "num_rows" not in kwargs:
        raise ValueError(f"policy {name!r} needs num_rows= (the pool's row count: its shadow caches' size)")
    return POLICIES[name](**kwargs)  # type: ignore[no-any-return]


def policy_for_pool(name: str, num_rows: int) -> Policy:
    """The policy `name` with its default parameters, sized for a pool of `num_rows` rows where it needs that
    (`PoolConfig.planner_policy`)."""
    return make_policy(name, num_rows=num_rows) if name.startswith("adaptive") else make_policy(name)
