"""Cost-aware choice of the speculative depth: draft only where a verify step pays for what it reads.

With a pool, a verify step of `bs x (1 + d)` tokens reads the distinct experts of all its lanes; at small batch
sizes and small pools each draft lane brings several experts of its own, often from the host, and a depth-3
step can cost more than the 2.2 tokens it yields (DESIGN.md §7, docs/BENCHMARKS.md "How much MTP can gain").
SGLang 0.5.23's adaptive speculation picks the depth from the acceptance length alone; `SpecGovernor` picks the
depth whose measured tokens per request per second is highest:

- it measures every candidate depth once (`probe_steps` steps each, the first of a probe not counted: a switch
  of depth changes the working set, and the pool needs a step to follow);
- then runs the best depth, keeping an exponential average of its tokens per request and seconds per step;
- and re-probes every other depth after an interval that doubles each time the probe loses (up to
  `max_probe_interval` steps), so a losing depth costs less and less while a change of conditions (acceptance,
  hit rate, traffic) is still noticed. A probe that wins switches depth and resets every interval.

Host-side, plain Python, no torch: the caller measures a step (CUDA events, or the wall time between two verify
completions) and calls `observe`; `choose` gives the depth of the next step. Deterministic for a given sequence
of observations (tests replay cost models through it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class _Arm:
    """What the governor knows of one depth: its rate (tokens per request per second, None before it ran)."""

    rate: float | None = None
    tokens_avg: float = 0.0  # exponential averages while this depth is the one running
    seconds_avg: float = 0.0
    interval: int = 0  # steps between probes of this depth while another depth runs
    due: int = 0  # step count at which the next probe starts


class SpecGovernor:
    """Chooses the number of draft tokens per request of each verify step by measured tokens per second.

    `candidates`: depths (draft tokens per request) the caller can run, e.g. (0, 1, 3); 0 means no drafting.
    `initial`: the depth measured first (default: the largest). Contract: `choose()` gives the depth of the next
    step (no side effect but starting a due probe: calling it twice is fine); after a step ran, call
    `observe(depth, tokens_per_request, seconds)` with the depth it ran at. A caller whose steps overlap (the
    next step chosen before the last one's outcome is known) passes each step's own depth: an outcome at a
    depth that is neither probed nor running (a step chosen before a switch) counts steps but changes no
    estimate. Times <= 0 and tokens < 1 are refused (ValueError); a step longer than `max_step_seconds` (an
    idle gap, a prefill in between) is ignored.
    """

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        initial: int | None = None,
        ema_alpha: float = 0.2,
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
        if probe_steps < 2:
            raise ValueError(
                f"probe_steps={probe_steps} must be >= 2 (the first step of a probe is not counted)"
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
        self.probe_steps = probe_steps
        self.min_probe_interval = min_probe_interval
        self.max_probe_interval = max_probe_interval
        self.margin = margin
        self.max_step_seconds = max_step_seconds
        self._arms = {d: _Arm(interval=min_probe_interval) for d in depths}
        self._order = [initial] + [d for d in reversed(depths) if d != initial]  # first measurements
        self.current = initial  # the depth that runs outside probes
        self._probe: int | None = initial  # depth being measured now (None: running `current`)
        self._probe_left = probe_steps
        self._probe_tokens = 0.0
        self._probe_seconds = 0.0
        self.num_steps = 0  # observed steps
        self.num_switches = 0
        self.steps_at = {d: 0 for d in depths}  # observed steps per depth

    # -- the two calls of a step ------------------------------------------------------------------------------
    def choose(self) -> int:
        """The depth of the next step."""
        if self._probe is None:
            due = [d for d in self.candidates if d != self.current and self._arms[d].due <= self.num_steps]
            if due:
                self._start_probe(min(due, key=lambda d: self._arms[d].due))
        return self._probe if self._probe is not None else self.current

    def observe(self, depth: int, tokens_per_request: float, seconds: float) -> None:
        """One step's outcome at `depth`: accepted tokens per request (>= 1) and its duration."""
        if depth not in self._arms:
            raise ValueError(f"observe(depth={depth}): not one of the candidates {list(self.candidates)}")
        if seconds <= 0.0 or tokens_per_request < 1.0:
            raise ValueError(
                f"observe: seconds={seconds} must be > 0 and tokens_per_request={tokens_per_request} >= 1"
            )
        self.num_steps += 1
        self.steps_at[depth] += 1
        if seconds > self.max_step_seconds:
            return
        if self._probe is not None:
            if depth == self._probe:
                self._probe_step(tokens_per_request, seconds)
        elif depth == self.current:
            self._run_step(tokens_per_request, seconds)

    # -- state ------------------------------------------------------------------------------------------------
    def rates(self) -> dict[int, float | None]:
        """Tokens per request per second last measured for each depth (None: not measured yet)."""
        return {d: arm.rate for d, arm in self._arms.items()}

    @property
    def probing(self) -> int | None:
        """The depth being probed, or None while the best depth runs."""
        return self._probe

    # -- internals ----------------------------------------------------------------------------------------------
    def _start_probe(self, depth: int) -> None:
        self._probe = depth
        self._probe_left = self.probe_steps
        self._probe_tokens = 0.0
        self._probe_seconds = 0.0

    def _probe_step(self, tokens: float, seconds: float) -> None:
        first = self._probe_left == self.probe_steps
        self._probe_left -= 1
        if not first:  # the step after a switch pays the working set's change: not the depth's steady cost
            self._probe_tokens += tokens
            self._probe_seconds += seconds
        if self._probe_left > 0:
            return
        depth = self._probe
        assert depth is not None
        self._probe = None
        arm = self._arms[depth]
        arm.rate = self._probe_tokens / self._probe_seconds
        arm.tokens_avg = self._probe_tokens / (self.probe_steps - 1)
        arm.seconds_avg = self._probe_seconds / (self.probe_steps - 1)
        if self._order:  # the first round: measure every depth once, then settle on the best
            self._order = [d for d in self._order if d != depth]
            if self._order:
                self._start_probe(self._order[0])
                return
            self._settle(max(self.candidates, key=lambda d: self._rate(d)))
            return
        best = self._rate(self.current)
        if arm.rate > best * (1.0 + self.margin):
            self._settle(depth)
        else:
            arm.interval = min(2 * arm.interval, self.max_probe_interval)
            arm.due = self.num_steps + arm.interval

    def _run_step(self, tokens: float, seconds: float) -> None:
        arm = self._arms[self.current]
        a = self.ema_alpha
        arm.tokens_avg = (1.0 - a) * arm.tokens_avg + a * tokens
        arm.seconds_avg = (1.0 - a) * arm.seconds_avg + a * seconds
        arm.rate = arm.tokens_avg / arm.seconds_avg

    def _settle(self, depth: int) -> None:
        """Run `depth` from now on; every other depth is probed again after the shortest interval."""
        if depth != self.current:
            self.num_switches += 1
        self.current = depth
        for d, arm in self._arms.items():
            arm.interval = self.min_probe_interval
            arm.due = self.num_steps + self.min_probe_interval if d != depth else 0

    def _rate(self, depth: int) -> float:
        rate = self._arms[depth].rate
        return -1.0 if rate is None else rate
