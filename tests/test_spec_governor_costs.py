"""`SpecGovernor` driven by cost models with fresh random noise, over long runs: it ends at the best depth, pays
little for its probes, and stays close to no drafting where drafting loses.

The reference is computed independently of the governor: the best fixed depth's tokens per second from the
same cost model, and the fraction of steps a bounded exploration schedule may spend elsewhere.
"""

from __future__ import annotations

import math
import random

import pytest

from bench.spec_governor_model import noisy_run, probing_once
from pooled_runner.spec_governor import SpecGovernor
from tests.spec_cost_models import COST_MODELS, best_rate, run, sample_accepted, tokens_at


@pytest.mark.parametrize("name", sorted(COST_MODELS))
@pytest.mark.parametrize(("seed", "batch_size"), [(3, 1), (11, 4)])
def test_runs_the_best_depth_and_pays_little_for_probes(name: str, seed: int, batch_size: int) -> None:
    costs_ms = COST_MODELS[name]
    rng = random.Random(seed * 7919 + len(name))
    governor = SpecGovernor(sorted(costs_ms), min_probe_interval=32, max_probe_interval=1024)
    num_steps = 3000
    tokens, seconds, depths = run(
        governor, lambda d, _s: costs_ms[d] * 1e-3, num_steps, rng, batch_size=batch_size
    )
    best, rate = best_rate(costs_ms)
    assert governor.current == best, (name, governor.rates())
    off_best = sum(d != best for d in depths)
    # exploration: the climb from depth 0, then probes of at most 2 depths at doubling intervals
    max_probes = 2 * (2 + len(range(5, 11)) + num_steps // 1024)  # 32, 64, ..., 1024, then every 1024
    assert off_best <= 4 * max_probes, (name, off_best, governor.steps_at)
    achieved = (tokens / seconds) / (rate * 1e3)
    assert achieved >= 0.97, (name, achieved, governor.steps_at)
    assert achieved <= 1.0 + 0.05  # sampling noise only: nothing beats the best fixed depth of the model


# H200 step times (ms) at depths 0 / 1 / 3 where drafting loses (docs/BENCHMARKS.md, bench_spec_governed, 75c17ab)
LOSING_ON_THE_H200 = {
    (1, 400): {0: 1.94, 1: 3.89, 3: 6.42},
    (4, 300): {0: 9.91, 1: 20.8, 3: 30.9},
    (16, 150): {0: 14.2, 1: 24.8, 3: 38.2},
}


@pytest.mark.parametrize(("batch_size", "num_steps"), sorted(LOSING_ON_THE_H200))
def test_short_runs_stay_close_to_no_drafting_where_drafting_loses(batch_size: int, num_steps: int) -> None:
    """Issue #9: speculation must not cost tokens/s against depth 0. Cost model: the H200's step times where
    drafting loses, with its noise (`bench.spec_governor_model.noisy_run`: lognormal, 1% of steps 2.5x slow, a
    change of depth slowing two steps). Reference: depth 0 alone under the same noise."""
    costs = LOSING_ON_THE_H200[(batch_size, num_steps)]
    ratios = []
    for seed in range(6):
        ratio, _, end = noisy_run(costs, batch_size, num_steps, 1000 * batch_size + seed)
        ratios.append(ratio)
        assert end == 0, (seed, ratio)
    # the shipped governor of 3b78a66 (probes won on two timed steps, started at the largest depth) gave
    # 0.78-0.97 at bs 1 and 0.88-0.95 at bs 4 and 16 here
    assert min(ratios) >= 0.93 and sum(ratios) / len(ratios) >= 0.96, ratios


# tokens/s per request at depths 0 / 1 / 3, pool 25%, bs 16 on the H200 (docs/BENCHMARKS.md, bench_spec_governed,
# a8ed710): drafting wins by 6% and 12%, within a few standard errors of a probe's step times
WINNING_A_LITTLE_ON_THE_H200 = {0: 14.6, 1: 15.5, 3: 16.3}


def test_a_small_gain_is_proven_over_several_probes() -> None:
    """Where depth 3 wins by 12% and depth 1 by 6% (the H200's pool 25%, bs 16, with its noise), the governor
    must take most of the gain within 2000 steps. The governor of 9aca555 (a probe lost as soon as its estimate
    was behind, and an undecided one as a loss, its steps dropped) got 1.051x depth 0 on average and 0.999x at
    worst over these seeds; the best fixed depth gets 1.116x."""
    costs = {d: tokens_at(d) / rate for d, rate in WINNING_A_LITTLE_ON_THE_H200.items()}
    ratios, ends = [], []
    for seed in range(8):
        ratio, _, end = noisy_run(costs, 16, 2000, 7000 + seed)
        ratios.append(ratio)
        ends.append(end)
    assert ends.count(3) >= 6, ends
    assert min(ratios) >= 1.02 and sum(ratios) / len(ratios) >= 1.07, ratios


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


@pytest.mark.parametrize("seed", range(8))
def test_no_drafting_holds_where_drafts_are_never_accepted_and_steps_cost_alike(seed: int) -> None:
    """The CPU engine test's conditions (tests/engine/test_spec_server.py, the "random" MTP head): depths 0 and
    1 cost about the same per step (Python overhead dominates a tiny model), the first decode steps are slow,
    step times are noisy (a loaded 2-core machine), and no draft is accepted. Depth 1 yields nothing, so the
    governor must never move to it, whatever the noise."""
    rng = random.Random(4000 + seed)
    costs = {0: 1.0, 1: 1.03, 3: 1.1}
    governor = SpecGovernor(sorted(costs))
    for step in range(300):
        depth = governor.choose()
        warm_up = 1.6 if step < 6 else 1.0
        governor.observe(depth, [0], costs[depth] * 1e-3 * warm_up * math.exp(rng.gauss(0.0, 0.3)))
        assert governor.current == 0, (step, governor.rates())
    assert governor.num_switches == 0 and governor.steps_at[1] > 0  # depth 1 was probed, and lost


def test_the_floor_governor_probes_each_depth_once() -> None:
    """`bench.spec_governor_model --floor`: this governor with probes that never come back. Over 600 steps where
    depth 1 loses clearly (2 tokens of 1.6 expected per 21 ms against 1 per 10 ms), it spends only its first
    probe at depth 1, and depth 3 (no neighbour of depth 0) never runs; the shipped governor probes depth 1
    again after 32, 128, ... steps."""
    costs = {0: 0.010, 1: 0.021, 3: 0.031}
    steps_after_100 = {}
    for label, make in (("once", probing_once().SpecGovernor), ("shipped", SpecGovernor)):
        governor = make([0, 1, 3])
        rng = random.Random(11)
        depths = []
        for _ in range(600):
            depth = governor.choose()
            depths.append(depth)
            accepted = [sample_accepted(depth, rng) for _ in range(4)]
            governor.observe(depth, accepted, costs[depth] * math.exp(rng.gauss(0.0, 0.05)))
        assert governor.current == 0 and 3 not in depths, (label, depths.count(3))
        steps_after_100[label] = sum(d != 0 for d in depths[100:])
        if label == "once":
            assert 2 <= depths.count(1) <= governor.max_probe_steps and depths.index(1) < 8, depths[:40]
    assert steps_after_100["once"] == 0 < steps_after_100["shipped"], steps_after_100


def test_past_its_first_probes_the_governor_stays_closer_to_depth_0() -> None:
    """`noisy_run(..., learn=300)`: counted after 300 steps the governor decided (a serving process past its
    start), where drafting loses (the H200's bs 16 step times), the governor's 150 counted steps pay only its
    later, rarer probes: nearer depth 0 than a run counted from the start, under the same seeds."""
    costs = LOSING_ON_THE_H200[(16, 150)]
    cold = [noisy_run(costs, 16, 150, 1000 * 16 + seed)[0] for seed in range(6)]
    warm = [noisy_run(costs, 16, 150, 1000 * 16 + seed, learn=300)[0] for seed in range(6)]
    assert sum(warm) / 6 > sum(cold) / 6 and sum(warm) / 6 >= 0.985, (cold, warm)
