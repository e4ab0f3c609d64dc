"""One `SpecGovernor` per batch size, learning from each other: `GovernorFamily`.

A step's time grows with its batch, so each batch size needs its own step times and its own governor. Alone,
each would also learn the acceptance from nothing and probe every depth at its first steps: a server whose
batch size wanders over 1..32 would pay 32 times the probes a fixed batch size pays. The family shares what
does not depend on the batch size and passes on what probably carries over to a neighbour:

- one acceptance estimate (`spec_acceptance.AcceptanceEstimate`) for all: the draft model and the text decide
  it, not the batch size;
- a batch size seen for the first time starts from the governor of the nearest batch size within a factor of
  `MAX_PRIOR_RATIO` that ran its running depth for `probe_steps` steps itself (ties: the smaller; else it starts
  fresh, at the smallest depth):
  at its running depth, with the deeper depths whose probes lost there probed first after half the interval
  they reached (`SpecGovernor(prior=...)`). Its own step times it measures itself;
- a probe lost at one batch size defers the same probe at the batch sizes within that factor running the same
  depth, to at least half the loser's new interval (`SpecGovernor.defer_probe`).

Why the limits (`bench/spec_family_model.py`, CPU cost models of the H200's steps, 2000 steps, 20 seeds): where
drafting wins at bs 16 and loses at bs 1-4, a server that ran 300 steps at bs 16 and then at bs 1-4 (`burst`)
kept 0.978x of depth 0 (worst seed 0.920x) when the small batch sizes started at bs 16's depth 3 and waited to
probe shallower depths; with these rules 0.996x (worst 0.984x; independent governors 0.991x). The price, where
drafting wins everywhere (a made-up cost model): 1.330x instead of 1.374x of depth 0 on that trace
(independent 1.331x), and over a batch size wandering by 1-3 at a time, 1.330x instead of 1.347x (independent
1.297x).

A family's state (every governor's, the shared estimate's counts) is kept across server restarts by
`spec_state` (`state_dict`, `from_state`).

Host-side, plain Python; deterministic for a given sequence of calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pooled_runner.spec_acceptance import AcceptanceEstimate
from pooled_runner.spec_governor import SpecGovernor

# a new batch size starts from a neighbour's depth and verdicts only within this factor of batch sizes: drafting
# wins at bs 16 and loses at bs 1 on the same pool (docs/BENCHMARKS.md, bench_spec_governed)
MAX_PRIOR_RATIO = 2


class GovernorFamily:
    """Governors by batch size. `share=False` makes every governor independent (as before the family; for
    comparisons; `acceptance` is then None). `acceptance_decay` and `governor_kwargs` are `SpecGovernor`'s."""

    def __init__(
        self, *, share: bool = True, acceptance_decay: float = 0.995, **governor_kwargs: Any
    ) -> None:
        if {"acceptance", "prior", "initial", "on_probe_lost"} & governor_kwargs.keys():
            raise ValueError(
                "GovernorFamily: acceptance, prior, initial and on_probe_lost are the family's to set"
            )
        self.acceptance_decay = acceptance_decay
        self.acceptance = AcceptanceEstimate(acceptance_decay) if share else None
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
        prior = self.prior_for(batch_size) if self.acceptance is not None else None
        created = self._new_governor(batch_size, candidates, prior=prior)
        self.governors[batch_size] = created
        return created

    def _new_governor(
        self,
        batch_size: int,
        candidates: Sequence[int],
        *,
        prior: SpecGovernor | None = None,
        initial: int | None = None,
    ) -> SpecGovernor:
        """A governor of `batch_size` wired to this family (its acceptance, its loss passing), not registered;
        `initial`: its running depth (a restored one's, `spec_state`)."""
        if self.acceptance is None:
            return SpecGovernor(
                candidates, initial=initial, acceptance_decay=self.acceptance_decay, **self.governor_kwargs
            )
        return SpecGovernor(
            candidates,
            initial=initial,
            acceptance=self.acceptance,
            prior=prior,
            on_probe_lost=functools.partial(self._pass_on_loss, batch_size),
            **self.governor_kwargs,
        )

    def state_dict(self) -> dict[str, Any]:
        """Its state, JSON-ready: the shared acceptance counts, every governor's state (`spec_state`)."""
        from pooled_runner import spec_state  # spec_state imports this module

        return spec_state.family_state(self)

    @classmethod
    def from_state(cls, state: dict[str, Any], **kwargs: Any) -> GovernorFamily:
        """A family `GovernorFamily(**kwargs)` continuing from `state_dict()`'s `state` (`spec_state.
        family_from_state`: the same sharing and settings; probes in flight dropped). ValueError if it does not
        fit."""
        from pooled_runner import spec_state

        return spec_state.family_from_state(state, **kwargs)

    def _pass_on_loss(self, batch_size: int, depth: int, interval: int) -> None:
        """The probe of `depth` at `batch_size` lost: the governors of batch sizes within a factor of
        MAX_PRIOR_RATIO that run the same depth wait at least half its interval before probing `depth`
        (`SpecGovernor.defer_probe`)."""
        loser = self.governors[batch_size]
        for b, governor in self.governors.items():
            if b != batch_size and _near(b, batch_size) and governor.current == loser.current:
                governor.defer_probe(depth, interval)

    def prior_for(self, batch_size: int) -> SpecGovernor | None:
        """The governor a new `batch_size` starts from: among the batch sizes within a factor of MAX_PRIOR_RATIO
        whose governor ran its running depth itself for `probe_steps` steps (not one that only inherited it: a
        burst draining 16 -> 9 -> 5 -> 3 would otherwise pass bs 16's depth down the chain), the nearest (ties:
        the smaller); None if there is none."""
        eligible = [
            b
            for b, governor in self.governors.items()
            if _near(b, batch_size) and governor.steps_at[governor.current] >= governor.probe_steps
        ]
        if not eligible:
            return None
        return self.governors[min(eligible, key=lambda b: (abs(b - batch_size), b))]


def _near(a: int, b: int) -> bool:
    """Batch sizes `a` and `b` within a factor of MAX_PRIOR_RATIO of each other."""
    return max(a, b) <= MAX_PRIOR_RATIO * min(a, b)
