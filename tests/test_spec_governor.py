"""`SpecGovernor`'s mechanics: probes, their timing and intervals, the proof a probe's win needs, the acceptance
estimate, bad input. Runs under cost models with long horizons: `test_spec_governor_costs.py`.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pooled_runner.spec_governor import SpecGovernor
from tests.spec_cost_models import run


def test_a_close_race_is_not_ended_by_one_noisy_estimate() -> None:
    """The first judged pair of a probe of depth 1 is 22.5 and 17.5 ms: 2 tokens per 20 ms, level with depth 0's
    1 per 10 ms, so behind by the margin, but by far less than the pair's own noise. The probe goes on (a probe
    that lost there, as in 9aca555, would wait 64 steps for the next) and wins on the steps that follow, at
    17-18 ms (2 tokens each: 1.14x)."""
    governor = SpecGovernor((0, 1), probe_steps=3, acceptance_decay=1.0)
    for _ in range(3):
        governor.observe(governor.choose(), [0], 0.010)
    times = iter([0.030, 0.0225, 0.0175] + [0.017, 0.018] * 20)  # the first step of a probe is not timed
    steps = 0
    while governor.probing == 1 or steps == 0:
        assert governor.choose() == 1
        governor.observe(1, [1], next(times))
        steps += 1
        if steps == 3:
            assert governor.probing == 1  # judged behind, by less than its noise: undecided
    assert governor.current == 1 and steps <= governor.max_probe_steps, (steps, governor.rates())


def test_an_undecided_probe_ahead_carries_its_steps_to_the_next() -> None:
    """Depth 1 yields 8% more tokens per second than depth 0, but its step times vary by 7%: no probe of 6
    steps (5 timed) has the proof to win, nor is it behind. Each such probe ends undecided, its steps carry
    over to the next probe of 1, which comes after the same interval (4 steps, not 8, 16, ...), and the pooled
    steps win within a few probes. (Dropping them, as a loss, it never wins: 300 steps tried.)"""
    governor = SpecGovernor(
        (0, 1), probe_steps=3, max_probe_steps=6, min_probe_interval=4, acceptance_decay=1.0
    )
    for _ in range(3):
        governor.observe(governor.choose(), [0], 0.010)  # depth 0: 100 tokens/s
    starts, previous, step, probe_steps = [], 0, 0, 0
    for step in range(60):
        depth = governor.choose()
        if depth == 1 and previous == 0:
            starts.append(step)
        previous = depth
        if depth == 1:  # every draft accepted: 2 tokens per 18.5 ms on average (108 tokens/s)
            probe_steps += 1
            governor.observe(1, [1], 0.0172 if probe_steps % 2 else 0.0198)
        else:
            governor.observe(0, [0], 0.010)
        if governor.current == 1:
            break
    assert governor.current == 1, (step, governor.rates())
    assert len(starts) >= 2 and set(b - a for a, b in itertools.pairwise(starts)) == {10}, starts
    assert governor.rates()[1] == pytest.approx(2.0 / 0.0185, rel=0.02)


@pytest.mark.parametrize(
    ("depth3_ms", "expected"),
    [
        (4.21, [10, 18, 34]),  # 0.95x depth 0's rate: a close loss, the interval doubles (4, 8, 16, 32)
        (8.0, [18, 34]),  # 0.5x: a clear loss, it quadruples (4, 16, 32)
    ],
)
def test_probe_intervals_grow_while_probes_lose(depth3_ms: float, expected: list[int]) -> None:
    rng = random.Random(17)
    costs = {0: 1.0, 3: depth3_ms}  # every draft accepted: depth 3 yields 4 tokens
    governor = SpecGovernor((3, 0), min_probe_interval=4, max_probe_interval=32, probe_steps=2)
    _, _, depths = run(governor, lambda d, _s: costs[d] * 1e-3, 400, rng, noise=0.0, accept=1.0)
    starts = [i for i in range(1, len(depths)) if depths[i] == 3 and depths[i - 1] == 0]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # a probe of 2 steps, then the interval, up to 32 + 2 for ever
    assert gaps[: len(expected)] == expected, gaps
    assert set(gaps[len(expected) :]) == {34}, gaps
    assert governor.current == 0


def test_first_step_of_a_probe_untimed_steps_and_outliers_are_not_timed() -> None:
    governor = SpecGovernor((0, 2), initial=2, probe_steps=3, acceptance_decay=1.0)
    for accepted, seconds in (([2], 0.4), ([1], 0.010), ([0], 0.012)):  # the switch step (0.4 s) is not timed
        assert governor.choose() == 2
        governor.observe(2, accepted, seconds)
    # acceptance: 3 accepted drafts, 2 rejections (the chains of 1 and 0 stopped early) -> 0.6
    assert governor.acceptance == pytest.approx(0.6)
    assert governor.rates()[2] == pytest.approx((1.0 + 0.6 + 0.36) / 0.011)
    assert governor.choose() == 0  # the smallest depth, never measured: probed at once
    governor.observe(0, [0], 0.9)  # the change of depth: not timed, the probe goes on
    governor.observe(0, [0], 0.003, timed=False)  # the caller's untimed step (a batch-size slot change)
    assert governor.probing == 0
    for seconds in (0.003, 0.004):
        governor.observe(governor.choose(), [0], seconds)
    assert governor.rates()[0] == pytest.approx(1.0 / 0.0035)  # the probe's two timed steps
    assert governor.current == 0 and governor.probing is None  # 285.7 tokens/s beat depth 2's 178.2
    governor.observe(governor.choose(), [0], 0.004)  # running: an exponential average (alpha 0.1)
    assert governor.rates()[0] == pytest.approx(1.0 / (0.9 * 0.0035 + 0.1 * 0.004))
    seconds_0 = 0.9 * 0.0035 + 0.1 * 0.004
    governor.observe(0, [0], 0.050)  # an outlier (a prefill in between): more than 3x the average
    governor.observe(0, [0], 0.050)
    assert governor.rates()[0] == pytest.approx(1.0 / seconds_0)
    governor.observe(0, [0], 0.050)  # the third in a row: conditions changed, the average restarts
    assert governor.rates()[0] == pytest.approx(1.0 / 0.050)


def test_the_step_back_from_a_probe_is_not_timed() -> None:
    """Back from a probe the pool refills the running depth's working set: that slow step must not count."""
    governor = SpecGovernor((0, 1), probe_steps=2, min_probe_interval=4, acceptance_decay=1.0)
    for _ in range(2):  # the first step (a change from nothing) is not timed
        governor.observe(governor.choose(), [0], 0.002)
    assert governor.rates()[0] == pytest.approx(500.0) and governor.current == 0
    assert governor.choose() == 1  # never measured: probed at once
    governor.observe(1, [1], 0.050)  # the probe's first step: not timed
    governor.observe(1, [0], 0.005)  # timed: 1.5 tokens (acceptance 0.5) in 5 ms = 300 tokens/s, loses
    assert governor.choose() == 0 and governor.current == 0 and governor.probing is None
    governor.observe(0, [0], 0.0055)  # the step back: slower, not timed
    assert governor.rates()[0] == pytest.approx(500.0)
    governor.observe(0, [0], 0.002)
    assert governor.rates()[0] == pytest.approx(500.0)


def test_a_deeper_probe_must_prove_its_gain_a_shallower_one_less() -> None:
    """Drafting must prove it pays: a deeper depth that looks 10% better on a few noisy steps and a young
    acceptance estimate keeps being probed, then loses undecided; the shallower direction needs half the proof."""
    governor = SpecGovernor((0, 1), probe_steps=3, max_probe_steps=6, acceptance_decay=1.0)
    for seconds in (0.010, 0.008, 0.012):  # depth 0: 10 ms on average, noisy (relative sd 0.2)
        governor.observe(governor.choose(), [0], seconds)
    assert governor.current == 0 and governor.choose() == 1
    # depth 1 at acceptance 0.5 and 13.6 ms: 1.5 / 13.6 ms = 1.10x depth 0's rate by the estimates
    steps = [([1], 0.030), ([0], 0.0136), ([1], 0.0136), ([0], 0.0136)]
    for accepted, seconds in steps:
        governor.observe(1, accepted, seconds)
        assert governor.probing == 1, "undecided: the gain is within the noise"
    for accepted, seconds in (([1], 0.0136), ([0], 0.0136)):  # the 6th step ends it undecided: it loses
        governor.observe(1, accepted, seconds)
    assert governor.probing is None and governor.current == 0
    assert governor.rates()[1] == pytest.approx(1.5 / 0.0136)  # what it measured is kept
    # the other way round: running depth 1, depth 0 wins on a 7% gain (half the proof, step times only)
    governor = SpecGovernor((0, 1), initial=1, probe_steps=3, acceptance_decay=1.0)
    for accepted, seconds in (([1], 0.030), ([0], 0.015), ([0], 0.015)):  # acceptance 1/3: 1.33 tokens
        governor.observe(governor.choose(), accepted, seconds)
    assert governor.current == 1 and governor.choose() == 0
    for seconds in (0.030, 0.0105, 0.0105):  # 1 / 10.5 ms = 1.07x depth 1's 1.33 / 15 ms
        governor.observe(0, [0], seconds)
    assert governor.current == 0 and governor.num_switches == 1


def test_a_deeper_probe_is_never_judged_cheaper_per_step_than_the_shallower_current() -> None:
    """Depth 0 timed on the first decode steps after start-up (slow, 10 ms), then the machine speeds up: a probe
    of depth 1 runs at 6 ms. Its drafts are never accepted, so it yields what depth 0 yields at more work per
    step; judged at depth 0's time it loses (taken at its own time it won 1.67x). With every draft accepted the
    same probe wins on its extra tokens alone."""
    for accepted, wins in ((0, False), (1, True)):
        governor = SpecGovernor((0, 1), probe_steps=3, acceptance_decay=1.0)
        for _ in range(3):
            governor.observe(governor.choose(), [0], 0.010)
        assert governor.current == 0 and governor.choose() == 1
        for _ in range(3):
            governor.observe(1, [accepted], 0.006)
        assert governor.probing is None and governor.current == (1 if wins else 0), governor.rates()
        assert governor.rates()[1] == pytest.approx((1.0 + accepted) / 0.006)  # what it measured is kept


def test_a_probe_ends_even_when_none_of_its_steps_can_be_timed() -> None:
    """A probe whose steps the caller cannot time (batch sizes alternating, say) ends after max_probe_steps and
    loses; the governor goes on at the current depth."""
    governor = SpecGovernor((0, 1), probe_steps=3, max_probe_steps=5, min_probe_interval=4)
    for _ in range(3):
        governor.observe(governor.choose(), [0], 0.001)
    assert governor.choose() == 1
    for _ in range(4):
        governor.observe(1, [1], 0.0005, timed=False)
        assert governor.probing == 1
    governor.observe(1, [1], 0.0005, timed=False)  # the 5th: the probe ends undecided and loses
    assert governor.probing is None and governor.current == 0 and governor.choose() == 0
    assert governor.rates()[1] is None  # nothing was measured


def test_outliers_in_a_row_are_a_change_of_conditions_for_probes_too() -> None:
    """Depth 1 was measured at 2 ms; then every step gets 5x slower (the pool's hit rate collapsed). The running
    depth restarts its average after three slow steps; a probe of 1 must not drop all its steps as outliers of
    the stale 2 ms (it would lose for ever): three in a row become its timed steps."""
    governor = SpecGovernor((0, 1), probe_steps=3, min_probe_interval=4, acceptance_decay=1.0)
    for _ in range(3):
        governor.observe(governor.choose(), [0], 0.001)
    for _ in range(3):  # the first probe of 1: 2 ms per step, 2 tokens each (1000 tokens/s, not a win)
        assert governor.choose() == 1
        governor.observe(1, [1], 0.002)
    assert governor.probing is None and governor.rates()[1] == pytest.approx(1000.0)
    while governor.choose() == 0:  # the slowdown: depth 0 at 5 ms
        governor.observe(0, [0], 0.005)
    assert governor.rates()[0] == pytest.approx(200.0, rel=0.05)
    governor.observe(1, [1], 0.010)  # the probe: its first step is not timed
    for _ in range(2):  # outliers of the stale 2 ms: not timed yet
        governor.observe(1, [1], 0.0075)
        assert governor.probing == 1
    governor.observe(1, [1], 0.0075)  # the third in a row: they are the probe's steps, and it wins
    assert governor.probing is None and governor.current == 1
    assert governor.rates()[1] == pytest.approx(2.0 / 0.0075)  # every draft accepted: 2 tokens in 7.5 ms


def test_the_smallest_depth_is_always_probed() -> None:
    """Tokens/s dips at depth 1 and rises at 3 (not a hill): from 3 the climb's neighbours would never reach 0;
    the governor probes the smallest depth too and settles there."""
    rng = random.Random(31)
    costs = {0: 1.0, 1: 2.6, 3: 2.4}  # rates 1.0, 0.62, 0.91 (acceptance 0.6)
    governor = SpecGovernor(sorted(costs), initial=3)
    _, _, depths = run(governor, lambda d, _s: costs[d] * 1e-3, 400, rng)
    assert governor.current == 0, governor.rates()
    assert depths.index(0) < 20 and sum(d == 0 for d in depths) > 0.85 * len(depths)


def test_acceptance_is_estimated_from_every_depth_and_follows_changes() -> None:
    rng = random.Random(23)
    governor = SpecGovernor((0, 1, 3, 5), acceptance_decay=0.995)
    costs = {0: 1.0, 1: 1.2, 3: 1.5, 5: 1.9}
    run(governor, lambda d, _s: costs[d] * 1e-3, 1500, rng, batch_size=4, accept=0.7)
    assert governor.acceptance == pytest.approx(0.7, abs=0.03)
    run(governor, lambda d, _s: costs[d] * 1e-3, 1500, rng, batch_size=4, accept=0.3)
    assert governor.acceptance == pytest.approx(0.3, abs=0.03)
    assert governor.tokens_per_request(0) == 1.0
    p = governor.acceptance
    assert governor.tokens_per_request(3) == pytest.approx(1 + p + p * p + p**3)


def test_outcomes_of_stale_depths_teach_acceptance_only() -> None:
    """Overlapped callers report a step chosen before a switch: counted, no time learned from it."""
    governor = SpecGovernor((0, 1, 3), initial=3, probe_steps=2, acceptance_decay=1.0)
    governor.observe(3, [2], 0.01)
    governor.observe(3, [3], 0.01)
    assert governor.choose() == 0 and governor.probing == 0  # the smallest depth first, then the neighbour 1
    seconds_before = {d: arm.seconds for d, arm in governor._arms.items()}
    governor.observe(3, [1], 0.5)  # a step chosen before the probe of 0 began
    assert {d: arm.seconds for d, arm in governor._arms.items()} == seconds_before
    assert governor.steps_at[3] == 3 and governor.acceptance == pytest.approx(6 / 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": []}, "at least one depth"),
        ({"candidates": [-1, 0]}, "at least one depth"),
        ({"candidates": [0, 3], "initial": 2}, "initial=2"),
        ({"candidates": [0, 3], "ema_alpha": 0.0}, "ema_alpha"),
        ({"candidates": [0, 3], "acceptance_decay": 1.5}, "acceptance_decay"),
        ({"candidates": [0, 3], "probe_steps": 1}, "probe_steps"),
        ({"candidates": [0, 3], "probe_steps": 4, "max_probe_steps": 3}, "max_probe_steps"),
        ({"candidates": [0, 3], "confidence": -1.0}, "confidence"),
        ({"candidates": [0, 3], "outlier_factor": 1.0}, "outlier_factor"),
        ({"candidates": [0, 3], "min_probe_interval": 8, "max_probe_interval": 4}, "probe intervals"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict, match: str) -> None:
    candidates = kwargs.pop("candidates")
    with pytest.raises(ValueError, match=match):
        SpecGovernor(candidates, **kwargs)


def test_bad_observations_are_refused() -> None:
    governor = SpecGovernor((0, 3))
    with pytest.raises(ValueError, match="not one of the candidates"):
        governor.observe(2, [0], 0.01)
    with pytest.raises(ValueError, match="seconds=0.0"):
        governor.observe(3, [1], 0.0)
    with pytest.raises(ValueError, match=r"\[4\] not in 0..3"):
        governor.observe(3, [4], 0.01)
    with pytest.raises(ValueError, match=r"\[\] not in 0..3"):
        governor.observe(3, [], 0.01)
    with pytest.raises(ValueError, match=r"\[1\] not in 0..0"):
        governor.observe(0, [1], 0.01)
    assert governor.num_steps == 0


def test_walks_to_the_best_depth_and_probes_only_its_neighbours_and_the_smallest() -> None:
    """From depth 7 where drafting loses: the smallest depth is probed first and wins; from then on only 0's
    neighbour 1 is probed, at doubling intervals."""
    rng = random.Random(29)
    costs = {0: 1.1, 1: 2.2, 3: 4.1, 5: 5.6, 7: 7.0}
    governor = SpecGovernor(sorted(costs), initial=7, probe_steps=3)
    _, _, depths = run(governor, lambda d, _s: costs[d] * 1e-3, 2000, rng)
    assert governor.current == 0
    assert depths[:3] == [7, 7, 7]
    first_zero = depths.index(0)
    assert first_zero == 3  # 7's probe set is {0, 5}; 0 first (never measured, the smallest)
    assert set(depths[first_zero:]) == {0, 1}, sorted(set(depths[first_zero:]))
    probes_of_1 = sum(1 for a, b in itertools.pairwise(depths[first_zero:]) if a == 0 and b == 1)
    assert 4 <= probes_of_1 <= 10, probes_of_1  # intervals 32, 64, ..., 1024: about log2(2000 / 32)


def test_starts_without_drafting_by_default() -> None:
    assert SpecGovernor((3, 1, 0)).choose() == 0
    assert SpecGovernor((5, 3)).choose() == 3  # no 0 among the candidates: the smallest there is
