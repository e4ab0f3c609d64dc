"""The trace recorded from a transformers generate run (bench/hf_trace.py), on the CPU at a tiny shape: shape and
range, equal to what the adapter's pooled experts route and to the routers' own top-k."""

from __future__ import annotations

import pytest
import torch

from bench.hf_trace import BatchedExperts, RecordedModel, build_model, record_trace, trace_stats
from pooled_runner.hf import find_experts_modules

MODEL = RecordedModel(layers=3, experts=13, top_k=3, hidden=32, moe_intermediate=8, vocab=97)


@pytest.fixture(scope="module")
def recorded():
    return record_trace(MODEL, steps=6, lanes=4, seed=3)


def test_recorded_trace_has_the_bench_shape(recorded):
    ids = recorded.ids
    assert ids.shape == (6, MODEL.layers, 4, MODEL.top_k) and ids.dtype == torch.int32
    assert recorded.num_experts_per_layer == [MODEL.experts] * MODEL.layers
    assert int(ids.min()) >= 0 and int(ids.max()) < MODEL.experts
    assert all(len(set(k)) == MODEL.top_k for k in ids.reshape(-1, MODEL.top_k).tolist()), "repeated expert"
    assert len(torch.unique(ids)) > MODEL.top_k, "routing never changes: sampling did not happen"


def test_recording_equals_the_adapters_routing(recorded):
    """The batched stand-in computes what the adapter's pooled experts compute: the same sampled tokens, so the
    same routing, step for step (both are the torch path's arithmetic)."""
    through_adapter = record_trace(MODEL, steps=6, lanes=4, seed=3, pooled=True)
    assert torch.equal(through_adapter.ids, recorded.ids)


def test_recording_is_the_routers_top_k(recorded):
    """Independently of the experts module: the routers' own top-k (hooked on transformers' router modules)."""
    model = build_model(MODEL, steps=6, seed=3)
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    if len(routers) != MODEL.layers:
        pytest.skip("this transformers version names its routers differently")
    seen: list[torch.Tensor] = []

    def hook(_m, _args, out):  # Qwen3MoeTopKRouter -> (logits, scores, indices)
        if isinstance(out, tuple) and out[-1].shape[0] == 4:
            seen.append(out[-1].clone())

    for r in routers:
        r.register_forward_hook(hook)
    for layer, (name, module) in enumerate(find_experts_modules(model)):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, BatchedExperts(module, layer, None, 4))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, MODEL.vocab, (4, 4), generator=g)
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, min_new_tokens=7,
                           do_sample=True, pad_token_id=0)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    if not seen:
        pytest.skip("this transformers version's router returns no indices")
    routed = torch.stack(seen).reshape(6, MODEL.layers, 4, MODEL.top_k)
    assert torch.equal(routed.to(torch.int32), recorded.ids)


def test_recording_restores_the_thread_count():
    before = torch.get_num_threads()
    record_trace(RecordedModel(layers=2, experts=8, top_k=2, hidden=32, vocab=64), steps=2, lanes=2)
    assert torch.get_num_threads() == before


def test_trace_stats_on_a_known_trace():
    ids = torch.tensor([[[[0, 1], [2, 3]]], [[[1, 4], [5, 6]]]])  # [S=2, L=1, T=2, K=2]
    distinct, overlap = trace_stats(ids)
    assert distinct == 4.0  # {0,1,2,3} and {1,4,5,6}
    assert overlap == 0.25  # lane 0 keeps expert 1 (1 of 2), lane 1 keeps none
