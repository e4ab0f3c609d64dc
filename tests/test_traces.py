"""Trace tools: synthetic traces have the asked-for shape, skew and reuse; Belady against exhaustive search
and against the online policies; recording and saving round-trip."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from bench.traces import (
    Trace,
    TraceRecorder,
    _ticks,
    belady_hit_rate,
    policy_hit_rate,
    synthetic_trace,
)
from pooled_runner.policies import FreqDecayPolicy, LRUPolicy


def exhaustive_best_hit_rate(trace: Trace, rows: int) -> float:
    """Best hit rate over every admission/eviction choice (tiny traces only)."""
    ticks = _ticks(trace)

    @functools.cache
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(ticks):
            return 0
        items = ticks[t]
        hits = sum(i in cache for i in items)
        misses = [i for i in items if i not in cache]
        evictable = [c for c in cache if c not in items]
        out = 0
        for k in range(len(misses) + 1):
            for admitted in itertools.combinations(misses, k):
                need = max(0, k - (rows - len(cache)))
                if need > len(evictable):
                    continue
                for evicted in itertools.combinations(evictable, need):
                    nxt = frozenset((cache - set(evicted)) | set(admitted))
                    out = max(out, best(t + 1, nxt))
        return hits + out

    return best(0, frozenset()) / sum(len(x) for x in ticks)


def test_synthetic_trace_shape_and_distinct_ids():
    tr = synthetic_trace(6, num_layers=3, num_experts=11, top_k=3, tokens_per_step=2, seed=1)
    assert tr.ids.shape == (6, 3, 2, 3) and tr.ids.dtype == torch.int32
    assert tr.num_experts_per_layer == [11, 11, 11]
    assert int(tr.ids.min()) >= 0 and int(tr.ids.max()) < 11
    sorted_ids = tr.ids.sort(dim=-1).values
    assert (sorted_ids[..., 1:] != sorted_ids[..., :-1]).all(), "a token routed one expert twice"


def _reuse_fraction(tr: Trace) -> float:
    prev, cur = tr.ids[:-1], tr.ids[1:]  # [S-1, L, T, K]
    same = (cur[..., :, None] == prev[..., None, :]).any(-1)
    return float(same.float().mean())


def _top_share(tr: Trace, top: int) -> float:
    counts = torch.zeros(tr.num_layers, max(tr.num_experts_per_layer))
    for layer in range(tr.num_layers):
        counts[layer] = torch.bincount(tr.ids[:, layer].reshape(-1).long(), minlength=counts.shape[1]).float()
    return float(counts.sort(dim=1, descending=True).values[:, :top].sum() / counts.sum())


def test_skew_and_reuse_knobs_move_the_statistics():
    flat = synthetic_trace(200, num_layers=2, num_experts=32, top_k=2, skew=(0.0, 0.0), reuse=0.0, seed=2)
    skewed = synthetic_trace(200, num_layers=2, num_experts=32, top_k=2, skew=(1.5, 1.5), reuse=0.0, seed=2)
    sticky = synthetic_trace(200, num_layers=2, num_experts=32, top_k=2, skew=(0.0, 0.0), reuse=0.8, seed=2)
    assert _top_share(flat, 4) < 0.25 < 0.6 < _top_share(skewed, 4)
    assert _reuse_fraction(flat) < 0.15 and _reuse_fraction(sticky) > 0.75


def test_same_seed_same_trace():
    a = synthetic_trace(5, num_layers=2, num_experts=9, top_k=2, drift_every=2, seed=3)
    b = synthetic_trace(5, num_layers=2, num_experts=9, top_k=2, drift_every=2, seed=3)
    assert torch.equal(a.ids, b.ids)


@pytest.mark.parametrize("seed", range(12))
def test_belady_against_exhaustive_search(seed):
    g = torch.Generator().manual_seed(seed)
    L, E, K, S = 2, 4, 2, 5
    ids = torch.stack(
        [torch.stack([torch.randperm(E, generator=g)[:K].reshape(1, K) for _ in range(L)]) for _ in range(S)]
    ).int()
    tr = Trace(ids, [E] * L)
    for rows in (1, 2, 3):
        best = exhaustive_best_hit_rate(tr, rows)
        got = belady_hit_rate(tr, rows)
        assert got <= best + 1e-12
        assert got >= best - 0.05 - 1e-12, f"rows {rows}: belady {got} far from optimum {best}"


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_at_least_the_online_policies(seed):
    tr = synthetic_trace(30, num_layers=4, num_experts=16, top_k=3, tokens_per_step=2, reuse=0.4, seed=seed)
    for rows in (6, 20, 40):
        best = belady_hit_rate(tr, rows)
        for policy in (LRUPolicy(), FreqDecayPolicy(decay_steps=8)):
            assert policy_hit_rate(tr, rows, policy) <= best + 1e-12
    assert belady_hit_rate(tr, 64) == policy_hit_rate(tr, 64, LRUPolicy())  # all fit: only cold misses


def test_recorder_round_trip(tmp_path):
    rec = TraceRecorder([5, 3])
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(4):
        step = [torch.randint(-1, 3, (2, 2), generator=g) for _ in range(2)]
        for layer, ids in enumerate(step):
            rec.record(layer, ids)
        steps.append(torch.stack(step))
    rec.record(0, torch.zeros(2, 2, dtype=torch.int64))  # an incomplete last step is dropped
    tr = rec.trace()
    assert torch.equal(tr.ids, torch.stack(steps).int())
    path = str(tmp_path / "trace.pt")
    tr.save(path)
    back = Trace.load(path)
    assert torch.equal(back.ids, tr.ids) and back.num_experts_per_layer == [5, 3]
    rec.record(1, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"record\(layer=1\) out of order"):
        rec.record(1, torch.zeros(2, 2))


def test_recorder_keeps_router_scores_padded_to_the_widest_layer(tmp_path):
    rec = TraceRecorder([5, 3])
    g = torch.Generator().manual_seed(1)
    scores = []
    for _ in range(3):
        step = [torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)]
        for layer, s in enumerate(step):
            rec.record(layer, torch.randint(0, 3, (2, 2), generator=g), s)
        scores.append(step)
    tr = rec.trace()
    assert tr.scores is not None and tr.scores.shape == (3, 2, 2, 5)
    for i, (s0, s1) in enumerate(scores):
        assert torch.equal(tr.scores[i, 0], s0) and torch.equal(tr.scores[i, 1, :, :3], s1)
        assert bool((tr.scores[i, 1, :, 3:] == float("-inf")).all())  # past layer 1's experts
    path = str(tmp_path / "scored.pt")
    tr.save(path)
    back = Trace.load(path)
    assert back.scores is not None and torch.equal(back.scores, tr.scores)
    with pytest.raises(ValueError, match=r"router_scores has shape \(2, 4\), expected \[T=2, E=5\]"):
        rec.record(0, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 4))
    for layer in (0, 1):  # a step without scores: the trace has none
        rec.record(layer, torch.zeros(2, 2, dtype=torch.int64))
    assert rec.trace().scores is None
    with pytest.raises(ValueError, match="trace scores have shape"):
        Trace(tr.ids, [5, 3], tr.scores[:, :, :, :4])


def test_synthetic_scores_select_the_ids():
    """The scores a synthetic trace carries are what its top-k was taken on (before the reuse boost: with no
    reuse, exactly); spreading the noise changes the ids but keeps that."""
    for scale in (None, (0.5, 2.0)):
        tr = synthetic_trace(6, 3, 16, 4, reuse=0.0, seed=3, with_scores=True, noise_scale=scale)
        assert tr.scores is not None and tr.scores.dtype == torch.float32
        top = torch.topk(tr.scores.double(), 4, dim=-1).indices
        assert torch.equal(top.sort(-1).values, tr.ids.long().sort(-1).values)
    plain = synthetic_trace(6, 3, 16, 4, seed=3)
    assert plain.scores is None
    assert torch.equal(plain.ids, synthetic_trace(6, 3, 16, 4, seed=3, with_scores=True).ids)
