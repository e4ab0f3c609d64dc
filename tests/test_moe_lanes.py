"""Decode lanes in `PooledMoE`: steps within the lanes take the decode path and are never staged.

Regression guarded: `--max-running-requests 1` with 3 speculative tokens gives 4-token verify steps; with
staging from 2 tokens on, such a step would be staged (a prefill/partition step) unless the lanes say 4.
"""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.lanes import decode_lanes

H, I, K, E, LAYERS = 16, 8, 2, 7, 3


def make(rows: int, staging: bool) -> PooledMoE:
    config = PoolConfig(pool_rows=rows, device="cpu", prefill_staging=staging, staging_min_tokens=2)
    moe = PooledMoE(config, H, I, top_k=K, dtype=torch.float32)
    for _ in range(LAYERS):
        moe.register_layer(E)
    g = torch.Generator().manual_seed(3)
    weights = {
        (layer, e): {"w13": torch.randn(2 * I, H, generator=g), "w2": torch.randn(H, I, generator=g)}
        for layer in range(LAYERS)
        for e in range(E)
    }
    moe.install(lambda layer, e: weights[(layer, e)])
    return moe


def step(moe: PooledMoE, reference: PooledMoE, num_tokens: int, g: torch.Generator) -> None:
    for layer in range(LAYERS):
        x = torch.randn(num_tokens, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)])  # [T, K]
        w = torch.rand(num_tokens, K, generator=g)
        got, expected = moe.forward(layer, x, ids, w), reference.forward(layer, x, ids, w)
        assert torch.equal(got, expected), (
            f"layer {layer}, {num_tokens} tokens: {(got - expected).abs().max()}"
        )


def test_verify_steps_of_one_request_are_never_staged() -> None:
    g = torch.Generator().manual_seed(0)
    moe, reference = make(rows=3, staging=True), make(rows=LAYERS * E, staging=False)
    assert moe.stager is not None
    moe.set_decode_lanes(decode_lanes(max_running_requests=1, num_speculative_tokens=3))
    for width in (4, 1, 4, 3):  # verify, decode, verify, a shorter verify (early stop)
        step(moe, reference, width, g)
    assert moe.stager.stats.steps_staged == 0
    assert dict(moe.step_widths["decode"]) == {4: 2, 1: 1, 3: 1} and not moe.step_widths["prefill"]
    step(moe, reference, 5, g)  # one token past the lanes: a prefill step, staged
    assert moe.stager.stats.steps_staged == 1 and dict(moe.step_widths["prefill"]) == {5: 1}
    step(moe, reference, 4, g)  # back within the lanes: not staged again
    assert moe.stager.stats.steps_staged == 1 and moe.step_widths["decode"][4] == 3


def test_without_lanes_a_four_token_step_is_staged() -> None:
    """What the lanes prevent: the same 4-token step counts as a prefill step when the lanes are unknown."""
    g = torch.Generator().manual_seed(1)
    moe, reference = make(rows=3, staging=True), make(rows=LAYERS * E, staging=False)
    assert moe.stager is not None and moe.decode_lanes is None
    step(moe, reference, 4, g)
    assert moe.stager.stats.steps_staged == 1 and dict(moe.step_widths["prefill"]) == {4: 1}


def test_bad_lanes_are_refused() -> None:
    moe = make(rows=3, staging=False)
    with pytest.raises(ValueError, match="decode lanes 0 must be >= 1"):
        moe.set_decode_lanes(0)
