"""PooledMoE on CUDA: decode steps captured in a CUDA graph (device planner + kernels) replay with new routing
and equal the all-resident pool bit for bit; prefill steps in between hand the tables over and back."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.formats import make_format
from tests.reference import random_expert_weights

pytestmark = pytest.mark.gpu

H, I, E, K, L = 512, 256, 24, 4, 3


def _build(rows: int, staging: bool, weight_format: str = "bf16") -> PooledMoE:
    weights = random_expert_weights(L, E, H, I, torch.bfloat16, seed=41)
    cfg = PoolConfig(
        pool_rows=rows,
        device="cuda",
        prefill_staging=staging,
        staging_min_tokens=256,
        weight_format=weight_format,
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    fmt = make_format(weight_format, torch.bfloat16)  # quantized the same way for every build
    moe.install(
        lambda layer, e: fmt.quantize(weights[(layer, e)]["w13"].float(), weights[(layer, e)]["w2"].float())
    )
    return moe


def _route(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(L, T, E, generator=g, device="cuda")
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)  # [L, T, K]
    return ids, w


# With overlap (POOLED_RUNNER_PLAN_OVERLAP=1) the plan + copy runs beside the first GEMM: bf16 at M=1 takes the
# one-launch split path there (kernels/splitk.py), int4 / NVFP4 at M = 1 and 4 the GEMV, fp8 at M = 1 and 2
# (4 and 8 pairs) the inline path's gemm1 (all three OVERLAP); wider steps the align path. variant: the decode
# kernels forced (POOLED_RUNNER_MOE_DECODE): the GEMV at 20 tokens (80 pairs, its 128-wide schedule, OVERLAP),
# which this model's 24 experts would leave to the align path (heavy expert reuse).
@pytest.mark.parametrize(
    ("M", "weight_format", "overlap", "variant"),
    [(1, "bf16", False, None), (4, "bf16", False, None), (12, "bf16", False, None)]
    + [(1, "bf16", True, None), (12, "bf16", True, None)]
    + [(M, f, True, None) for f in ("int4-g128", "nvfp4") for M in (1, 4)]
    + [(M, "fp8", True, None) for M in (1, 2)]
    + [(20, "int4-g128", True, "gemv")],
)
def test_captured_decode_equals_resident_and_replays_with_new_routing(
    M, weight_format, overlap, variant, monkeypatch
):
    from pooled_runner.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "DECODE_VARIANT", variant)
    monkeypatch.setenv("POOLED_RUNNER_PLAN_OVERLAP", "1" if overlap else "0")
    pooled = _build(rows=L * E // 4, staging=True, weight_format=weight_format)
    resident = _build(rows=L * E, staging=False, weight_format=weight_format)
    planner = pooled._gpu().planner
    assert planner is not None and planner.overlap == overlap, "POOLED_RUNNER_PLAN_OVERLAP not followed"
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(L, M, H, generator=g, device="cuda").bfloat16()
    ids, w = _route(M, g)

    def step(moe: PooledMoE) -> torch.Tensor:
        return torch.stack([moe.forward(layer, x[layer], ids[layer], w[layer]) for layer in range(L)])

    step(pooled)  # eager first: compiles, and hands the tables to the device planner
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = step(pooled)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(6):
        new_ids, new_w = _route(M, g)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(L, M, H, generator=g, device="cuda").bfloat16())
        graph.replay()
        assert torch.equal(out, step(resident)), "replayed pooled step differs from the all-resident pool"
    # A prefill-sized step (host plan + staging) in between, then the graph again.
    xp = torch.randn(300, H, generator=g, device="cuda").bfloat16()
    pid, pw = _route(300, g)
    for layer in range(L):
        assert torch.equal(
            pooled.forward(layer, xp, pid[layer], pw[layer]),
            resident.forward(layer, xp, pid[layer], pw[layer]),
        )
    assert pooled.stager.stats.steps_staged == 1
    graph.replay()
    assert torch.equal(out, step(resident))
    stats = pooled.stats()
    assert stats.misses > 0 and stats.admissions > 0
    pooled.pool.check_invariants()


def test_captured_split_path_with_the_tail_in_blocks(monkeypatch):
    """The bf16 M=1 OVERLAP case on the split path (named, as the default takes it only where the sums fit one
    tail block) with its last program rounding the 512 sums in 4 blocks of 128."""
    from pooled_runner.kernels import fused_moe, splitk

    monkeypatch.setattr(splitk, "SPLITK_TAIL_MAX", 128)
    calls: list[int] = []
    split_moe = fused_moe.splitk_moe

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return split_moe(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "splitk_moe", counted)
    test_captured_decode_equals_resident_and_replays_with_new_routing(1, "bf16", True, "splitk", monkeypatch)
    assert calls and set(calls) <= {1, 300}, calls  # the decode steps took the split path


def test_wide_step_under_capture_is_refused():
    pooled = _build(rows=L * E // 2, staging=False)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(100, H, generator=g, device="cuda").bfloat16()
    ids, w = _route(100, g)
    pooled.forward(0, x[:2], ids[0, :2], w[0, :2])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured"), torch.cuda.graph(graph):
        pooled.forward(0, x, ids[0], w[0])
