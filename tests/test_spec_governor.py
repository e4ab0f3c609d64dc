"""`SpecGovernor`: the cost-aware speculative depth, driven by cost models with fresh random noise.

The reference is computed independently of the governor: the best fixed depth's tokens per second from the
same cost model, and the fraction of steps a bounded exploration schedule may spend elsewhere.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pooled_runner.spec_governor import SpecGovernor

ACCEPT = 0.6  # per-draft acceptance (chain), as the decode bench


def tokens_at(depth: int) -> float:
    """Expected accepted tokens per request of a verify step with `depth` drafts (chain, ACCEPT each)."""
    return sum(ACCEPT**i for i in range(depth + 1))


def sample_accepted(depth: int, rng: random.Random, accept: float = ACCEPT) -> int:
    """Accepted drafts of one request: a chain, each draft accepted with `accept` while the chain lasts."""
    n = 0
    while n < depth and rng.random() < accept:
        n += 1
    return n


def run(
    governor: SpecGovernor,
    seconds_at,
    num_steps: int,
    rng: random.Random,
    noise: float = 0.05,
    batch_size: int = 1,
    accept: float = ACCEPT,
):  # type: ignore[no-untyped-def]
    """Drive `governor` for `num_steps` steps of the cost model (acceptance sampled per request); returns
    (tokens per request, seconds, depths run)."""
    total_tokens = total_seconds = 0.0
    depths = []
    for step in range(num_steps):
        depth = governor.choose()
        seconds = seconds_at(depth, step) * (1.0 + noise * rng.uniform(-1.0, 1.0))
        accepted = [sample_accepted(depth, rng, accept) for _ in range(batch_size)]
        governor.observe(depth, accepted, seconds)
        total_tokens += 1.0 + sum(accepted) / batch_size
        total_seconds += seconds
        depths.append(depth)
    return total_tokens, total_seconds, depths


def best_rate(costs: dict[int, float]) -> tuple[int, float]:
    depth = max(costs, key=lambda d: tokens_at(d) / costs[d])
    return depth, tokens_at(depth) / costs[depth]


# step milliseconds per depth: drafting loses (a small pool at bs 1), wins, and one where depth 1 is best
COST_MODELS = {
    "drafting-loses": {0: 1.13, 1: 2.31, 3: 4.27},
    "depth3-wins": {0: 3.1, 1: 3.9, 3: 4.8},
    "depth1-wins": {0: 1.7, 1: 2.05, 3: 3.6},
}


@pytest.mark.parametrize("name", sorted(COST_MODELS))
@pytest.mark.parametrize(("seed", "batch_size"), [(3, 1), (11, 4)])
def test_runs_the_best_depth_and_pays_little_for_probes(name: str, seed: int, batch_size: int) -> None:
    costs_ms = COST_MODELS[name]
    rng = random.Random(seed * 7919 + len(name))
    governor = SpecGovernor(sorted(costs_ms), min_probe_interval=16, max_probe_interval=1024)
    num_steps = 3000
    tokens, seconds, depths = run(
        governor, lambda d, _s: costs_ms[d] * 1e-3, num_steps, rng, batch_size=batch_size
    )
    best, rate = best_rate(costs_ms)
    assert governor.current == best, (name, governor.rates())
    off_best = sum(d != best for d in depths)
    # exploration: the first round (3 steps per other depth) plus probes at doubling intervals
    max_probes = 2 * (1 + len(range(4, 11)) + num_steps // 1024)  # 16, 32, ..., 1024, then every 1024
    assert off_best <= 3 * max_probes, (name, off_best, governor.steps_at)
    achieved = (tokens / seconds) / (rate * 1e3)
    assert achieved >= 0.97, (name, achieved, governor.steps_at)
    assert achieved <= 1.0 + 0.05  # sampling noise only: nothing beats the best fixed depth of the model


def test_follows_a_change_of_conditions() -> None:
    """Drafting first wins, then (the pool's hit rate drops) loses: the governor switches within a few probes."""
    rng = random.Random(5)
    winning = {0: 3.1, 1: 3.9, 3: 4.8}
    losing = {0: 1.13, 1: 2.31, 3: 4.27}
    change_at = 400
    governor = SpecGovernor((0, 1, 3), min_probe_interval=8, max_probe_interval=64)

    def seconds_at(depth: int, step: int) -> float:
        return (winning if step < change_at else losing)[depth] * 1e-3

    _, _, depths = run(governor, seconds_at, 800, rng)
    assert depths[change_at - 1] == 3
    switched = next(i for i in range(change_at, len(depths)) if all(d == 0 for d in depths[i : i + 20]))
    assert switched - change_at <= 64 + 2 * governor.probe_steps, switched
    assert governor.current == 0 and governor.num_switches >= 1


def test_probe_intervals_double_while_probes_lose() -> None:
    rng = random.Random(17)
    costs = {0: 1.0, 3: 4.0}
    governor = SpecGovernor((3, 0), min_probe_interval=4, max_probe_interval=32, probe_steps=2)
    _, _, depths = run(governor, lambda d, _s: costs[d] * 1e-3, 400, rng, noise=0.0)
    starts = [i for i in range(1, len(depths)) if depths[i] == 3 and depths[i - 1] == 0]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # a probe of 2 steps, then the interval: 4+2, 8+2, 16+2, then 32+2 for ever
    assert gaps[:3] == [10, 18, 34], gaps
    assert set(gaps[3:]) == {34}, gaps


def test_first_step_of_a_probe_and_long_steps_are_not_timed() -> None:
    governor = SpecGovernor((0, 2), initial=2, probe_steps=3, max_step_seconds=0.5, acceptance_decay=1.0)
    for accepted, seconds in (([2], 0.4), ([1], 0.010), ([0], 0.012)):  # the switch step (0.4 s) is not timed
        assert governor.choose() == 2
        governor.observe(2, accepted, seconds)
    # acceptance: 3 accepted drafts, 2 rejections (the chains of 1 and 0 stopped early) -> 0.6
    assert governor.acceptance == pytest.approx(0.6)
    assert governor.rates()[2] == pytest.approx((1.0 + 0.6 + 0.36) / 0.011)
    assert governor.choose() == 0
    governor.observe(0, [0], 0.9)  # the change of depth: not timed, the probe goes on
    assert governor.probing == 0
    governor.observe(0, [0], 5.0)  # an idle gap: not timed either
    for seconds in (0.003, 0.004):
        governor.observe(governor.choose(), [0], seconds)
    assert governor.rates()[0] == pytest.approx(1.0 / 0.0035)  # the probe's two timed steps
    assert governor.current == 0 and governor.probing is None  # 285.7 tokens/s beat depth 2's 178.2
    governor.observe(governor.choose(), [0], 0.004)  # running: an exponential average (alpha 0.2)
    assert governor.rates()[0] == pytest.approx(1.0 / (0.8 * 0.0035 + 0.2 * 0.004))


def test_the_step_back_from_a_probe_is_not_timed() -> None:
    """Back from a probe the pool refills the running depth's working set: that slow step must not count."""
    governor = SpecGovernor((0, 1), initial=0, probe_steps=2, min_probe_interval=4, acceptance_decay=1.0)
    for _ in range(3):  # the first step (a change from nothing) is not timed
        governor.observe(governor.choose(), [0], 0.002)
    assert governor.rates()[0] == pytest.approx(500.0)
    while governor.choose() == 0:
        governor.observe(0, [0], 0.002)
    governor.observe(1, [1], 0.050)  # the probe of 1: its first step is not timed
    governor.observe(1, [0], 0.005)  # timed: 1.5 tokens (acceptance 0.5) in 5 ms = 300 tokens/s, loses
    assert governor.choose() == 0 and governor.current == 0
    governor.observe(0, [0], 0.020)  # the step back: ten times slower, not timed
    assert governor.rates()[0] == pytest.approx(500.0)
    governor.observe(0, [0], 0.002)
    assert governor.rates()[0] == pytest.approx(500.0)


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
    assert governor.choose() == 1 and governor.probing == 1  # depth 3's neighbour
    seconds_before = {d: arm.seconds for d, arm in governor._arms.items()}
    governor.observe(3, [1], 0.5)  # a step chosen before the probe of 1 began
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
        ({"candidates": [0, 3], "min_probe_interval": 8, "max_probe_interval": 4}, "probe intervals"),
        ({"candidates": [0, 3], "max_step_seconds": 0.0}, "max_step_seconds"),
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


def test_walks_to_the_best_depth_and_probes_only_its_neighbours() -> None:
    """From depth 7 down to 0 where drafting loses: 5, 7 (and 3) are measured on the way, then only 1 is probed."""
    rng = random.Random(29)
    costs = {0: 1.1, 1: 2.2, 3: 4.1, 5: 5.6, 7: 7.0}
    governor = SpecGovernor(sorted(costs), probe_steps=3)
    _, _, depths = run(governor, lambda d, _s: costs[d] * 1e-3, 2000, rng)
    assert governor.current == 0
    assert depths[:3] == [7, 7, 7]
    first_zero = depths.index(0)
    assert set(depths[:first_zero]) == {1, 3, 5, 7}  # the walk
    assert set(depths[first_zero:]) == {0, 1}, sorted(set(depths[first_zero:]))
    probes_of_1 = sum(1 for a, b in itertools.pairwise(depths[first_zero:]) if a == 0 and b == 1)
    assert 5 <= probes_of_1 <= 12, probes_of_1  # intervals 16, 32, ..., 1024: about log2(2000 / 16)
