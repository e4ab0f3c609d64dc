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


def run(governor: SpecGovernor, seconds_at, num_steps: int, rng: random.Random, noise: float = 0.05):
    """Drive `governor` for `num_steps` steps of the cost model; returns (tokens, seconds, depths run)."""
    total_tokens = total_seconds = 0.0
    depths = []
    for step in range(num_steps):
        depth = governor.choose()
        seconds = seconds_at(depth, step) * (1.0 + noise * rng.uniform(-1.0, 1.0))
        governor.observe(depth, tokens_at(depth), seconds)
        total_tokens += tokens_at(depth)
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
@pytest.mark.parametrize("seed", [3, 11])
def test_runs_the_best_depth_and_pays_little_for_probes(name: str, seed: int) -> None:
    costs_ms = COST_MODELS[name]
    rng = random.Random(seed * 7919 + len(name))
    governor = SpecGovernor(sorted(costs_ms), min_probe_interval=16, max_probe_interval=1024)
    num_steps = 3000
    tokens, seconds, depths = run(governor, lambda d, _s: costs_ms[d] * 1e-3, num_steps, rng)
    best, rate = best_rate(costs_ms)
    assert governor.current == best, (name, governor.rates())
    off_best = sum(d != best for d in depths)
    # exploration: the first round (3 steps per other depth) plus probes at doubling intervals
    max_probes = 2 * (1 + len(range(4, 11)) + num_steps // 1024)  # 16, 32, ..., 1024, then every 1024
    assert off_best <= 3 * max_probes, (name, off_best, governor.steps_at)
    achieved = (tokens / seconds) / (rate * 1e3)
    assert achieved >= 0.97, (name, achieved, governor.steps_at)
    assert achieved <= 1.0 + 0.05  # noise only: nothing beats the best fixed depth of the model


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


def test_first_step_of_a_probe_and_long_steps_are_not_counted() -> None:
    governor = SpecGovernor((0, 2), initial=2, probe_steps=3, max_step_seconds=0.5)
    for seconds in (0.4, 0.010, 0.012):  # depth 2: the switch step (0.4 s) does not count
        assert governor.choose() == 2
        governor.observe(2, 2.0, seconds)
    assert governor.rates()[2] == pytest.approx(4.0 / 0.022)
    assert governor.choose() == 0
    governor.observe(0, 1.0, 5.0)  # an idle gap: ignored, the probe goes on
    assert governor.probing == 0
    for seconds in (0.003, 0.004, 0.004):
        governor.observe(governor.choose(), 1.0, seconds)
    assert governor.rates()[0] == pytest.approx(2.0 / 0.008)
    assert governor.current == 0 and governor.probing is None


def test_outcomes_of_stale_depths_change_no_estimate() -> None:
    """Overlapped callers report a step chosen before a switch: counted, not learned from."""
    governor = SpecGovernor((0, 1, 3), initial=3, probe_steps=2)
    governor.observe(3, 2.0, 0.01)
    governor.observe(3, 2.0, 0.01)
    assert governor.probing == 1
    before = governor.rates()
    governor.observe(3, 2.0, 0.5)  # a step chosen before the probe of 1 began
    assert governor.rates() == before and governor.steps_at[3] == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": []}, "at least one depth"),
        ({"candidates": [-1, 0]}, "at least one depth"),
        ({"candidates": [0, 3], "initial": 2}, "initial=2"),
        ({"candidates": [0, 3], "ema_alpha": 0.0}, "ema_alpha"),
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
        governor.observe(2, 1.0, 0.01)
    with pytest.raises(ValueError, match="seconds=0.0"):
        governor.observe(3, 1.0, 0.0)
    with pytest.raises(ValueError, match="tokens_per_request=0.5"):
        governor.observe(3, 0.5, 0.01)
    assert governor.num_steps == 0
