"""One `SpecGovernor` per batch size, learning from each other: `GovernorFamily`.

A step's time grows with its batch, so each batch size needs its own step times and its own governor. Alone,
each would also learn the acceptance from nothing and probe every depth at its first steps: a server whose
batch size wanders over 1..32 would pay 32 times the probes a fixed batch size pays. The family shares what
does not depend on the batch size and passes on what probably carries over to a neighbour:

- one acceptance estimate (`spec_acceptance.AcceptanceEstimate`) for all: the draft model and the text decide
  it, not the batch size;
- a batch size seen for the first time starts from the governor of the nearest batch size that has one (ties:
  the smaller): at its running depth, with the depths whose probes lost there probed first after half the
  interval they reached (`SpecGovernor(prior=...)`). Its own step times it measures itself.

Host-side, plain Python; deterministic for a given sequence of calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pooled_runner.spec_acceptance import AcceptanceEstimate
from pooled_runner.spec_governor import SpecGovernor


class GovernorFamily:
    """Governors by batch size. `share=False` makes every governor independent (as before the family; for
    comparisons). `acceptance_decay` and `governor_kwargs` are `SpecGovernor`'s."""

    def __init__(
        self, *, share: bool = True, acceptance_decay: float = 0.995, **governor_kwargs: Any
    ) -> None:
        if "acceptance" in governor_kwargs or "prior" in governor_kwargs or "initial" in governor_kwargs:
            raise ValueError("GovernorFamily: acceptance, prior and initial are the family's to set")
        self.share = share
        self.acceptance_decay = acceptance_decay
        self.acceptance = AcceptanceEstimate(acceptance_decay)
        self.governor_kwargs = governor_kwargs
        self.governors: dict[int, SpecGovernor] = {}

    def governor(self, batch_size: int, candidates: Sequence[int]) -> SpecGovernor:
        """The governor of `batch_size` (> 0), created at first use among `candidates` (later calls: the
        candidates it was created with are kept)."""
        if batch_size <= 0:
            raise ValueError(f"GovernorFamily.governor: batch_size={batch_size} must be > 0")
        found = self.governors.get(batch_size)
        if found is not None:
            return found
        if self.share:
            created = SpecGovernor(
                candidates, acceptance=self.acceptance, prior=self.nearest(batch_size), **self.governor_kwargs
            )
        else:
            created = SpecGovernor(candidates, acceptance_decay=self.acceptance_decay, **self.governor_kwargs)
        self.governors[batch_size] = created
        return created

    def nearest(self, batch_size: int) -> SpecGovernor | None:
        """The governor of the batch size nearest to `batch_size` (ties: the smaller), or None."""
        if not self.governors:
            return None
        return self.governors[min(self.governors, key=lambda b: (abs(b - batch_size), b))]
