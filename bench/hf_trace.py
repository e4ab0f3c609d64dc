"""A routing trace recorded from a real transformers `generate` run (random-init Qwen3-MoE, CPU).

The model has the decode bench's MoE shape where routing is concerned (E experts, top-k, as many MoE layers as
the bench, so recorded layer l is bench layer l) and a small hidden size (only routing is kept). Its prompts
are random tokens; `generate` samples (a random model decoding greedily falls into a loop of one token, whose
routing would repeat exactly). Every step of one generate run with `lanes` sequences is recorded after the
prefill; a caller wanting fewer lanes takes the first ones (sequences of one batch do not interact).

Random-init routers (weights N(0, 0.02)) route near-uniformly over the experts: no hot experts, so the trace
stresses a pool more than a trained model's would; what it keeps from a real model is how routing follows the
residual stream from token to token (the adjacent-token overlap, `trace_stats`).

Two ways to compute the experts while recording:
  pooled=True   the transformers adapter itself (`pooled_runner.hf.pool_experts`, every expert resident, the
                torch path), ids recorded at `PooledExperts` with `TraceRecorder`; a loop over experts, slow
                at E=128 (~8 ms per layer step on a CPU core).
  pooled=False  (default) `BatchedExperts`, standing in for each experts module the adapter finds
                (`find_experts_modules`): the same contract and the same arithmetic as the torch path (fp32
                products summed over H, combine in k order), batched over (token, k); tests check that both
                record the same trace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from bench.traces import Trace, TraceRecorder
from pooled_runner import PoolConfig
from pooled_runner.hf import PooledExperts, find_experts_modules, pool_experts

logger = logging.getLogger("pooled_runner")

PROMPT_TOKENS = 4  # > 1, so the prefill step (lanes x PROMPT_TOKENS tokens) is told apart from decode steps


@dataclass(frozen=True)
class RecordedModel:
    """The recorded model's shape: MoE layers, experts per layer, top-k, and the small dense dims."""

    layers: int
    experts: int
    top_k: int
    hidden: int = 64
    moe_intermediate: int = 16
    vocab: int = 4096


def qwen3_moe_config(m: RecordedModel, max_positions: int) -> transformers.PretrainedConfig:
    """A Qwen3-MoE config: every layer MoE, normalized top-k weights (as Qwen3-30B-A3B)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=m.vocab,
        hidden_size=m.hidden,
        num_hidden_layers=m.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * m.hidden,
        moe_intermediate_size=m.moe_intermediate,
        num_experts=m.experts,
        num_experts_per_tok=m.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max_positions,
    )


class BatchedExperts(nn.Module):
    """Stands in for one `<Arch>Experts` module (`forward(hidden [T, H], top_k_index [T, K], top_k_weights
    [T, K]) -> [T, H]`): the torch path's arithmetic (fp32 elementwise products summed over the last dim, combine
    in k order, id E or -1 adds nothing), batched over (token, k). Records decode-width steps."""

    def __init__(self, module: nn.Module, layer: int, recorder: TraceRecorder | None, lanes: int):
        super().__init__()
        gate_up, down = getattr(module, "gate_up_proj"), getattr(module, "down_proj")  # noqa: B009
        self.w13: torch.Tensor = gate_up.detach().float().clone()  # [E, 2I, H]; CPU only, not a buffer
        self.w2: torch.Tensor = down.detach().float().clone()  # [E, H, I]
        self.layer, self.recorder, self.lanes = layer, recorder, lanes
        self.num_experts = int(gate_up.shape[0])

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        E = self.num_experts
        ids = torch.where(top_k_index == E, -1, top_k_index)  # [T, K]; transformers pads with E
        if self.recorder is not None and ids.shape[0] == self.lanes:
            self.recorder.record(self.layer, ids)
        T, K = ids.shape
        if T == 0:
            return torch.zeros_like(hidden_states)
        routed = ids >= 0
        safe = ids.clamp(min=0)
        x = hidden_states.float()  # [T, H]
        inter = self.w2.shape[2]
        gate_up = (x[:, None, None, :] * self.w13[safe]).sum(-1).to(hidden_states.dtype)  # [T, K, 2I]
        gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
        act = (nn.functional.silu(gate) * up).to(hidden_states.dtype)  # [T, K, I]
        out = (act.float()[:, :, None, :] * self.w2[safe]).sum(-1).to(hidden_states.dtype)  # [T, K, H]
        acc = torch.zeros((T, hidden_states.shape[1]), dtype=torch.float32)
        for k in range(K):
            term = top_k_weights[:, k, None].float() * out[:, k].float()
            acc += torch.where(routed[:, k, None], term, torch.zeros_like(term))
        return acc.to(hidden_states.dtype)


def _swap_experts(model: nn.Module, recorder: TraceRecorder, lanes: int) -> int:
    found = find_experts_modules(model)
    for layer, (name, module) in enumerate(found):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BatchedExperts(module, layer, recorder, lanes))
    return len(found)


def _hook_pooled(model: nn.Module, recorder: TraceRecorder, lanes: int) -> int:
    modules = [m for m in model.modules() if isinstance(m, PooledExperts)]

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(module, PooledExperts)
        ids = args[1]
        if ids.shape[0] == lanes:
            recorder.record(module.layer, torch.where(ids == module.num_experts, -1, ids))

    for m in modules:
        m.register_forward_pre_hook(hook)
    return len(modules)


def build_model(m: RecordedModel, steps: int, seed: int) -> transformers.PreTrainedModel:
    """The random-init model (float32, CPU, eval), seeded."""
    torch.manual_seed(seed)
    cfg = qwen3_moe_config(m, max_positions=PROMPT_TOKENS + steps + 8)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def record_trace(m: RecordedModel, steps: int, lanes: int, seed: int = 0, pooled: bool = False) -> Trace:
    """`steps` decode steps of `lanes` sampled sequences: ids `[steps, layers, lanes, top_k]` int32.

    The prompts and the sampling are seeded; the prefill step is not recorded. Raises RuntimeError when the run
    recorded fewer steps than asked (it never should: every sequence generates exactly `steps + 1` tokens).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and immune to a busy machine
    try:
        return _record(m, steps, lanes, seed, pooled)
    finally:
        torch.set_num_threads(threads)


def _record(m: RecordedModel, steps: int, lanes: int, seed: int, pooled: bool) -> Trace:
    model = build_model(m, steps, seed)
    recorder = TraceRecorder([m.experts] * m.layers)
    if pooled:
        pool_experts(model, PoolConfig(pool_rows=m.layers * m.experts, device="cpu", prefill_staging=False))
        found = _hook_pooled(model, recorder, lanes)
    else:
        found = _swap_experts(model, recorder, lanes)
    if found != m.layers:
        raise RuntimeError(f"{found} experts modules in a {m.layers}-layer model: every layer must be MoE")
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, m.vocab, (lanes, PROMPT_TOKENS), generator=g)
    torch.manual_seed(seed + 2)  # generate samples from the global generator
    with torch.no_grad():
        model.generate(  # type: ignore[operator]
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps + 1,  # the first new token comes from the prefill step
            min_new_tokens=steps + 1,
            do_sample=True,
            pad_token_id=0,
        )
    trace = recorder.trace()
    if trace.num_steps < steps:
        raise RuntimeError(f"recorded {trace.num_steps} decode steps, asked for {steps}")
    return Trace(trace.ids[:steps].contiguous(), trace.num_experts_per_layer)


def trace_stats(ids: torch.Tensor) -> tuple[float, float]:
    """Of a trace `ids [S, L, T, K]`: mean distinct experts per (step, layer), and the adjacent-token overlap
    (the share of a token's routed experts that the same lane's previous token at that layer also routed to)."""
    S, L = ids.shape[:2]
    distinct = sum(len(torch.unique(ids[s, layer])) for s in range(S) for layer in range(L)) / (S * L)
    if S < 2:
        return distinct, float("nan")
    same = ids[1:, ..., :, None] == ids[:-1, ..., None, :]  # [S-1, L, T, K, K]
    return distinct, float(same.any(-1).float().mean())
