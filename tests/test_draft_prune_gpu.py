"""GPU: a verify step with draft-lane pruning captured in a CUDA graph (no host sync while capturing) replays with
new routing and equals the same step run eagerly on an identical pool (outputs, routes, live lanes); the live
lanes are exactly the plain-Python rule's, from the location tables each layer saw; live lanes equal the
all-resident pool (exact on the pruned routing, to tolerance on the original one); the planner's misses are
only lane 0's experts; telemetry stays valid (dead lanes are padding, not poison)."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.draft_prune import prune_reference
from pooled_runner.lanes import decode_lanes
from tests.reference import random_expert_weights

pytestmark = pytest.mark.gpu

H, I, E, K, L, ROWS = 256, 128, 15, 4, 3, 16
DTYPE = torch.bfloat16


def build(rows: int, pruning: bool, lanes: int, weights) -> PooledMoE:  # type: ignore[no-untyped-def]
    cfg = PoolConfig(
        pool_rows=rows, device="cuda", prefill_staging=False, telemetry=pruning, draft_pruning=pruning
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=DTYPE)
    for _ in range(L):
        moe.register_layer(E)
    moe.install(lambda layer, e: weights[(layer, e)])
    moe.set_decode_lanes(lanes)
    return moe


class VerifyStack:
    """Router (elementwise, the same bits in graph and eager) + pooled layers; `step()` is what is captured."""

    def __init__(self, weights, bs: int, num_spec: int):  # type: ignore[no-untyped-def]
        self.bs, self.num_spec, self.T = bs, num_spec, bs * (1 + num_spec)
        self.moe = build(ROWS, True, decode_lanes(bs, num_spec), weights)
        g = torch.Generator(device="cuda").manual_seed(99)
        self.router = torch.randn(L, H, E, generator=g, device="cuda") / H**0.5
        T = self.T
        self.hidden = torch.zeros(T, H, dtype=DTYPE, device="cuda")
        self.bias = torch.zeros(L, T, E, device="cuda")
        self.h_in = torch.zeros(L, T, H, dtype=DTYPE, device="cuda")
        self.ids = torch.zeros(L, T, K, dtype=torch.int64, device="cuda")
        self.w = torch.zeros(L, T, K, dtype=DTYPE, device="cuda")
        self.y = torch.zeros(L, T, H, dtype=DTYPE, device="cuda")
        self.l2p_before = torch.zeros(L, E, dtype=torch.int32, device="cuda")

    def step(self) -> None:
        moe = self.moe
        assert moe.pool is not None
        moe.begin_verify_step(self.num_spec)
        h = self.hidden
        for layer in range(L):
            self.h_in[layer].copy_(h)
            logits = (h.float()[:, :, None] * self.router[layer][None]).sum(1) + self.bias[layer]  # [T, E]
            vals, ids = torch.topk(logits, K, dim=-1)  # [T, K]
            w = torch.softmax(vals, dim=-1).to(DTYPE)
            self.ids[layer].copy_(ids)
            self.w[layer].copy_(w)
            self.l2p_before[layer].copy_(moe.pool.l2p_gpu[layer, :E])
            y = moe.forward(layer, h, ids, w)
            self.y[layer].copy_(y)
            h = h + y

    def set_inputs(self, g: torch.Generator) -> None:
        """Drafts close to their request's lane 0 (hidden and router bias), so some drafts survive."""
        lanes = 1 + self.num_spec
        base = torch.randn(self.bs, 1, H, generator=g, device="cuda")
        noise = 0.3 * torch.randn(self.bs, lanes, H, generator=g, device="cuda")
        self.hidden.copy_((base + noise).reshape(self.T, H).to(DTYPE))
        bias = 3.0 * torch.randn(L, self.bs, 1, E, generator=g, device="cuda")
        bias = bias + 0.5 * torch.randn(L, self.bs, lanes, E, generator=g, device="cuda")
        self.bias.copy_(bias.reshape(L, self.T, E))


def assert_close(out, ref, what, rel=2e-2):  # type: ignore[no-untyped-def]
    o, r = out.float().cpu(), ref.float().cpu()
    scale = r.abs().max().item() if r.numel() else 0.0
    bad = ((o - r).abs() > rel * (r.abs() + scale)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} mismatches, first at {bad[:5].tolist()}"


@pytest.mark.parametrize(("bs", "num_spec"), [(1, 3), (3, 1), (2, 3)])
def test_captured_pruned_verify_step_replays_like_eager(bs, num_spec):
    weights = random_expert_weights(L, E, H, I, DTYPE, seed=5)
    graphed, eager = VerifyStack(weights, bs, num_spec), VerifyStack(weights, bs, num_spec)
    resident = build(L * E, False, graphed.T, weights)
    lanes = 1 + num_spec
    g_graph = torch.Generator(device="cuda").manual_seed(bs)
    g_eager = torch.Generator(device="cuda").manual_seed(bs)
    for stack, gen in ((graphed, g_graph), (eager, g_eager)):  # eager first: compiles, allocates lane_alive
        stack.set_inputs(gen)
        stack.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            graphed.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    planner = graphed.moe._gpu().planner
    assert planner is not None
    live_drafts = dead_drafts = 0
    for replay in range(10):
        graphed.set_inputs(g_graph)
        eager.set_inputs(g_eager)
        before = planner.counter_values()
        graph.replay()
        eager.step()
        torch.cuda.synchronize()
        after = planner.counter_values()
        where = f"replay {replay}"
        alive = graphed.moe.draft_lane_alive()
        for name in ("y", "ids", "w", "l2p_before"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), f"{where}: {name} differs"
        assert torch.equal(alive, eager.moe.draft_lane_alive()), f"{where}: lane_alive differs"
        # the rule, layer by layer, from the tables each layer saw
        expect, misses = [True] * graphed.T, [0] * graphed.T
        lane0_misses = 0
        for layer in range(L):
            ids, l2p = graphed.ids[layer].cpu(), graphed.l2p_before[layer].cpu().tolist()
            expect = prune_reference(ids.tolist(), expect, l2p, ROWS, E, num_spec, 0, misses)
            lane0_misses += len({int(e) for e in ids[::lanes].reshape(-1) if l2p[int(e)] >= ROWS})
            live = torch.tensor(expect, device="cuda")
            x, w = graphed.h_in[layer], graphed.w[layer]
            pruned_ids = torch.where(live[:, None], graphed.ids[layer], -1)
            exact = resident.forward(layer, x, pruned_ids, torch.where(live[:, None], w, 0))
            assert torch.equal(graphed.y[layer], exact), f"{where} layer {layer}: differs from all-resident"
            full = resident.forward(layer, x, graphed.ids[layer], w)
            assert_close(graphed.y[layer][live], full[live], f"{where} layer {layer}: live lanes")
            assert not graphed.y[layer][~live].any(), f"{where} layer {layer}: a dead lane computed"
        assert alive.tolist() == expect, where
        per_request = alive.view(bs, lanes)
        assert per_request[:, 0].all()
        assert torch.equal(per_request, per_request.int().cummin(1).values.bool())
        assert after["misses"] - before["misses"] == lane0_misses, f"{where}: a draft lane missed"
        moved = sum(after[k] - before[k] for k in ("admissions", "host_reads"))
        assert moved == lane0_misses, f"{where}: {moved} rows moved for {lane0_misses} lane-0 misses"
        live_drafts += int(per_request[:, 1:].sum())
        dead_drafts += int((~per_request[:, 1:]).sum())
    assert live_drafts and dead_drafts, f"never both kept and pruned a draft: {live_drafts}, {dead_drafts}"
    assert graphed.moe.telemetry is not None
    snap = graphed.moe.telemetry.snapshot()
    assert snap.valid, "pruned lanes set the telemetry poison bit"
    stats = graphed.moe.stats()
    assert stats.misses > 0 and stats.admissions > 0, stats
