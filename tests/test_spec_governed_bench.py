"""bench/spec_governed.py on the CPU at a tiny shape: verify-step routing against a plain loop, and the whole
pipeline (fixed depths and the governor on one shared pool, sampled acceptance, table and summary)."""

from __future__ import annotations

import random

import pytest
import torch

from bench import spec_governed, spec_steps
from bench.decode_steps import Shape
from bench.spec_governor_model import sample_accepted
from pooled_runner import spec_state

SHAPE = Shape(H=16, I=8, E=12, K=3, L=2)


def test_verify_ids_take_right_drafts_from_the_true_lane_and_wrong_ones_from_the_other() -> None:
    g = torch.Generator().manual_seed(3)
    lanes = torch.randint(0, 12, (23, 2, 6, 3), generator=g)  # [tokens, L, 2 x bs, K], bs 3
    positions = [0, 5, 17]
    for depth, accepted in ((0, [0, 0, 0]), (1, [1, 0, 1]), (3, [0, 3, 2])):
        got = spec_steps.verify_ids(lanes, positions, depth, accepted)
        assert got.shape == (2, 3 * (1 + depth), 3)
        for layer in range(2):
            want = [
                lanes[p + j, layer, b if j <= accepted[b] else 3 + b]
                for b, p in enumerate(positions)
                for j in range(1 + depth)
            ]
            assert torch.equal(got[layer], torch.stack(want)), (depth, layer)


def test_sampled_acceptance_is_a_chain() -> None:
    rng = random.Random(5)
    draws = [sample_accepted(3, rng, 0.6) for _ in range(20000)]
    assert set(draws) == {0, 1, 2, 3}
    mean = sum(draws) / len(draws)
    assert abs(mean - (0.6 + 0.36 + 0.216)) < 0.03, mean
    assert all(sample_accepted(0, rng, 0.9) == 0 for _ in range(50))


def test_fixed_depths_and_the_governor_on_one_pool() -> None:
    header, rows = spec_governed.run(
        SHAPE,
        torch.device("cpu"),
        {1: 40, 3: 30},
        warm=2,
        accept=0.6,
        pools=(0.5,),
        batches=(1, 3),
        commit="t",
    )
    assert "commit t" in header[0]
    assert len(rows) == 2 * 4
    by = {(r[0], r[2]): r for r in rows}
    for bs, steps in ((1, 40), (3, 30)):
        for d in spec_governed.DEPTHS:
            r = by[(bs, f"depth {d}")]
            assert r[3] == steps - 2 and r[9] == ", ".join(
                f"{k}: {r[3] if k == d else 0}" for k in spec_governed.DEPTHS
            )
            assert r[4] == 1.0 if d == 0 else 1.0 <= r[4] <= 1 + d
            assert r[5] > 0 and r[6] > 0
        assert by[(bs, "depth 0")][7] == 1.0
        governed = by[(bs, "governed")]
        counts = [int(part.split(": ")[1]) for part in governed[9].split(", ")]
        assert sum(counts) == governed[3] > 0
        assert governed[8] == governed[6] / max(by[(bs, f"depth {d}")][6] for d in spec_governed.DEPTHS)
    line = spec_governed.summary(rows)
    assert line.startswith("governed / depth 0: ") and "over 2 (bs, pool) cases" in line


def test_only_depth_0_fixed_still_compares_the_governor() -> None:
    _, rows = spec_governed.run(
        SHAPE,
        torch.device("cpu"),
        {2: 25},
        warm=2,
        accept=0.6,
        pools=(0.25,),
        batches=(2,),
        fixed_depths=(0,),
    )
    assert [r[2] for r in rows] == ["depth 0", "governed"]
    assert rows[1][7] == rows[1][8] == rows[1][6] / rows[0][6]
    assert "depth 3 /" not in spec_governed.summary(rows)


def test_rounds_sum_each_policy_and_report_every_rounds_ratio() -> None:
    _, rows = spec_governed.run(
        SHAPE,
        torch.device("cpu"),
        {3: 20},
        warm=2,
        accept=0.6,
        pools=(0.5,),
        batches=(3,),
        fixed_depths=(0, 3),
        rounds=3,
    )
    by = {r[2]: r for r in rows}
    assert list(by) == ["depth 0", "depth 3", "governed"]
    for r in rows:
        assert r[3] == 3 * (20 - 2), r  # three rounds of the counted steps
        ratios = [float(v) for v in r[11].split(", ")]
        assert len(ratios) == 3 and all(v > 0 for v in ratios), r
    assert by["depth 0"][11] == "1.000, 1.000, 1.000"
    # every round runs the same trace and acceptance: a fixed depth's tokens per step are the same each round
    assert by["depth 3"][4] > 1.0
    # 12 rows for 24 experts: steps miss, and depth 3's 4 tokens per request read more distinct experts per layer
    # than depth 0's one; a step misses at most its distinct routes (L x bs x K at depth 0: the count is the
    # counted steps' own, not the pool's total since it was built)
    misses0, misses3 = by["depth 0"][10], by["depth 3"][10]
    assert 0 < misses0 <= SHAPE.L * 3 * SHAPE.K and misses0 < misses3 <= SHAPE.L * SHAPE.E, (misses0, misses3)
    with pytest.raises(ValueError, match="rounds=0"):
        spec_governed.run(
            SHAPE, torch.device("cpu"), {1: 5}, warm=1, accept=0.6, pools=(0.5,), batches=(1,), rounds=0
        )


def test_a_warmed_governor_counts_only_the_steps_after_its_learning(monkeypatch: pytest.MonkeyPatch) -> None:
    """`governor_warm`: a row "governed, warmed N, reloaded" whose governor observed N steps (its learning), was
    saved to a JSON file and loaded into a fresh family (`spec_state`), and the loaded governor counted as many
    steps as the other policies, its steps at each depth summing to them, over the same trace window (its learning
    run and its counted run each start at the trace's start, as every other row does); negative N refused."""
    from pooled_runner import spec_family

    observed: list[int] = []

    class Counting(spec_family.SpecGovernor):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            observed.append(0)

        def observe(self, *args, **kwargs) -> None:
            observed[-1] += 1
            super().observe(*args, **kwargs)

    loads: list[tuple[str, object]] = []

    def load_family(path, fingerprint, **kwargs):  # type: ignore[no-untyped-def]
        family = spec_state.load_family(path, fingerprint, **kwargs)
        loads.append((path, family))
        return family

    launched: list[tuple[int, torch.Tensor]] = []
    launch = spec_steps.DepthGraphs.launch

    def recording(self, d, ids):  # type: ignore[no-untyped-def]
        launched.append((d, ids.clone()))
        return launch(self, d, ids)

    monkeypatch.setattr(spec_family, "SpecGovernor", Counting)
    monkeypatch.setattr(spec_governed, "load_family", load_family)
    monkeypatch.setattr(spec_steps.DepthGraphs, "launch", recording)
    _, rows = spec_governed.run(
        SHAPE,
        torch.device("cpu"),
        {3: 24},
        warm=2,
        accept=0.6,
        pools=(0.5,),
        batches=(3,),
        fixed_depths=(0,),
        governor_warm=40,
    )
    assert [r[2] for r in rows] == ["depth 0", "governed", "governed, warmed 40, reloaded"]
    # the cold governor, the warmed one's learning, the governor loaded from its saved state
    assert observed == [24 - 2, 40, 24 - 2], observed
    assert len(loads) == 1 and loads[0][1] is not None and loads[0][0].endswith(".json"), loads
    warmed = rows[2]
    assert warmed[3] == rows[1][3] == 24 - 2
    counts = [int(part.split(": ")[1]) for part in warmed[9].split(", ")]
    assert sum(counts) == warmed[3]
    assert warmed[7] == warmed[6] / rows[0][6] and 0 < warmed[10] <= SHAPE.L * SHAPE.E
    # launches: depth 0's 24, the cold governor's 24, the warmed one's learning 2 + 40, then its counted 24; each
    # counted run's first steps (the uncounted warm-up at depth 0) read the trace's first tokens, the learning
    # run's a later stretch (past any counted run's 24 x 4 tokens)
    assert len(launched) == 24 + 24 + 42 + 24, len(launched)
    for first in (24, 90):
        for k in range(2):
            same = torch.equal(launched[first + k][1], launched[k][1])
            assert launched[first + k][0] == 0 and same, (first, k)
    assert launched[48][0] == 0 and not torch.equal(launched[48][1], launched[0][1])
    assert not torch.equal(launched[90][1], launched[47][1])  # the trace moves on within a run
    with pytest.raises(ValueError, match="governor_warm=-1"):
        spec_governed.run(
            SHAPE,
            torch.device("cpu"),
            {1: 5},
            warm=1,
            accept=0.6,
            pools=(0.5,),
            batches=(1,),
            governor_warm=-1,
        )
