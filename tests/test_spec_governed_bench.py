"""bench/spec_governed.py on the CPU at a tiny shape: verify-step routing against a plain loop, and the whole
pipeline (fixed depths and the governor on one shared pool, sampled acceptance, table and summary)."""

from __future__ import annotations

import random

import torch

from bench import spec_governed
from bench.decode_steps import Shape

SHAPE = Shape(H=16, I=8, E=12, K=3, L=2)


def test_verify_ids_take_right_drafts_from_the_true_lane_and_wrong_ones_from_the_other() -> None:
    g = torch.Generator().manual_seed(3)
    lanes = torch.randint(0, 12, (23, 2, 6, 3), generator=g)  # [tokens, L, 2 x bs, K], bs 3
    positions = [0, 5, 17]
    for depth, accepted in ((0, [0, 0, 0]), (1, [1, 0, 1]), (3, [0, 3, 2])):
        got = spec_governed.verify_ids(lanes, positions, depth, accepted)
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
    draws = [spec_governed.sample_accepted(3, 0.6, rng) for _ in range(20000)]
    assert set(draws) == {0, 1, 2, 3}
    mean = sum(draws) / len(draws)
    assert abs(mean - (0.6 + 0.36 + 0.216)) < 0.03, mean
    assert all(spec_governed.sample_accepted(0, 0.9, rng) == 0 for _ in range(50))


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
