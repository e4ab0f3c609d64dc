"""Cost-aware choice of the speculative depth: draft only where a verify step pays for what it reads.

With a pool, a verify step of `bs x (1 + d)` tokens reads the distinct experts of all its lanes; at small batch
sizes and small pools each draft lane brings several experts of its own, often from the host, and a depth-3
step can cost more than the 2.2 tokens it yields (docs/BENCHMARKS.md, "How much MTP can gain").
SGLang 0.5.23's adaptive speculation picks the depth from the acceptance length alone; `SpecGovernor` picks the
depth whose tokens per request per second is highest. A depth's seconds per step are measured on steps run at
that depth; its tokens per request come from one acceptance estimate shared by every depth (accepted drafts over
accepted drafts plus rejections, per-draft chain acceptance, decayed), since a handful of probe steps at batch
size 1 cannot measure tokens per step (one request accepts 0..d drafts) but measures time well. The schedule:

- it starts at the smallest depth (no drafting, where 0 is a candidate) and runs one depth (the current one),
  keeping an exponential average of its seconds per step and of their squared relative deviation;
- it probes the current depth's neighbours in the candidate order, and the smallest depth: a depth never
  measured at once, a measured one after an interval that doubles each time its probe loses, or quadruples
  when it lost by more than 10% (up to `max_probe_interval` steps), so a losing depth costs less and less while a change of conditions (acceptance,
  hit rate, traffic) is still noticed;
- a probe lasts at least `probe_steps` steps (the first is not timed, see below) and ends as soon as it is
  decided: it loses once its estimated rate falls short of the current's plus `margin` by `LOSS_PROOF`
  standard errors of the step times (a clear loss in a step or two; a close race goes on, and costs little);
  a probe of a deeper depth wins only when its advantage exceeds `margin` by `confidence` standard errors
  (step-time noise of both depths, and the acceptance estimate's own uncertainty), so a lucky pair of steps
  or a young acceptance estimate cannot make drafting look better than it is; a probe of a shallower depth
  needs half that, on the step-time noise alone (doubt about the acceptance counts against drafting). A probe
  still undecided after `max_probe_steps` steps ends: behind, it loses; ahead, its timed steps carry over to
  the depth's next probe against the same running depth, which comes after the same interval (not a longer
  one), and judges them with its own (after one fresh step at least), so a gain of a few percent is proven
  over a few probes instead of being lost to each probe's few steps. Drafting must prove that it pays, more
  than not drafting must: at batch size 1, where step times are noisy, gains of a few percent are given up;
- a step at a deeper depth does all the work of a shallower one and more, so a judgement never takes a deeper
  probe's step as cheaper than the shallower current's: a deeper probe timed faster measured a change of
  conditions since the current was timed (the first decode steps after start-up are slow, a co-tenant left),
  and it is judged at the current's step time, so it can win on its extra tokens alone;
- a step whose depth differs from the step before is not timed, for the probed and the running depth alike: a
  change of depth changes the working set, and the pool needs a step to follow (timing the step back from a
  probe would make the running depth look slower than it is, and probes would win by mistake). Neither is a step
  the caller marks untimed, nor one longer than `outlier_factor` times its depth's average (a prefill or an idle
  gap in between); three such steps in a row are taken as a change of conditions: they restart the running
  average, or become the probe's timed steps.
Tokens per request per second rises with the depth and then falls (tokens grow less and less per draft, a
step's cost grows with the experts each draft adds), so probing neighbours is a hill climb, and probing the
smallest depth too keeps the climb from resting on a local peak above it.

Host-side, plain Python, no torch: the caller measures a step (CUDA events, or the wall time between two verify
completions) and calls `observe` with each request's accepted drafts; `choose` gives the depth of the next
step. Deterministic for a given sequence of observations (tests replay cost models through it). The shared
acceptance assumes one acceptance probability per draft position; where later drafts are accepted less often
than earlier ones, deeper depths are estimated optimistically (their probes still measure their time).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pooled_runner.spec_acceptance import AcceptanceEstimate, expected_chain_tokens

# floor of a depth's step-time variance (relative): two equal samples prove little
MIN_RELATIVE_VARIANCE = 0.02**2
# steps in a row dropped as outliers (longer than `outlier_factor` x their depth's average) before the running
# average restarts from them (a change of conditions)
MAX_OUTLIERS_IN_A_ROW = 3
# a probe below this share of the current rate loses clearly: its interval grows 4x, not 2x
CLEAR_LOSS = 0.9
# a probe loses once it is behind the running depth's rate (plus margin) by this many standard errors of the
# step times: a quarter of the proof a deeper probe's win needs at the default confidence of 2. Zero (a loss as
# soon as the estimate is behind) made a young, noisy estimate end close races, and the doubled intervals kept
# a depth that wins by 6-12% from being reached for hundreds of steps; a full standard error let a depth that
# loses by 3% run probes long enough to cost more than the races won (cost models: tests/test_spec_governor*.py)
LOSS_PROOF = 0.5


@dataclass
class _Arm:
    """What the governor knows of one depth: its step time (None before it ran) and probe schedule."""

    seconds: float | None = None  # mean of its last probe, then an exponential average while it runs
    relative_variance: float = MIN_RELATIVE_VARIANCE  # of one step's time, (x - mean)^2 / mean^2, averaged
    num_timed: int = 0  # timed steps behind `seconds` (its standard error)
    outliers: int = 0  # consecutive running steps dropped as outliers
    interval: int = 0  # steps between probes of this depth while another depth runs
    num_lost: int = 0  # probes of this depth lost in this governor (not deferrals taken from a neighbour)
    due: int = 0  # step count at which the next probe starts
    # an undecided probe's timed step times (the next probe of this depth against the same running depth
    # starts from them), and that running depth
    carried: list[float] = field(default_factory=list)
    carried_against: int | None = None


@dataclass
class _Probe:
    depth: int
    reference: float | None  # the depth's stored step time: a step over outlier_factor x it is an outlier
    timed: list[float] = field(default_factory=list)  # timed step times (carried ones first)
    num_fresh: int = 0  # timed steps of this probe (not carried)
    seen: list[float] = field(default_factory=list)  # every step time at this depth during the probe
    outliers: list[float] = field(default_factory=list)  # the outliers in a row just before
    log_ratio: float = 0.0  # log(estimated rate / current rate) at the last judgement


class SpecGovernor:
    """Chooses the number of draft tokens per request of each verify step by tokens per request per second.

    `candidates`: depths (draft tokens per request) the caller can run, e.g. (0, 1, 3); 0 means no drafting.
    `initial`: the depth measured first (default: the smallest). Contract: `choose()` gives the depth of the
    next step (no side effect but starting a due probe: calling it twice is fine); after a step ran, call
    `observe(depth, accepted, seconds)` with the depth it ran at, each request's accepted drafts (0..depth) and
    its time. A caller whose steps overlap (the next step chosen before the last one's outcome is known) passes
    each step's own depth: a time at a depth that is neither probed nor running (a step chosen before a
    switch) teaches its acceptance only. Bad outcomes (unknown depth, accepted outside 0..depth, time <= 0) are
    refused with ValueError; `timed=False`, a step at another depth than the step observed before it, or an
    outlier (module docstring) teaches its acceptance only.
    `acceptance`: an estimate to share with other governors (`spec_family.GovernorFamily`: one per batch size;
    its own decay then rules, `acceptance_decay` is not used); None: one of its own. `prior`: the governor of a
    neighbouring batch size; this one starts at its running depth (unless `initial` is given, or that depth is
    not a candidate here: then at the smallest, nothing deferred) and first probes a deeper depth whose probes
    lost there after half the interval they reached there (`_defer_probes_lost_by`). `on_probe_lost(depth,
    interval)`: called when a probe of `depth` lost and waits `interval` steps (the family passes it on to the
    neighbours, `defer_probe`).
    """

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        initial: int | None = None,
        ema_alpha: float = 0.1,
        acceptance_decay: float = 0.995,
        probe_steps: int = 3,
        max_probe_steps: int = 32,
        min_probe_interval: int = 32,
        max_probe_interval: int = 1024,
        margin: float = 0.02,
        confidence: float = 2.0,
        outlier_factor: float = 3.0,
        acceptance: AcceptanceEstimate | None = None,
        prior: SpecGovernor | None = None,
        on_probe_lost: Callable[[int, int], None] | None = None,
    ) -> None:
        depths = sorted(set(int(d) for d in candidates))
        if not depths or depths[0] < 0:
            raise ValueError(f"candidates={list(candidates)!r}: need at least one depth, all >= 0")
        if initial is None:
            initial = prior.current if prior is not None and prior.current in depths else depths[0]
        if initial not in depths:
            raise ValueError(f"initial={initial} is not one of the candidates {depths}")
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha={ema_alpha} must be in (0, 1]")
        if not 2 <= probe_steps <= max_probe_steps:
            raise ValueError(
                f"probe_steps={probe_steps}, max_probe_steps={max_probe_steps}: need 2 <= probe_steps <= "
                "max_probe_steps (the first step of a probe is not timed)"
            )
        if not 1 <= min_probe_interval <= max_probe_interval:
            raise ValueError(
                f"probe intervals: need 1 <= min_probe_interval ({min_probe_interval}) <= max_probe_interval "
                f"({max_probe_interval})"
            )
        if margin < 0.0 or confidence < 0.0 or outlier_factor <= 1.0:
            raise ValueError(
                f"margin={margin} and confidence={confidence} must be >= 0, outlier_factor={outlier_factor} > 1"
            )
        self.candidates = tuple(depths)
        self.ema_alpha = ema_alpha
        self.probe_steps = probe_steps
        self.max_probe_steps = max_probe_steps
        self.min_probe_interval = min_probe_interval
        self.max_probe_interval = max_probe_interval
        self.margin = margin
        self.confidence = confidence
        self.outlier_factor = outlier_factor
        self._arms = {d: _Arm(interval=min_probe_interval) for d in depths}
        self.current: int = initial  # the depth that runs outside probes
        # the depth being measured now (None: running `current`)
        self._probe: _Probe | None = _Probe(initial, None)
        self._last_depth: int | None = None  # depth of the last observed step (a change is not timed)
        # per-draft acceptance (decayed counts of accepted drafts and rejections), possibly shared with the
        # governors of other batch sizes
        self.acceptance_estimate = AcceptanceEstimate(acceptance_decay) if acceptance is None else acceptance
        self.on_probe_lost = on_probe_lost
        self.num_steps = 0  # observed steps
        self.num_switches = 0
        self.steps_at = {d: 0 for d in depths}  # observed steps per depth
        if prior is not None:
            self._defer_probes_lost_by(prior)

    # -- the two calls of a step ------------------------------------------------------------------------------
    def choose(self) -> int:
        """The depth of the next step."""
        if self._probe is None:
            due = [d for d in self._probe_set(self.current) if self._arms[d].due <= self.num_steps]
            if due:
                depth = min(due, key=lambda d: (self._arms[d].due, d))
                self._probe = self._start_probe(depth)
        return self._probe.depth if self._probe is not None else self.current

    def observe(self, depth: int, accepted: Sequence[int], seconds: float, *, timed: bool = True) -> None:
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
        self.acceptance_estimate.observe(depth, accepted)
        changed, self._last_depth = depth != self._last_depth, depth
        timed = timed and not changed
        probe = self._probe
        if probe is not None:
            if depth == probe.depth:
                self._probe_step(probe, seconds, timed)
        elif depth == self.current and timed:
            self._running_step(self._arms[depth], seconds)

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float | None:
        """Estimated per-draft acceptance (chain), or None before any drafted step."""
        return self.acceptance_estimate.value

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
        """The depth being probed, or None while the current depth runs."""
        return None if self._probe is None else self._probe.depth

    # -- internals ----------------------------------------------------------------------------------------------
    def _running_step(self, arm: _Arm, seconds: float) -> None:
        assert arm.seconds is not None, self.current
        if seconds > self.outlier_factor * arm.seconds:
            arm.outliers += 1
            if arm.outliers < MAX_OUTLIERS_IN_A_ROW:
                return
            arm.seconds, arm.num_timed = seconds, 0  # slow for several steps: conditions changed
        arm.outliers = 0
        deviation = ((seconds - arm.seconds) / arm.seconds) ** 2
        arm.relative_variance = max(
            (1.0 - self.ema_alpha) * arm.relative_variance + self.ema_alpha * deviation, MIN_RELATIVE_VARIANCE
        )
        arm.seconds = (1.0 - self.ema_alpha) * arm.seconds + self.ema_alpha * seconds
        arm.num_timed += 1

    def _start_probe(self, depth: int) -> _Probe:
        """A probe of `depth`, holding the timed steps of its last probe if that one ended undecided against
        the depth running now. (As they were: a ratio to the running depth's time then would carry an error
        of that time, e.g. a young first measurement, into every later probe.)"""
        arm = self._arms[depth]
        probe = _Probe(depth, arm.seconds)
        if arm.carried_against == self.current:
            probe.timed = list(arm.carried)
        arm.carried, arm.carried_against = [], None
        return probe

    def _probe_step(self, probe: _Probe, seconds: float, timed: bool) -> None:
        probe.seen.append(seconds)
        if timed and probe.reference is not None and seconds > self.outlier_factor * probe.reference:
            probe.outliers.append(seconds)
            # slow for several steps: the stored time is stale, these are the probe's steps
            if len(probe.outliers) >= MAX_OUTLIERS_IN_A_ROW:
                probe.timed, probe.outliers, probe.reference = list(probe.outliers), [], None
                probe.num_fresh = len(probe.timed)
        elif timed:
            probe.outliers.clear()
            probe.timed.append(seconds)
            probe.num_fresh += 1
        # carried steps count toward a verdict, but a probe judges only after a fresh step of its own
        judged = probe.num_fresh >= 1 and len(probe.timed) >= self.probe_steps - 1
        verdict = self._judge(probe) if judged else None
        if verdict is None and len(probe.seen) < self.max_probe_steps:
            return
        self._probe = None
        arm = self._arms[probe.depth]
        if probe.depth == self.current:  # the initial depth's first measurement (from any step, if it must)
            self._measure(arm, probe.timed or probe.seen[1:] or probe.seen)
        elif verdict == "win":
            self._measure(arm, probe.timed)
            self._settle(probe.depth)
        elif verdict is None and judged and probe.log_ratio > math.log1p(self.margin):
            # ahead, but not by enough proof yet: the next probe, as soon as a lost one's would come, goes on
            # from these steps (the latest 2 x `max_probe_steps`), so a small gain is proven in a few probes
            self._measure(arm, probe.timed)
            arm.carried, arm.carried_against = probe.timed[-2 * self.max_probe_steps :], self.current
            arm.due = self.num_steps + arm.interval
        else:
            if probe.timed:
                self._measure(arm, probe.timed)
            arm.num_lost += 1
            growth = 4 if probe.log_ratio < math.log(CLEAR_LOSS) else 2
            arm.interval = min(growth * arm.interval, self.max_probe_interval)
            arm.due = self.num_steps + arm.interval
            if self.on_probe_lost is not None:
                self.on_probe_lost(probe.depth, arm.interval)

    def _measure(self, arm: _Arm, samples: list[float]) -> None:
        arm.seconds = statistics.fmean(samples)
        arm.relative_variance = max(_relative_variance(samples), MIN_RELATIVE_VARIANCE)
        arm.num_timed = len(samples)
        arm.outliers = 0

    def _judge(self, probe: _Probe) -> str | None:
        """'win', 'lose', or None (undecided) for a probe with enough timed steps (module docstring)."""
        if probe.depth == self.current:
            return "measured"
        current = self._arms[self.current]
        tokens_probe = self.tokens_per_request(probe.depth)
        tokens_current = self.tokens_per_request(self.current)
        assert current.seconds is not None and tokens_probe is not None and tokens_current is not None
        mean = statistics.fmean(probe.timed)
        if probe.depth > self.current:
            # a step at a deeper depth does all the work of a shallower one and more (drafts, verify lanes, their
            # experts): a deeper probe timed faster than the current measured a change of conditions since the
            # current's time, not its depth. (The mirror clamp for a shallower probe could not change a verdict:
            # judged at the current's time it yields fewer tokens, and loses anyway.)
            mean = max(mean, current.seconds)
        log_ratio = math.log(tokens_probe / mean) - math.log(tokens_current / current.seconds)
        probe.log_ratio = log_ratio
        advantage = log_ratio - math.log1p(self.margin)
        variance = max(_relative_variance(probe.timed), current.relative_variance) / len(probe.timed)
        current_samples = min(current.num_timed, (2.0 - self.ema_alpha) / self.ema_alpha)
        variance += current.relative_variance / max(current_samples, 1.0)
        # a probe loses once it is behind by LOSS_PROOF standard errors, on step times alone (doubt about the
        # acceptance must not keep a losing depth running): a close race goes on, and costs little while it
        # does; a clear loss ends in a step or two
        if advantage <= -LOSS_PROOF * math.sqrt(variance):
            return "lose"
        if probe.depth < self.current:
            # drafting less (the safe direction) needs half the proof, on step times alone: doubt about the
            # acceptance counts against the deeper depth
            return "win" if advantage >= self.confidence / 2.0 * math.sqrt(variance) else None
        variance += self.acceptance_estimate.log_tokens_ratio_variance(probe.depth, self.current)
        return "win" if advantage >= self.confidence * math.sqrt(variance) else None

    def defer_probe(self, depth: int, interval: int) -> None:
        """A neighbour running this governor's depth lost a probe of the deeper `depth` and waits `interval` steps:
        probe it here not before half that from now (unless it is being probed, or due later anyway)."""
        arm = self._arms.get(depth)
        if arm is None or depth <= self.current or (self._probe is not None and self._probe.depth == depth):
            return
        half = max(interval // 2, self.min_probe_interval)
        arm.interval = max(arm.interval, half)
        arm.due = max(arm.due, self.num_steps + half)

    def _defer_probes_lost_by(self, prior: SpecGovernor) -> None:
        """Start from `prior`'s verdicts (a governor of a neighbouring batch size, running the depth this one
        starts at): a deeper depth whose own probes lost there (not a deferral it took from its own neighbour)
        is first probed here after half the interval it reached there instead of at once. A neighbour's verdict
        is weaker evidence than one's own, hence the half; shallower depths are probed as a fresh governor
        would, at once (drafting must prove that it pays here, not drafting less need not); its step times are
        not taken (they grow with the batch)."""
        if prior.current != self.current:
            return  # its verdicts are relative to another running depth
        for depth, seen in prior._arms.items():
            if seen.num_lost > 0:
                self.defer_probe(depth, seen.interval)

    def _settle(self, depth: int) -> None:
        """Run `depth` from now on; the depths it probes are probed now if never measured, else after the
        shortest interval."""
        self.num_switches += 1
        self.current = depth
        for d in self._probe_set(depth):
            arm = self._arms[d]
            arm.interval = self.min_probe_interval
            arm.due = self.num_steps + (self.min_probe_interval if arm.seconds is not None else 0)

    def _probe_set(self, depth: int) -> list[int]:
        """The depths probed while `depth` runs: its neighbours in the candidate order, and the smallest."""
        i = self.candidates.index(depth)
        near = set(self.candidates[max(i - 1, 0) : i + 2]) | {self.candidates[0]}
        return sorted(near - {depth})

    def _rate_or_none(self, depth: int) -> float | None:
        seconds, tokens = self._arms[depth].seconds, self.tokens_per_request(depth)
        return None if seconds is None or tokens is None else tokens / seconds


def _relative_variance(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    mean = statistics.fmean(samples)
    return statistics.variance(samples) / (mean * mean)
