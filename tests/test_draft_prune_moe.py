"""`PooledMoE` with draft-lane pruning on the torch path: live lanes equal the all-resident (unpooled) forward bit
for bit, dead lanes admit and read nothing (every miss of a layer is a lane-0 expert), the pool and telemetry
equal a pool fed the reference-pruned routing, lane 0 is always live, and the live lanes form a chain."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.draft_prune import prune_reference
from pooled_runner.lanes import decode_lanes

H, I, K, E, LAYERS, ROWS = 16, 8, 2, 7, 3, 8


def make(rows: int, pruning: bool, lanes: int, budget: int = 0) -> PooledMoE:
    config = PoolConfig(
        pool_rows=rows,
        device="cpu",
        prefill_staging=False,
        telemetry=True,
        draft_pruning=pruning,
        max_draft_misses=budget,
    )
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
    moe.set_decode_lanes(lanes)
    return moe


def verify_routing(bs: int, num_spec: int, g: torch.Generator, reuse: float = 0.85) -> torch.Tensor:
    """`[bs * (1 + num_spec), K]` distinct ids per token; drafts repeat their lane 0's experts w.p. `reuse`."""
    lanes = 1 + num_spec
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs * lanes)])
    for t in range(ids.shape[0]):
        if t % lanes:
            lane0 = ids[t - t % lanes]
            for k in range(K):
                if torch.rand(1, generator=g).item() < reuse and lane0[k] not in ids[t]:
                    ids[t, k] = lane0[k]
    return ids


@pytest.mark.parametrize(
    ("bs", "num_spec", "budget", "fused"),
    [
        (1, 1, 0, False),
        (1, 3, 0, False),
        (3, 1, 0, False),
        (3, 3, 0, False),
        (3, 3, 0, True),
        (3, 3, 2, True),
    ],
)
def test_pruned_verify_steps(bs, num_spec, budget, fused):
    """`fused`: the one-launch kernel under the Triton interpreter instead of the torch ops. `budget`: unpaid
    routes a draft lane may have per step (`max_draft_misses`)."""
    lanes, T = 1 + num_spec, bs * (1 + num_spec)
    width = decode_lanes(bs, num_spec)
    pruned = make(ROWS, True, width, budget)
    twin, resident = make(ROWS, False, width), make(LAYERS * E, False, width)
    assert pruned.pool is not None and pruned.telemetry is not None and twin.telemetry is not None
    assert pruned.draft_pruner is not None
    pruned.draft_pruner.fused = fused
    row_bytes = pruned.pool.row_bytes
    g = torch.Generator().manual_seed(bs * 10 + num_spec)
    live_drafts = dead_drafts = 0
    routed_live = torch.zeros(LAYERS, E, dtype=torch.int64)
    for step in range(10):
        pruned.begin_verify_step(num_spec)
        alive, misses = [True] * T, [0] * T
        for layer in range(LAYERS):
            x = torch.randn(T, H, generator=g)
            ids, w = (
                verify_routing(bs, num_spec, g, 0.85 if budget == 0 else 0.4),
                torch.rand(T, K, generator=g),
            )
            l2p = pruned.pool.l2p_gpu[layer].tolist()
            alive = prune_reference(ids.tolist(), alive, l2p, ROWS, E, num_spec, budget, misses)
            live = torch.tensor(alive)
            # experts moved this layer: those of lane 0 and of live drafts (within the budget) not in a row
            live_misses = {int(e) for e in ids[live].reshape(-1) if l2p[int(e)] >= ROWS}
            before = pruned.pool.stats()
            out = pruned.forward(layer, x, ids, w)
            after = pruned.pool.stats()
            where = f"step {step} layer {layer}"
            # no dead-lane traffic: the layer's misses are exactly the live lanes' non-resident experts
            assert after.misses - before.misses == len(live_misses), where
            host = (after.bytes_read_host_view + after.bytes_copied_to_rows) - (
                before.bytes_read_host_view + before.bytes_copied_to_rows
            )
            assert host == len(live_misses) * row_bytes, where
            # live lanes exact against the unpooled forward of the original routing; dead lanes add nothing
            full = resident.forward(layer, x, ids, w)
            assert torch.equal(out[live], full[live]), where
            assert not out[~live].any(), where
            # the same as a pool fed the routing with dead lanes as padding
            neutral = torch.where(live[:, None], ids, -1)
            assert torch.equal(out, twin.forward(layer, x, neutral, torch.where(live[:, None], w, 0))), where
            for e in ids[live].reshape(-1).tolist():
                routed_live[layer, e] += 1
        got = pruned.draft_lane_alive()
        assert got.tolist() == alive, f"step {step}"
        per_request = got.view(bs, lanes)
        assert per_request[:, 0].all()
        assert torch.equal(per_request, per_request.int().cummin(1).values.bool())
        live_drafts += int(per_request[:, 1:].sum())
        dead_drafts += int((~per_request[:, 1:]).sum())
    assert live_drafts and dead_drafts, (live_drafts, dead_drafts)
    stats = pruned.stats()
    assert stats == twin.stats() and stats.misses > 0 and stats.admissions > 0, stats
    snap, twin_snap = pruned.telemetry.snapshot(), twin.telemetry.snapshot()
    assert snap.valid, "padding from pruning set the poison bit"
    assert torch.equal(snap.counts, routed_live) and torch.equal(snap.counts, twin_snap.counts)


def test_unmarked_steps_are_not_pruned():
    """With pruning on, a step not marked by `begin_verify_step` (plain decode, prefill) runs as without it."""
    pruned, twin, resident = make(ROWS, True, 8), make(ROWS, False, 8), make(LAYERS * E, False, 8)
    g = torch.Generator().manual_seed(5)
    pruned.begin_verify_step(3)
    for layer in range(LAYERS):  # one marked verify step first
        ids = verify_routing(2, 3, g)
        pruned.forward(layer, torch.randn(8, H, generator=g), ids, torch.rand(8, K, generator=g))
    marked = pruned.draft_lane_alive().clone()
    for layer in range(LAYERS):  # an unmarked step of another width (4 tokens)
        x, ids, w = torch.randn(4, H, generator=g), verify_routing(1, 3, g), torch.rand(4, K, generator=g)
        out = pruned.forward(layer, x, ids, w)
        assert torch.equal(out, resident.forward(layer, x, ids, w)), f"layer {layer}: unmarked step changed"
    assert torch.equal(pruned.draft_lane_alive(), marked), "lane_alive changed outside a verify step"
    # e.g. after replaying a graph 4 tokens wide
    assert torch.equal(pruned.draft_lane_alive(num_tokens=4), marked[:4])
    with pytest.raises(ValueError, match="num_tokens=0"):
        pruned.draft_lane_alive(num_tokens=0)
    with pytest.raises(RuntimeError, match="draft_pruning=True"):
        twin.begin_verify_step(3)
    with pytest.raises(RuntimeError, match="draft pruning is off"):
        twin.draft_lane_alive()
