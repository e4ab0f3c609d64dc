"""What every planner policy shares: the `Policy` protocol (device form + host form), the "never routed" tick,
and the pool-size check of policies sized to a pool. The policies themselves: `policies.py` (LRU, frequency,
aging, the registry), `cycle_lru.py`, `policy_adaptive.py`."""

from __future__ import annotations

from typing import Protocol

import torch

NEVER = -(1 << 40)  # "never routed" tick: far enough back that every age test passes


class Policy(Protocol):
    """A planner policy. `bind` allocates the device state once, before any capture."""

    name: str

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None: ...

    def clock_reset(self, shift: int) -> None:
        """The planner renumbered its clock at a boundary (outside capture): tick t of the old numbering is
        t + shift in the new one. Shift or forget clock-valued state."""
        ...

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        """`present [E]` bool (routed this step), `now [1]` int64. In place."""
        ...

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        """`[E]` int64 key, smaller = admitted first; None = by expert id."""
        ...

    def victim_key(
        self, row_owner: torch.Tensor, row_stamp: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor | None:
        """`row_owner [R]` flat ids (-1 free), `row_stamp [R]`, `now [1]` -> `[R]` int64 key, smaller =
        evicted first (free rows always go first); None = by stamp only (LRU)."""
        ...

    def accept(self, cand_flat: torch.Tensor, victim_key: torch.Tensor) -> torch.Tensor | None:
        """`[P]` flat ids of paired candidates and their (non-free) victims' keys -> `[P]` bool admit;
        None = always."""
        ...

    def evicted(self, victim_key: torch.Tensor, evicted: torch.Tensor) -> None:
        """After a step's pairing: `[P]` keys of the paired victims and which of them were evicted."""
        ...

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Device state (for comparison with the twin and for save/restore at boundaries)."""
        ...

    # Host form (the twin's): state in plain Python.
    def host_reset(self, num_layers: int, max_experts: int) -> None: ...

    def host_observe(self, layer: int, present: list[int], now: int) -> None: ...

    def host_candidate_key(self, layer: int, expert: int) -> int: ...

    def host_victim_key(self, owner_flat: int, stamp: int, now: int) -> int: ...

    def host_accept(self, cand_flat: int, victim_key: int) -> bool: ...

    def host_evicted(self, victim_key: int) -> None: ...

    def host_state(self) -> dict[str, list[int]]: ...


def shift_ticks(ticks: torch.Tensor | None, shift: int) -> None:
    """`clock_reset(shift)` for a tensor of clock ticks: every tick moves by `shift`, NEVER stays NEVER."""
    if ticks is not None:
        ticks.copy_(torch.where(ticks == NEVER, NEVER, ticks + shift))


def check_policy_rows(policy: Policy, num_rows: int) -> None:
    """Refuse a policy built for another pool size (those with a `num_rows`, e.g. the adaptive policy)."""
    built_for = getattr(policy, "num_rows", num_rows)
    if built_for != num_rows:
        raise ValueError(
            f"policy {policy.name!r} was built with num_rows={built_for}; the pool has {num_rows} rows"
        )
