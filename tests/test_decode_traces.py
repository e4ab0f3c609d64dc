"""The decode bench's trace families and MTP verify steps (bench/decode_traces.py), on the CPU at tiny shapes."""

from __future__ import annotations

import pytest
import torch

from bench.decode_traces import FAMILIES, PER_LAYER, RECORDED, TraceKey, build_traces, verify_steps
from bench.traces import synthetic_trace


def test_verify_steps_hold_consecutive_tokens_per_request():
    S, n, L, B, K = 3, 3, 2, 2, 2
    tokens = torch.arange(S * (1 + n) * L * B * K).reshape(S * (1 + n), L, B, K)
    steps = verify_steps(tokens, n)
    assert steps.shape == (S, L, B * (1 + n), K)
    for s in range(S):
        for b in range(B):
            for j in range(1 + n):
                assert torch.equal(steps[s, :, b * (1 + n) + j], tokens[s * (1 + n) + j, :, b])
    with pytest.raises(ValueError, match="do not split"):
        verify_steps(tokens[:5], n)


def test_build_traces_families_prefixes_and_mtp():
    L, E, K, steps, batches = 2, 12, 3, 4, (1, 3)
    traces, lines = build_traces(L, E, K, steps, batches, FAMILIES, 3, (PER_LAYER, RECORDED))
    assert len(lines) == len(FAMILIES) and all(f"of {E}" in line for line in lines)
    expected = {TraceKey(f, bs) for f in FAMILIES for bs in batches}
    expected |= {TraceKey(f, bs, 3) for f in (PER_LAYER, RECORDED) for bs in batches}
    assert set(traces) == expected
    for key, ids in traces.items():
        assert ids.shape == (steps, L, key.tokens, K) and ids.dtype == torch.int64, key
        assert int(ids.min()) >= 0 and int(ids.max()) < E
    for family in FAMILIES:  # families without MTP keep the trace the bench always ran
        if family != RECORDED:
            spec = {"skew": (1.0, 1.0)} if family == FAMILIES[0] else {"skew": (0.4, 1.6)}
            for bs in batches:
                ref = synthetic_trace(steps, L, E, K, bs, reuse=0.3, seed=17 + bs, **spec).ids.long()
                assert torch.equal(traces[TraceKey(family, bs)], ref), family
    for family in (PER_LAYER, RECORDED):  # a verify step's first token per request is the plain trace's token
        for bs in batches:
            plain, verify = traces[TraceKey(family, bs)], traces[TraceKey(family, bs, 3)]
            assert torch.equal(verify[0, :, ::4], plain[0]), family
            assert torch.equal(verify[0, :, 1::4], plain[1]), family
    # the recorded family's lanes are one run's sequences: bs 1 is the first lane of bs 3
    assert torch.equal(traces[TraceKey(RECORDED, 1)], traces[TraceKey(RECORDED, 3)][:, :, :1])
