"""Cost-aware choice of the speculative depth: draft only where a verify step pays for what it reads.

With a pool, a verify step of `bs x (1 + d)` tokens reads the distinct experts of all its lanes; at small batch
sizes and small pools each draft lane brings several experts of its own, often from the host, and a depth-3
step can cost more than the 2.2 tokens it yields (docs/BENCHMARKS.md, "How much MTP can gain").
SGLang 0.5.23's adaptive speculation picks the depth from the acceptance length alone; `SpecGovernor` picks the
depth whose tokens per request per second is highest. A depth's seconds per step are measured on steps run at
that depth; its tokens per request come from one acceptance estimate shared by every depth (accepted drafts over
accepted drafts plus rejections, per-draft chain acceptance, decayed), since a handful of probe steps at batch
size 1 cannot measure tokens per step (one request accepts 0..d drafts) but measures time well. The schedule:

- it runs one depth (the current one), keeping an exponential average of its seconds per step;
- it probes the current depth's neighbours in the candidate order (`probe_steps` steps each, the first not
  timed, see below): a neighbour
  never measured at once, a measured one after an interval that doubles each time its probe loses (up to
  `max_probe_interval` steps), so a losing depth costs less and less while a change of conditions (acceptance,
  hit rate, traffic) is still noticed;
- a probe that wins by `margin` makes the probed depth current (its neighbours' intervals restart);
- a step whose depth differs from the step before is not timed, for the probed and the running depth alike: a
  change of depth changes the working set, and the pool needs a step to follow (timing the step back from a
  probe would make the running depth look slower than it is, and probes would win by mistake).
Tokens per request per second rises with the depth and then falls (tokens grow less and less per draft, a
step's cost grows with the experts each draft adds), so probing neighbours is a hill climb: from the initial
depth it walks to the best one, and it never pays for probes of depths far from it.

Host-side, plain Python, no torch: the caller measures a step (CUDA events, or the wall time between two verify
completions) and calls `observe` with each request's accepted drafts; `choose` gives the depth of the next
step. Deterministic for a given sequence of observations (tests replay cost models through it). The shared
acceptance assumes one acceptance probability per draft position; where later drafts are accepted less often
than earlier ones, deeper depths are estimated optimistically (their probes still measure their time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def expected_chain_tokens(depth: int, accept: float) -> float:
    """Expected tokens per request of a verify step with `depth` chain drafts, each accepted w.p. `accept`
    while the chain lasts: 1 + accept + ... + accept^depth."""
    return sum(accept**i for i in range(depth + 1))


@dataclass
class _Arm:
    """What the governor knows of one depth: its seconds per step (None before it ran) and probe schedule."""

    seconds: float | None = None  # mean of its last probe, then an exponential average while it runs
    interval: int = 0  # steps between probes of this depth while another depth runs
    due: int = 0  # step count at which the next probe starts


class SpecGovernor:
    """Chooses the number of draft tokens per request of each verify step by tokens per request per second.

    `candidates`: depths (draft tokens per request) the caller can run, e.g. (0, 1, 3); 0 means no drafting.
    `initial`: the depth measured first (default: the largest). Contract: `choose()` gives the depth of the next
    step (no side effect but starting a due probe: calling it twice is fine); after a step ran, call
    `observe(depth, accepted, seconds)` with the depth it ran at, each request's accepted drafts (0..depth) and
    its time. A caller whose steps overlap (the next step chosen before the last one's outcome is known) passes
    each step's own depth: a time at a depth that is neither probed nor running (a step chosen before a
    switch) teaches its acceptance only. Bad outcomes (unknown depth, accepted outside 0..depth, time <= 0) are
    refused with ValueError; a step longer than `max_step_seconds` (an idle gap, a prefill in between), or at
    another depth than the step observed before it, teaches its acceptance only.
    """

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        initial: int | None = None,
        ema_alpha: float = 0.2,
        acceptance_decay: float = 0.995,
        probe_steps: int = 3,
        min_probe_interval: int = 16,
        max_probe_interval: int = 1024,
        margin: float = 0.02,
        max_step_seconds: float = 1.0,
    ) -> None:
        depths = sorted(set(int(d) for d in candidates))
        if not depths or depths[0] < 0:
            raise ValueError(f"candidates={list(candidates)!r}: need at least one depth, all >= 0")
        if initial is None:
            initial = depths[-1]
        if initial not in depths:
            raise ValueError(f"initial={initial} is not one of the candidates {depths}")
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha={ema_alpha} must be in (0, 1]")
        if not 0.0 < acceptance_decay <= 1.0:
            raise ValueError(f"acceptance_decay={acceptance_decay} must be in (0, 1]")
        if probe_steps < 2:
            raise ValueError(
                f"probe_steps={probe_steps} must be >= 2 (the first step of a probe is not timed)"
            )
        if not 1 <= min_probe_interval <= max_probe_interval:
            raise ValueError(
                f"probe intervals: need 1 <= min_probe_interval ({min_probe_interval}) <= max_probe_interval "
                f"({max_probe_interval})"
            )
        if margin < 0.0 or max_step_seconds <= 0.0:
            raise ValueError(f"margin={margin} must be >= 0 and max_step_seconds={max_step_seconds} > 0")
        self.candidates = tuple(depths)
        self.ema_alpha = ema_alpha
        self.acceptance_decay = acceptance_decay
        self.probe_steps = probe_steps
        self.min_probe_interval = min_probe_interval
        self.max_probe_interval = max_probe_interval
        self.margin = margin
        self.max_step_seconds = max_step_seconds
        self._arms = {d: _Arm(interval=min_probe_interval) for d in depths}
        self.current = initial  # the depth that runs outside probes
        self._probe: int | None = initial  # depth being measured now (None: running `current`)
        self._probe_timed = 0  # timed steps of the probe so far (it needs probe_steps - 1)
        self._probe_seconds = 0.0
        self._last_depth: int | None = None  # depth of the last observed step (a change is not timed)
        self._accepted = 0.0  # decayed counts of accepted drafts and of rejections (a chain stopped early)
        self._rejected = 0.0
        self.num_steps = 0  # observed steps
        self.num_switches = 0
        self.steps_at = {d: 0 for d in depths}  # observed steps per depth

    # -- the two calls of a step ------------------------------------------------------------------------------
    def choose(self) -> int:
        """The depth of the next step."""
        if self._probe is None:
            due = [d for d in self._neighbours(self.current) if self._arms[d].due <= self.num_steps]
            if due:
                self._start_probe(min(due, key=lambda d: self._arms[d].due))
        return self._probe if self._probe is not None else self.current

    def observe(self, depth: int, accepted: Sequence[int], seconds: float) -> None:
        """One step's outcome at `depth`: each request's accepted drafts (0..depth) and the step's duration."""
        if depth not in self._arms:
            raise ValueError(f"observe(depth={depth}): not one of the candidates {list(self.candidates)}")
        if not accepted or any(not 0 <= int(n) <= depth for n in accepted):
            raise ValueError(
                f"observe(depth={depth}): accepted drafts per request {list(accepted)} not in 0..{depth}"
            )
        if seconds <= 0.0:
            raise ValueError(f"observe: seconds={seconds} must be > 0")
        self.num_steps += 1
        self.steps_at[depth] += 1
        if depth > 0:
            self._accepted = self.acceptance_decay * self._accepted + sum(int(n) for n in accepted)
            self._rejected = self.acceptance_decay * self._rejected + sum(int(n) < depth for n in accepted)
        changed, self._last_depth = depth != self._last_depth, depth
        if seconds > self.max_step_seconds or changed:
            return
        if self._probe is not None:
            if depth == self._probe:
                self._probe_step(seconds)
        elif depth == self.current:
            arm = self._arms[depth]
            assert arm.seconds is not None, depth
            arm.seconds = (1.0 - self.ema_alpha) * arm.seconds + self.ema_alpha * seconds

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float | None:
        """Estimated per-draft acceptance (chain), or None before any drafted step."""
        total = self._accepted + self._rejected
        return None if total == 0.0 else self._accepted / total

    def tokens_per_request(self, depth: int) -> float | None:
        """Expected tokens per request of a step at `depth` (1 + accepted drafts); None while unknown."""
        p = self.acceptance
        if depth == 0:
            return 1.0
        return None if p is None else expected_chain_tokens(depth, p)

    def rates(self) -> dict[int, float | None]:
        """Tokens per request per second of each depth (None: not measured yet)."""
        return {d: self._rate_or_none(d) for d in self.candidates}

    @property
    def probing(self) -> int | None:
        """The depth being probed, or None while the best depth runs."""
        return self._probe

    # -- internals ----------------------------------------------------------------------------------------------
    def _start_probe(self, depth: int) -> None:
        self._probe = depth
        self._probe_timed = 0
        self._probe_seconds = 0.0

    def _probe_step(self, seconds: float) -> None:
        self._probe_timed += 1
        self._probe_seconds += seconds
        if self._probe_timed < self.probe_steps - 1:
            return
        depth = self._probe
        assert depth is not None
        self._probe = None
        arm = self._arms[depth]
        arm.seconds = self._probe_seconds / (self.probe_steps - 1)
        if depth == self.current:  # the initial depth's first measurement
            return
        if self._rate(depth) > self._rate(self.current) * (1.0 + self.margin):
            self._settle(depth)
        else:
            arm.interval = min(2 * arm.interval, self.max_probe_interval)
            arm.due = self.num_steps + arm.interval

    def _settle(self, depth: int) -> None:
        """Run `depth` from now on; its neighbours are probed now if never measured, else after the shortest
        interval."""
        self.num_switches += 1
        self.current = depth
        for d in self._neighbours(depth):
            arm = self._arms[d]
            arm.interval = self.min_probe_interval
            arm.due = self.num_steps + (self.min_probe_interval if arm.seconds is not None else 0)

    def _neighbours(self, depth: int) -> list[int]:
        i = self.candidates.index(depth)
        return list(self.candidates[max(i - 1, 0) : i]) + list(self.candidates[i + 1 : i + 2])

    def _rate_or_none(self, depth: int) -> float | None:
        seconds, tokens = self._arms[depth].seconds, self.tokens_per_request(depth)
        return None if seconds is None or tokens is None else tokens / seconds

    def _rate(self, depth: int) -> float:
        rate = self._rate_or_none(depth)
        return -1.0 if rate is None else rate
