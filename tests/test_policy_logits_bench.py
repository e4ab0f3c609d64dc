"""bench/policy_logits.py: its traces are bench.traces' synthetic traces, its mapping and its cache model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.policy_logits import mapped_values, simulate, soft_membership, trace_with_logits
from bench.traces import synthetic_trace


@pytest.mark.parametrize(("skew", "reuse", "seed"), [((0.8, 1.4), 0.3, 3), ((0.0, 0.3), 0.0, 8)])
def test_trace_ids_are_the_synthetic_traces(skew, reuse, seed):
    ids, logits = trace_with_logits(
        7, num_layers=3, num_experts=13, top_k=3, skew=skew, reuse=reuse, seed=seed
    )
    ref = synthetic_trace(7, num_layers=3, num_experts=13, top_k=3, skew=skew, reuse=reuse, seed=seed)
    assert np.array_equal(ids, ref.ids[:, :, 0].numpy())
    assert logits.shape == (7, 3, 13) and np.isfinite(logits).all() and np.abs(logits).max() < 1e3
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


def test_small_pool_counts_and_logits_by_hand():
    """One layer, 4 experts, 1 per tick, 2 rows, bonus 0.5: ids 0 1 0 2 1 3 3 3.
    counts: t4 evicts 1 (value 1 < 2's 1.5); t5 evicts 2 (1 < 1's 2.5); t6, t7 and t8 read 3 in place (1.5 < 2:
    a run of 3 counts once): 7 misses of 8.
    logits (expert 3's logits highest, then 0, 1, 2 by id): t4 reads 2 in place (its mapped count 0 + 0.5 < 1);
    t5 hits 1; t6 evicts 1 (mapped 1) for 3 (mapped 2 + 0.5); t7, t8 hit: 4 of 8. LRU: 5 of 8."""
    ids = np.array([0, 1, 0, 2, 1, 3, 3, 3])[:, None, None]
    logits = np.tile(np.array([0.0, 0.0, 0.0, 10.0]), (8, 1, 1))
    assert simulate(ids, logits, 2, "counts", warmup=0, bonus=0.5) == pytest.approx(7 / 8)
    assert simulate(ids, logits, 2, "logits", warmup=0, bonus=0.5) == pytest.approx(4 / 8)
    assert simulate(ids, logits, 2, "lru", warmup=0, bonus=0.5) == pytest.approx(5 / 8)


def _reference_simulate(ids, logits, num_rows, mode, warmup, bonus):
    """`simulate`'s rules in plain Python (dicts and sorts), for the comparison below."""
    S, L, _ = ids.shape
    E = logits.shape[2]
    resident, counts, last = set(), {}, {}
    summed = [[0.0] * E for _ in range(L)]
    hits = misses = tick = 0
    for s in range(S):
        for layer in range(L):
            tick += 1
            now = sorted(set(ids[s, layer].tolist()))
            missed = [e for e in now if (layer, e) not in resident]
            if s >= warmup:
                hits, misses = hits + len(now) - len(missed), misses + len(missed)
            for e in now:
                if last.get((layer, e)) != tick - L:
                    counts[(layer, e)] = counts.get((layer, e), 0) + 1
                last[(layer, e)] = tick
            for e in range(E):
                summed[layer][e] += float(logits[s, layer, e])

            def value(lay, e, tick=tick):
                if mode == "lru":
                    return last.get((lay, e), -(10**9))
                if mode == "counts":
                    base = counts.get((lay, e), 0)
                else:  # the layer's counts, largest first, in the order of the summed logits (ties by id)
                    curve = sorted((counts.get((lay, x), 0) for x in range(E)), reverse=True)
                    ranked = sorted(range(E), key=lambda x: (-summed[lay][x], x))
                    base = curve[ranked.index(e)]
                return base + bonus * (tick - last.get((lay, e), -(10**9)) < L)

            values = {(lay, e): value(lay, e) for lay in range(L) for e in range(E)}
            for e in missed:
                if len(resident) < num_rows:
                    resident.add((layer, e))
                    continue
                victims = [r for r in resident if not (r[0] == layer and r[1] in now)]
                if not victims:
                    break
                victim = min(victims, key=lambda r: (values[r], r[0] * E + r[1]))
                if mode != "lru" and values[(layer, e)] < values[victim]:
                    continue
                resident.remove(victim)
                resident.add((layer, e))
    return misses / (hits + misses)


@pytest.mark.parametrize("mode", ["lru", "counts", "logits"])
def test_simulate_equals_a_plain_reference(mode):
    ids, logits = trace_with_logits(30, num_layers=3, num_experts=9, top_k=2, reuse=0.4, seed=9)
    for rows, bonus in ((5, 3.0), (11, 0.5)):
        want = _reference_simulate(ids, logits, rows, mode, 4, bonus)
        assert simulate(ids, logits, rows, mode, warmup=4, bonus=bonus) == pytest.approx(want), (rows, bonus)


def test_logits_are_read_only_up_to_the_current_tick():
    ids, logits = trace_with_logits(40, num_layers=4, num_experts=16, top_k=3, seed=2)
    other = logits.copy()
    other[25:] = np.random.default_rng(0).normal(size=other[25:].shape) * 5
    for n in (10, 25):
        a = simulate(ids[:n], logits, 20, "logits", warmup=3)
        assert a == simulate(ids[:n], other, 20, "logits", warmup=3), n
    # and they do matter: the whole trace differs once they differ
    assert simulate(ids, logits, 20, "logits", warmup=3) != simulate(ids, other, 20, "logits", warmup=3)


def test_perturbed_traces_and_soft_membership():
    ids, logits = trace_with_logits(6, num_layers=2, num_experts=9, top_k=3, seed=4, noise_scale=(0.5, 2.0),
                                    hidden_bias=0.5)  # fmt: skip
    plain, _ = trace_with_logits(6, num_layers=2, num_experts=9, top_k=3, seed=4)
    assert not np.array_equal(ids, plain)  # the perturbations move the selection
    assert ((ids >= 0) & (ids < 9)).all() and all(len(set(t)) == 3 for t in ids.reshape(-1, 3).tolist())
    assert np.isfinite(logits).all() and np.abs(logits).max() < 1e3
    m = soft_membership(logits, 3, tau=0.7)
    for s in range(6):
        for layer in range(2):
            kth = sorted(logits[s, layer], reverse=True)[2]
            ref = [1 / (1 + np.exp(-(v - kth) / 0.7)) for v in logits[s, layer]]
            np.testing.assert_allclose(m[s, layer], ref, rtol=1e-12)
    with pytest.raises(ValueError, match="tau"):
        soft_membership(logits, 3, tau=0.0)
