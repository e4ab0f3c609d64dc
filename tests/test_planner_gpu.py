"""GPU tests of the device planner under CUDA graphs (run by scripts/gpu_check.sh; skipped without CUDA).

A small model-shaped stack (4 pooled layers of 16/12/16/10 experts, top-4, bf16, 24 rows for 54 experts):
each layer routes (router matmul + bias + top-k), records telemetry, plans on the device, and runs the pooled
kernel path (`KernelPath.forward`, which reads `l2p_gpu` on the device). One decode step through all layers is
captured and replayed with new hidden states and router biases. Checked against: the same step run eagerly on
an identical second stack (exact), an all-resident pool's kernel path and a dense fp32 reference per layer
(tolerance), and the plain-Python host twin fed the routed ids (tables exact).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.planner import DevicePlanner
from pooled_runner.planner_twin import HostTwin
from pooled_runner.policies import AgingFreqPolicy, FreqDecayPolicy, LRUPolicy
from pooled_runner.policy_adaptive import AdaptivePolicy
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy
from pooled_runner.telemetry import RouteTelemetry

pytestmark = pytest.mark.gpu

H, I, K = 256, 128, 4
LAYERS = [16, 12, 16, 10]
EM = max(LAYERS)
ROWS = 24
DTYPE = torch.bfloat16
MAX_TOKENS = 12

# M = 1, 2, 4, 8 plain decode; MTP verify widths bs x (1 + num_spec) for num_spec in {1, 3}.
WIDTHS = {"M1": 1, "M2": 2, "M4": 4, "M8": 8, "mtp_bs1_ns1": 2, "mtp_bs2_ns1": 4, "mtp_bs1_ns3": 4}
WIDTHS["mtp_bs3_ns3"] = 12


def make_policy(name: str):
    if name == "aging":
        return AgingFreqPolicy(decay_steps=3)
    if name in ("adaptive", "adaptive-ops"):
        # no floor: both modes within the few captured steps (the floor itself is tested on the CPU)
        return AdaptivePolicy(ROWS, decay_shift=2, duel_shift=1, margin_shift=1, floor_misses=0)
    if name.startswith("adaptive-router-duel"):  # two router memories dueled (the chosen order on the device)
        kw = dict(decay_shift=2, duel_shift=1, margin_shift=1, floor_misses=0)
        return MemoryDuelPolicy(ROWS, slow=6, fast=2, order_floor=0, **kw)
    if name.startswith("adaptive-router"):  # the same, each layer ordered by the router's logits (fed to it)
        return RouterAdaptivePolicy(ROWS, decay_shift=2, duel_shift=1, margin_shift=1, floor_misses=0)
    return (
        LRUPolicy() if name in ("lru", "lru-ops") else FreqDecayPolicy(decay_steps=4, recent_bonus=2, cap=6)
    )


# Every width with LRU; the other policies (their state updates under capture) at a few widths.
CASES = [(w, "lru") for w in WIDTHS] + [
    ("M1", "lru-ops"),  # the torch-ops planner and telemetry (the fused kernels are the CUDA default)
    ("mtp_bs3_ns3", "lru-ops"),
    ("M1", "freq"),
    ("mtp_bs3_ns3", "freq"),
    ("M2", "aging"),
    ("mtp_bs2_ns1", "aging"),
    (
        "M1",
        "adaptive",
    ),  # the adaptive policies: the fused one launch (kernels/plan_adaptive_copy.py), overlapped
    ("M8", "adaptive"),  # 32 pairs: past the inline default, inline beside the long plan (`long_plan`)
    ("mtp_bs3_ns3", "adaptive"),
    ("M4", "adaptive-ops"),  # and their torch-ops form
    ("M1", "adaptive-router"),
    ("mtp_bs3_ns3", "adaptive-router"),
    ("M2", "adaptive-router-bf16"),  # bf16 logits, as SGLang's bf16 gate hands them over
    ("M4", "adaptive-router-duel"),  # fused: both orders in the plan kernel
    ("M2", "adaptive-router-duel-ops"),  # and its torch-ops form
]


def expert_weights(seed: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        (layer, e): {
            "w13": (torch.randn(2 * I, H, generator=g) / H**0.5).to(DTYPE),
            "w2": (torch.randn(H, I, generator=g) / I**0.5).to(DTYPE),
        }
        for layer, n in enumerate(LAYERS)
        for e in range(n)
    }


def build_moe(weights, rows: int) -> PooledMoE:
    config = PoolConfig.resolve(pool_rows=rows, device="cuda", prefill_staging=False)
    moe = PooledMoE(config, H, I, top_k=K, dtype=DTYPE)
    for n in LAYERS:
        moe.register_layer(n)
    moe.install(lambda layer, expert: weights[(layer, expert)])
    return moe


class Stack:
    """Pooled stack + planner + telemetry + static buffers for width M; `step()` is what gets captured."""

    def __init__(
        self, weights, M: int, policy: str, max_routed: int = MAX_TOKENS * K, overlap: bool | None = None
    ):
        from pooled_runner.kernel_path import KernelPath

        self.M = M
        self.moe = build_moe(weights, ROWS)
        pool = self.moe.pool
        self.twin = HostTwin(pool, make_policy(policy))
        fused = False if policy.endswith("-ops") else None
        self.planner = DevicePlanner(
            pool,
            make_policy(policy),
            max_routed=max_routed,
            debug_checks=False,
            fused=fused,
            overlap=overlap,
        )
        self.tel = RouteTelemetry(LAYERS, pool.device, fused=fused)
        self.kpath = KernelPath(self.moe.format, pool, self.moe.bank, H, I)
        g = torch.Generator(device="cuda").manual_seed(1234)
        self.router = torch.randn(len(LAYERS), H, EM, generator=g, device="cuda") / H**0.5
        mask = torch.zeros(len(LAYERS), 1, EM, device="cuda")
        for layer, n in enumerate(LAYERS):
            mask[layer, :, n:] = float("-inf")
        self.mask = mask
        self.hidden = torch.zeros(M, H, dtype=DTYPE, device="cuda")
        self.bias = torch.zeros(len(LAYERS), M, EM, device="cuda")
        self.ids = torch.zeros(len(LAYERS), M, K, dtype=torch.int64, device="cuda")
        self.w = torch.zeros(len(LAYERS), M, K, dtype=torch.float32, device="cuda")
        self.h_in = torch.zeros(len(LAYERS), M, H, dtype=DTYPE, device="cuda")
        self.y = torch.zeros(len(LAYERS), M, H, dtype=DTYPE, device="cuda")
        self.out = torch.zeros(M, H, dtype=DTYPE, device="cuda")
        # router logits, for a policy reading them (fp32, or bf16 for the -bf16 case)
        score_dtype = torch.bfloat16 if policy.endswith("-bf16") else torch.float32
        self.scores = torch.zeros(len(LAYERS), M, EM, dtype=score_dtype, device="cuda")
        self.with_scores = policy.startswith("adaptive-router")
        self.routed_history: list[torch.Tensor] = []

    def step(self) -> None:
        h = self.hidden
        for layer in range(len(LAYERS)):
            self.h_in[layer].copy_(h)
            # elementwise product + sum, not a GEMM: the same bits in graph and eager whatever the stream
            logits = (h.float()[:, :, None] * self.router[layer][None]).sum(1)  # [M, EM]
            logits = logits + self.bias[layer] + self.mask[layer]
            vals, ids = torch.topk(logits, K, dim=-1)  # [M, K]
            w = torch.softmax(vals, dim=-1)
            self.ids[layer].copy_(ids)
            self.w[layer].copy_(w)
            self.tel.record(layer, ids)
            w_dtype = w.to(DTYPE)  # before the plan: with overlap nothing may launch between it and the MoE
            scores = None
            if self.with_scores:
                self.scores[layer].copy_(logits)
                scores = self.scores[layer]
            # as KernelPath.planned_forward, with the plan's answer checked
            aligned = self.kpath.align_before_plan(
                layer, h, ids, self.planner.overlap, self.planner.long_plan
            )
            after_plan = self.planner.plan(layer, ids, router_scores=scores)
            assert after_plan == self.planner.overlap, "the plan read a temporary copy of the ids"
            y = self.kpath.forward(
                layer,
                h,
                ids,
                w_dtype,
                after_plan=after_plan,
                long_plan=self.planner.long_plan,
                aligned=aligned,
            )
            self.y[layer].copy_(y)
            h = h + y
        self.out.copy_(h)

    def set_inputs(self, g: torch.Generator) -> None:
        self.hidden.copy_(torch.randn(self.M, H, generator=g, device="cuda").to(DTYPE))
        self.bias.copy_(3.0 * torch.randn(len(LAYERS), self.M, EM, generator=g, device="cuda"))

    def follow_twin(self) -> None:
        """Feed the host twin this step's routed ids (host sync; outside capture)."""
        ids, scores = self.ids.cpu(), self.scores.cpu()
        self.routed_history.append(ids)
        for layer in range(len(LAYERS)):
            self.twin.plan(layer, ids[layer], scores[layer] if self.with_scores else None)

    def assert_tables_equal_twin(self, where: str) -> None:
        a, b = self.planner.state(), self.twin.state()
        for key in a:
            diff = (a[key] != b[key]).nonzero()
            assert diff.numel() == 0, f"{where}: {key} differs from the host twin at {diff[:5].tolist()}"
        pool = self.moe.pool
        for row, flat in enumerate(self.planner.row_owner[:ROWS].tolist()):
            if flat >= 0:
                for name, t in pool.rows_gpu.items():
                    ref = pool.bank.row(flat // EM, flat % EM)[name]
                    assert torch.equal(t[row].cpu(), ref), (
                        f"{where}: row {row} lost expert {divmod(flat, EM)}"
                    )


def dense_reference(x, ids, w, weights, layer):
    """`sum_k w * mlp_e(x)` with fp32 matmuls per logical expert; gate/up and activation rounded to bf16."""
    M = x.shape[0]
    out = torch.zeros(M, H, dtype=torch.float32)
    xc, idc, wc = x.cpu().float(), ids.cpu(), w.cpu().to(DTYPE).float()
    for t in range(M):
        for k in range(K):
            e = int(idc[t, k])
            w13, w2 = weights[(layer, e)]["w13"].float(), weights[(layer, e)]["w2"].float()
            gu = (w13 @ xc[t]).to(DTYPE).float()
            act = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(DTYPE).float()
            out[t] += wc[t, k] * (w2 @ act).to(DTYPE).float()
    return out.to(DTYPE)


def assert_close(out, ref, what, rel=2e-2):
    o, r = out.float().cpu(), ref.float().cpu()
    scale = r.abs().max().item() if r.numel() else 0.0
    bad = ((o - r).abs() > rel * (r.abs() + scale)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} mismatches, first at {bad[:5].tolist()}"


def warm_up(stack: Stack, g: torch.Generator, steps: int = 2) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            stack.set_inputs(g)
            stack.step()
            side.synchronize()
            stack.follow_twin()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@contextlib.contextmanager
def sync_debug_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture(stack: Stack) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), stack.tel.graph_region(), sync_debug_error():
        stack.step()
    torch.cuda.synchronize()
    return graph


@pytest.fixture(scope="module")
def weights():
    return expert_weights(seed=7)


@pytest.fixture(scope="module")
def resident(weights):
    return build_moe(weights, sum(LAYERS))


@pytest.mark.parametrize(("width", "policy"), CASES)
def test_captured_decode_step_replays_with_new_routing(width, policy, weights, resident):
    M = WIDTHS[width]
    # the graphed stack's plan + copy overlaps the first GEMM (the fused one launch: LRU and the adaptive
    # policies; the other planners cannot), the eager one's does not: the same outputs bit for bit, the same tables
    fused = policy not in ("freq", "aging") and not policy.endswith("-ops")
    overlap = True if fused else None
    graphed, eager = Stack(weights, M, policy, overlap=overlap), Stack(weights, M, policy, overlap=False)
    assert graphed.planner.overlap == fused, "only the fused one-launch planner overlaps"
    assert graphed.planner.fused == fused, f"{policy}: fused {graphed.planner.fused}, expected {fused}"
    g_graph = torch.Generator(device="cuda").manual_seed(M)
    g_eager = torch.Generator(device="cuda").manual_seed(M)
    warm_up(graphed, g_graph)
    warm_up(eager, g_eager)
    state_ptrs = [
        t.data_ptr()
        for t in (
            graphed.planner.row_owner,
            graphed.planner.row_stamp,
            graphed.planner.clock,
            graphed.moe.pool.l2p_gpu,
        )
    ]
    graph = capture(graphed)
    graphed.assert_tables_equal_twin("after capture (capture must not run the planner)")
    for replay in range(12):
        graphed.set_inputs(g_graph)
        eager.set_inputs(g_eager)
        with graphed.tel.graph_region():
            graph.replay()
            if replay == 0:
                with pytest.raises(RuntimeError, match="refused"):
                    graphed.tel.reset()
        eager.step()
        torch.cuda.synchronize()
        assert torch.equal(graphed.out, eager.out), f"replay {replay}: graph output differs from eager"
        graphed.follow_twin()
        eager.follow_twin()
        graphed.assert_tables_equal_twin(f"replay {replay}")
        eager.assert_tables_equal_twin(f"eager {replay}")
        if replay % 4 == 0:
            for layer in range(len(LAYERS)):
                x, ids, w = graphed.h_in[layer], graphed.ids[layer], graphed.w[layer]
                unpooled = resident.forward(layer, x, ids, w.to(DTYPE))
                assert_close(graphed.y[layer], unpooled, f"replay {replay} layer {layer} vs all-resident")
                ref = dense_reference(x, ids, w, weights, layer)
                assert_close(graphed.y[layer], ref, f"replay {replay} layer {layer} vs dense reference")
    counters = graphed.planner.counter_values()
    assert counters["misses"] > 0 and counters["admissions"] > 0, f"the trace never missed: {counters}"
    if policy.startswith("adaptive-router-duel"):  # the orders that ran (the twin checked every replay)
        print(f"{policy}: fast order share {graphed.planner.policy.fast_share:.2f}")
    # telemetry: every routed id of warm-up and replays, nothing else
    snap = graphed.tel.snapshot()
    expect = torch.zeros(len(LAYERS), EM, dtype=torch.int64)
    for ids in graphed.routed_history:
        for layer in range(len(LAYERS)):
            expect[layer] += torch.bincount(ids[layer].reshape(-1), minlength=EM)[:EM]
    assert snap.valid and torch.equal(snap.counts, expect)
    # replays allocate nothing and the state stays where the graph reads it
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == (allocated, reserved)
    ptrs = [
        t.data_ptr()
        for t in (
            graphed.planner.row_owner,
            graphed.planner.row_stamp,
            graphed.planner.clock,
            graphed.moe.pool.l2p_gpu,
        )
    ]
    assert ptrs == state_ptrs


def test_consecutive_captures_eager_between_and_teardown(weights):
    stack = Stack(weights, 4, "freq")
    g = torch.Generator(device="cuda").manual_seed(3)
    warm_up(stack, g)
    for cycle in range(3):
        graph = capture(stack)
        for _ in range(3):
            stack.set_inputs(g)
            graph.replay()
            torch.cuda.synchronize()
            stack.follow_twin()
        stack.assert_tables_equal_twin(f"cycle {cycle} after replay")
        stack.set_inputs(g)
        stack.step()  # eager after replay
        torch.cuda.synchronize()
        stack.follow_twin()
        stack.assert_tables_equal_twin(f"cycle {cycle} eager")
        del graph
    torch.cuda.synchronize()
    stack.planner.store_to_pool()
    stack.moe.pool.check_invariants()
    x = torch.randn(64, 64, device="cuda")
    assert torch.allclose(x @ torch.eye(64, device="cuda"), x)  # runtime still usable


def test_step_beyond_workspace_fails_at_capture_and_changes_nothing(weights):
    stack = Stack(weights, 8, "lru", max_routed=4 * K)
    with pytest.raises(ValueError, match=r"routes 32 > max_routed=16"):
        capture(stack)
    torch.cuda.synchronize()
    stack.assert_tables_equal_twin("after the refused capture")
    stack.tel.reset()
    assert stack.tel.epoch == 1


def test_out_of_range_ids_in_a_graph_poison_telemetry_and_route_nothing(weights):
    stack = Stack(weights, 2, "lru")
    ids = torch.zeros(2, K, dtype=torch.int64, device="cuda")
    for layer in (0, 1):  # compile the row gather for these layers' bank offsets before capture
        stack.planner.plan(layer, ids)
        stack.twin.plan(layer, ids.cpu())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_debug_error():
        stack.tel.record(1, ids)
        stack.planner.plan(1, ids)
    bad = torch.tensor([[0, 12, 3, -5], [7, 1, -1, 40]], device="cuda")  # E of layer 1 is 12
    ids.copy_(bad)
    graph.replay()
    torch.cuda.synchronize()
    stack.twin.plan(1, bad.cpu())
    stack.assert_tables_equal_twin("poisoned step")
    snap = stack.tel.snapshot()
    assert snap.poisoned and not snap.valid
    assert snap.counts[1].tolist()[:12] == [1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
