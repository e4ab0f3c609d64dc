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
  4. candidate i pairs with victim i; admitted if the victim is free or `accept(candidate, victim owner)`.
Flat ids: `l * E_max + e` for (layer l, expert e).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Policy(Protocol):
    """A planner policy. `bind` allocates the device state once, before any capture."""

    name: str

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None: ...

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        """`present [E]` bool (routed this step), `now [1]` int64. In place."""
        ...

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        """`[E]` int64 key, smaller = admitted first; None = by expert id."""
        ...

    def victim_key(self, row_owner: torch.Tensor) -> torch.Tensor | None:
        """`row_owner [R]` flat ids (-1 free) -> `[R]` int64 key, smaller = evicted first; None = by stamp."""
        ...

    def accept(self, cand_flat: torch.Tensor, victim_flat: torch.Tensor) -> torch.Tensor | None:
        """`[P]` flat ids of paired candidate and (non-free) victim owner -> `[P]` bool; None = always."""
        ...

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Device state (for comparison with the twin and for save/restore at boundaries)."""
        ...

    # Host form (the twin's): state in plain Python.
    def host_reset(self, num_layers: int, max_experts: int) -> None: ...

    def host_observe(self, layer: int, present: list[int], now: int) -> None: ...

    def host_candidate_key(self, layer: int, expert: int) -> int: ...

    def host_victim_key(self, owner_flat: int) -> int: ...

    def host_accept(self, cand_flat: int, victim_flat: int) -> bool: ...

    def host_state(self) -> dict[str, list[int]]: ...


class LRUPolicy:
    """Least recently used row first (ties by row index); misses admitted by expert id; always admit."""

    name = "lru"

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        pass

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        pass

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        return None

    def victim_key(self, row_owner: torch.Tensor) -> torch.Tensor | None:
        return None

    def accept(self, cand_flat: torch.Tensor, victim_flat: torch.Tensor) -> torch.Tensor | None:
        return None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        pass

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        pass

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return 0

    def host_victim_key(self, owner_flat: int) -> int:
        return 0

    def host_accept(self, cand_flat: int, victim_flat: int) -> bool:
        return True

    def host_state(self) -> dict[str, list[int]]:
        return {}


class FreqDecayPolicy:
    """Frequency with decay plus frequency admission (TinyLFU-like), LRU among equals.

    Every (layer, expert) has an integer counter: +1 for each planned step that routes it; every
    `decay_period` planned steps (clock ticks, i.e. layer-steps) all counters are halved. Misses with the
    highest counter are admitted first; the row with the lowest counter is evicted first (ties: least recently
    used, then row index); a candidate displaces a victim only if its counter is >= the victim's +
    `admit_margin` (so a one-off expert does not push out a hot one). Integer arithmetic only, so device and
    host agree exactly.
    """

    name = "freq"

    def __init__(self, decay_period: int = 24 * 16, admit_margin: int = 0):
        if decay_period < 1:
            raise ValueError(f"decay_period={decay_period} must be >= 1")
        self.decay_period = decay_period
        self.admit_margin = admit_margin
        self.freq: torch.Tensor | None = None  # [L * E_max + 1] int64; last slot is a dummy
        self._max_experts = 0
        self._freq_host: list[int] = []

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        self._max_experts = max_experts
        self.freq = torch.zeros(num_layers * max_experts + 1, dtype=torch.int64, device=device)

    def _require_freq(self) -> torch.Tensor:
        if self.freq is None:
            raise RuntimeError("FreqDecayPolicy used before bind()")
        return self.freq

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        freq = self._require_freq()
        decay = torch.remainder(now, self.decay_period) == 0  # [1]
        freq.copy_(torch.where(decay, freq >> 1, freq))
        base = layer * self._max_experts
        freq[base : base + present.shape[0]] += present.to(torch.int64)

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        base = layer * self._max_experts
        return -self._require_freq()[base : base + num_experts]

    def victim_key(self, row_owner: torch.Tensor) -> torch.Tensor | None:
        freq = self._require_freq()
        dummy = freq.shape[0] - 1
        return freq[torch.where(row_owner >= 0, row_owner, dummy)]

    def accept(self, cand_flat: torch.Tensor, victim_flat: torch.Tensor) -> torch.Tensor | None:
        freq = self._require_freq()
        dummy = freq.shape[0] - 1
        victim = freq[torch.where(victim_flat >= 0, victim_flat, dummy)]
        return freq[cand_flat] >= victim + self.admit_margin

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"freq": self._require_freq()[:-1]}

    def host_reset(self, num_layers: int, max_experts: int) -> None:
        self._max_experts = max_experts
        self._freq_host = [0] * (num_layers * max_experts)

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        if now % self.decay_period == 0:
            self._freq_host = [f >> 1 for f in self._freq_host]
        for e in present:
            self._freq_host[layer * self._max_experts + e] += 1

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return -self._freq_host[layer * self._max_experts + expert]

    def host_victim_key(self, owner_flat: int) -> int:
        return self._freq_host[owner_flat]

    def host_accept(self, cand_flat: int, victim_flat: int) -> bool:
        return self._freq_host[cand_flat] >= self._freq_host[victim_flat] + self.admit_margin

    def host_state(self) -> dict[str, list[int]]:
        return {"freq": list(self._freq_host)}


POLICIES = {"lru": LRUPolicy, "freq": FreqDecayPolicy}


def make_policy(name: str, **kwargs: int) -> Policy:
    """A fresh policy by name ("lru" or "freq")."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is not one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)  # type: ignore[no-any-return]
