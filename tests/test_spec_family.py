"""`GovernorFamily`: one spec governor per batch size, sharing the acceptance estimate and passing verdicts on.

References: an independent governor driven through the same steps (what a batch size learns alone), and the
cost models' best fixed depth per batch size (`bench.spec_family_model`).
"""

from __future__ import annotations

import random
import statistics

import pytest

from bench.spec_family_model import SCENARIOS, replay, wander
from pooled_runner.spec_acceptance import AcceptanceEstimate, expected_chain_tokens
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import SpecGovernor
from tests.spec_cost_models import COST_MODELS, run

LOSES = COST_MODELS["drafting-loses"]  # step ms: 0: 1.13, 1: 2.31, 3: 4.27
WINS = COST_MODELS["depth3-wins"]


def drive(governor: SpecGovernor, step_ms: dict[int, float], num_steps: int, seed: int) -> list[int]:
    """`num_steps` steps of `step_ms` (5% noise) at batch size 4; the depths run."""
    return run(
        governor, lambda depth, step: step_ms[depth] * 1e-3, num_steps, random.Random(seed), batch_size=4
    )[2]


def test_the_acceptance_estimate_is_shared_and_matches_a_direct_count() -> None:
    family = GovernorFamily(acceptance_decay=1.0)
    first, second = family.governor(2, (0, 1, 3)), family.governor(9, (0, 1, 3))
    assert first.acceptance_estimate is second.acceptance_estimate is family.acceptance
    rng = random.Random(5)
    outcomes = []
    for _ in range(40):
        depth = rng.choice((1, 3))
        accepted = [rng.randint(0, depth) for _ in range(rng.randint(1, 7))]
        outcomes.append((depth, accepted))
        rng.choice((first, second)).observe(depth, accepted, 1e-3 * rng.uniform(1.0, 2.0))
    # p = accepted drafts / (accepted drafts + chains stopped before their depth), over both governors' steps
    num_accepted = sum(sum(a) for _, a in outcomes)
    num_stopped = sum(sum(n < d for n in a) for d, a in outcomes)
    assert first.acceptance == pytest.approx(num_accepted / (num_accepted + num_stopped), rel=1e-12)
    assert second.tokens_per_request(3) == pytest.approx(expected_chain_tokens(3, first.acceptance or 0.0))
    alone = GovernorFamily(share=False)
    a, b = alone.governor(2, (0, 1)), alone.governor(3, (0, 1))
    a.observe(1, [1, 0], 1e-3)
    assert a.acceptance == 0.5 and b.acceptance is None and alone.acceptance is None


def test_a_new_batch_size_defers_the_probes_its_neighbour_lost() -> None:
    family = GovernorFamily()
    drive(family.governor(4, (0, 1, 3)), LOSES, 400, seed=3)
    neighbour = family.governor(4, (0, 1, 3))
    assert neighbour.current == 0
    lost = neighbour._arms[1].interval  # depth 0 probes its neighbour 1 (and 3 only from 1)
    assert lost > 2 * neighbour.min_probe_interval, lost  # its probes lost twice at least
    newcomer = family.governor(5, (0, 1, 3))
    assert newcomer.current == 0
    depths = drive(newcomer, LOSES, lost // 2 + 4, seed=4)
    # nothing but depth 0 until half the neighbour's interval, then the probe of depth 1
    first_drafted = next(i for i, d in enumerate(depths) if d != 0)
    assert first_drafted == lost // 2, (first_drafted, lost, depths)
    # alone, a batch size probes at once
    alone = drive(SpecGovernor((0, 1, 3)), LOSES, 40, seed=4)
    assert next(i for i, d in enumerate(alone) if d != 0) < 10, alone


def test_a_new_batch_size_starts_at_its_neighbours_running_depth() -> None:
    family = GovernorFamily()
    drive(family.governor(8, (0, 1, 3)), WINS, 600, seed=11)
    assert family.governor(8, (0, 1, 3)).current == 3
    newcomer = family.governor(6, (0, 1, 3))
    assert newcomer.current == 3 and newcomer.choose() == 3
    # a neighbour running a depth the newcomer cannot run: the newcomer starts at its smallest, nothing deferred
    other = family.governor(7, (0, 1))
    assert other.current == 0 and all(arm.due == 0 for arm in other._arms.values())


def test_the_prior_is_the_nearest_batch_size_within_a_factor_of_two() -> None:
    family = GovernorFamily()
    assert family.prior_for(5) is None
    small, large = family.governor(3, (0, 1)), family.governor(7, (0, 1))
    for step in range(small.probe_steps):
        assert family.prior_for(5) is None, f"a prior after {step} of {small.probe_steps} steps"
        for governor in (small, large):
            governor.observe(0, [0], 1e-3)
    assert family.prior_for(5) is small and family.prior_for(6) is large and family.prior_for(2) is small
    assert family.prior_for(1) is None and family.prior_for(15) is None  # 3 > 2 x 1, 15 > 2 x 7
    assert family.prior_for(14) is large
    # the nearest within the factor, not the nearest overall: bs 8 starts from bs 16, not from bs 2 (nearer)
    apart = GovernorFamily()
    two, sixteen = apart.governor(2, (0, 1)), apart.governor(16, (0, 1))
    for _ in range(two.probe_steps):
        for governor in (two, sixteen):
            governor.observe(0, [0], 1e-3)
    assert apart.prior_for(8) is sixteen and apart.prior_for(3) is two
    assert family.governor(3, (0, 1, 3)) is small  # created once, with its first candidates
    assert small.candidates == (0, 1)


def test_an_inherited_depth_is_not_passed_down_a_chain() -> None:
    """bs 16 settled at depth 3 where drafting wins; bs 9 starts from it, and bs 5, within 2x of 9 only, does
    not start from bs 9 until bs 9 has run its depth for `probe_steps` steps itself."""
    family = GovernorFamily()
    drive(family.governor(16, (0, 1, 3)), WINS, 600, seed=5)
    assert family.governor(16, (0, 1, 3)).current == 3
    nine = family.governor(9, (0, 1, 3))
    assert nine.current == 3
    nine.observe(nine.choose(), [1] * 9, 1e-3)
    assert family.prior_for(5) is None
    fresh = family.governor(5, (0, 1, 3))
    assert fresh.current == 0


def test_a_far_batch_size_starts_fresh_and_shallower_depths_are_never_deferred() -> None:
    """Drafting wins at bs 8 here; bs 2 (more than twice smaller) starts at depth 0 and probes at once; bs 6
    starts at bs 8's depth 3 but probes the shallower depth 1 at once (drafting must prove it pays)."""
    family = GovernorFamily()
    drive(family.governor(8, (0, 1, 3)), WINS, 600, seed=11)
    neighbour = family.governor(8, (0, 1, 3))
    assert neighbour.current == 3 and neighbour._arms[1].interval > neighbour.min_probe_interval
    far = family.governor(2, (0, 1, 3))
    assert far.current == 0 and far.acceptance == neighbour.acceptance
    near = family.governor(6, (0, 1, 3))
    assert near.current == 3
    depths = drive(near, WINS, 8, seed=12)
    assert 1 in depths[:8], depths


def test_only_a_neighbours_own_lost_probes_are_passed_on() -> None:
    """bs 5 takes bs 4's lost depth-1 probes as a deferral; bs 6, nearer to bs 5 (which lost no probe itself),
    probes depth 1 as a fresh governor would; a governor without an observed step is nobody's prior."""
    family = GovernorFamily()
    drive(family.governor(4, (0, 1, 3)), LOSES, 400, seed=3)
    lost = family.governor(4, (0, 1, 3))._arms[1].interval
    inheritor = family.governor(5, (0, 1, 3))
    assert inheritor._arms[1].due == lost // 2 > 2 * inheritor.min_probe_interval
    drive(inheritor, LOSES, 10, seed=4)  # its own steps, none at depth 1 yet
    assert inheritor.steps_at[1] == 0 and family.prior_for(6) is inheritor
    grandchild = family.governor(6, (0, 1, 3))
    assert grandchild._arms[1].due == 0
    depths = drive(grandchild, LOSES, 10, seed=5)
    assert 1 in depths, depths  # probed at once, after the initial measurement
    family.governor(16, (0, 1, 3))  # created, never observed
    assert family.prior_for(15) is None and family.prior_for(9) is grandchild


def test_a_lost_probe_defers_the_same_probe_at_near_batch_sizes_running_the_same_depth() -> None:
    """bs 4's first probe of depth 1 loses: bs 6 (within a factor of two, also at depth 0) waits at least half
    bs 4's new interval before probing depth 1; bs 9 (more than twice 4) and a governor running depth 1 do not
    change; a probe in flight is left alone."""
    family = GovernorFamily()
    near, far = family.governor(6, (0, 1, 3)), family.governor(9, (0, 1, 3))
    running_1 = family.governor(5, (1, 3))
    assert running_1.current == 1
    for governor in (near, far):
        governor.observe(0, [0] * 2, 1e-3)
    loser = family.governor(4, (0, 1, 3))
    before = {id(g): (g._arms[1].interval, g._arms[1].due) for g in (far, running_1)}
    depths = drive(loser, LOSES, 40, seed=8)
    assert 1 in depths and loser._arms[1].num_lost >= 1 and loser.current == 0
    half = loser._arms[1].interval // 2
    assert half >= loser.min_probe_interval
    assert near._arms[1].interval >= half and near._arms[1].due >= half, (near._arms[1], half)
    assert near._arms[1].num_lost == 0  # a deferral, not a loss of its own: never passed on
    assert {id(g): (g._arms[1].interval, g._arms[1].due) for g in (far, running_1)} == before
    # a probe in flight is not cut short or moved
    probing = SpecGovernor((0, 1))
    while probing.choose() == 0:  # its first measurement of depth 0, then depth 1 at once
        probing.observe(0, [0], 1e-3)
    assert probing.choose() == 1 and probing.probing == 1
    probing.defer_probe(1, 4096)
    assert probing.choose() == 1 and probing._arms[1].due == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"acceptance": AcceptanceEstimate()}, "family"),
        ({"initial": 1}, "family"),
        ({"acceptance_decay": 0.0}, "decay"),
    ],
)
def test_bad_family_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GovernorFamily(**kwargs)


def test_a_batch_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        GovernorFamily().governor(0, (0, 1))


@pytest.mark.parametrize("scenario", ["loses everywhere", "wins everywhere"])
def test_over_a_wandering_batch_size_the_family_beats_independent_governors(scenario: str) -> None:
    """Mean over 8 wandering traces of 2000 steps (`bench.spec_family_model`, 20 seeds: loses 0.984 vs 0.972,
    wins 1.330 vs 1.297 of depth 0)."""
    shared, alone = [], []
    for seed in range(8):
        sizes = wander(2000, 20.0, random.Random(100 + seed))
        shared.append(replay(SCENARIOS[scenario], sizes, seed, share=True))
        alone.append(replay(SCENARIOS[scenario], sizes, seed, share=False))
    vs_zero = [statistics.fmean(r[0] for r in runs) for runs in (shared, alone)]
    off_best = [statistics.fmean(r[2] for r in runs) for runs in (shared, alone)]
    assert vs_zero[0] > vs_zero[1], vs_zero
    assert off_best[0] < off_best[1], off_best
