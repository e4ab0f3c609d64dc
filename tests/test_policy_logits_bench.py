"""bench/policy_logits.py: its traces are bench.traces' synthetic traces, its mapping and its cache model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.policy_logits import mapped_values, simulate, trace_with_logits
from bench.traces import synthetic_trace


@pytest.mark.parametrize(("skew", "reuse", "seed"), [((0.8, 1.4), 0.3, 3), ((0.0, 0.3), 0.0, 8)])
def test_trace_ids_are_the_synthetic_traces(skew, reuse, seed):
    ids, logits = trace_with_logits(
        7, num_layers=3, num_experts=13, top_k=3, skew=skew, reuse=reuse, seed=seed
    )
    ref = synthetic_trace(7, num_layers=3, num_experts=13, top_k=3, skew=skew, reuse=reuse, seed=seed)
    assert np.array_equal(ids, ref.ids[:, :, 0].numpy())
    assert logits.shape == (7, 3, 13) and np.isfinite(logits).all()
    # a routed expert without the reuse boost is among the top-k logits of its tick
    assert (np.take_along_axis(logits[0], ids[0], 1).min(1) >= -np.sort(-logits[0], 1)[:, 2]).all()


def test_mapped_values_hands_out_each_layers_curve_in_logit_order():
    g = np.random.default_rng(4)
    counts = g.integers(0, 5, size=(3, 11)).astype(np.float64)  # ties on purpose
    order_by = g.normal(size=(3, 11))
    order_by[1, 3] = order_by[1, 7]  # a tie: the lower expert id goes first
    out = mapped_values(counts, order_by)
    for layer in range(3):
        curve = sorted(counts[layer], reverse=True)
        ranked = sorted(range(11), key=lambda e: (-order_by[layer, e], e))
        for place, e in enumerate(ranked):
            assert out[layer, e] == curve[place], (layer, e)


@pytest.mark.parametrize("mode", ["lru", "counts", "logits"])
def test_a_pool_of_every_expert_misses_only_first_uses(mode):
    ids, logits = trace_with_logits(9, num_layers=4, num_experts=7, top_k=2, seed=1)
    accesses = sum(len(set(ids[s, layer].tolist())) for s in range(9) for layer in range(4))
    first = len({(layer, e) for s in range(9) for layer in range(4) for e in ids[s, layer].tolist()})
    assert simulate(ids, logits, 4 * 7, mode, warmup=0) == pytest.approx(first / accesses)


def test_small_pool_lru_by_hand():
    # one layer, 4 experts, 1 per tick, 2 rows: 0 1 0 2 1 -> 0 m, 1 m, 0 h, 2 m (evicts 1), 1 m (evicts 0)
    ids = np.array([0, 1, 0, 2, 1])[:, None, None]
    logits = torch.zeros(5, 1, 4).numpy()
    assert simulate(ids, logits, 2, "lru", warmup=0) == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="num_rows"):
        simulate(ids, logits, 5, "lru")
    with pytest.raises(ValueError, match="mode"):
        simulate(ids, logits, 2, "belady")
