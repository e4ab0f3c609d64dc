"""transformers adapter on the CPU: greedy generate with the pool equals the unpooled model (float32)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from torch import nn

from pooled_runner import PoolConfig
from pooled_runner.formats import make_format
from pooled_runner.hf import PooledExperts, find_experts_modules, pool_experts
from tests.hf_models import ARCHS, num_routed_experts, tiny_config

logging.getLogger("transformers").setLevel(logging.ERROR)


def _model(arch: str, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("frac", "staging"), [(0.25, False), (0.5, False), (0.25, True)])
def test_greedy_tokens_equal_unpooled(arch, frac, staging):
    model = _model(arch, seed=7)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 256, (2, 11), generator=g)
    mask = torch.ones_like(prompt)
    ref = model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)

    num_layers = len(find_experts_modules(model))
    cfg = model.config
    rows = max(cfg.num_experts_per_tok, int(frac * num_layers * num_routed_experts(cfg)))
    pool_cfg = PoolConfig(pool_rows=rows, device="cpu", prefill_staging=staging, staging_min_tokens=16)
    moe = pool_experts(model, pool_cfg)
    assert not find_experts_modules(model), "an experts module was left in place"
    assert sum(isinstance(m, PooledExperts) for m in model.modules()) == num_layers
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref), f"pooled tokens {out.tolist()} != unpooled {ref.tolist()}"

    stats = moe.stats()
    assert stats.misses > 0 and stats.admissions > 0 and stats.evictions > 0
    if staging:  # the 22-token prefill is staged, decode steps are not
        assert moe.stager is not None and moe.stager.stats.steps_staged == 1
        assert moe.stager.stats.layers_staged == num_layers


@pytest.mark.parametrize(("arch", "fmt"), [("qwen3_moe", "int4-g32"), ("deepseek_v3", "nvfp4")])
def test_quantized_pool_equals_the_model_on_dequantized_experts(arch: str, fmt: str) -> None:
    """A quantized pool format quantizes each expert while pooling: each pooled layer equals the model's
    experts module holding the dequantized weights (and is farther from the unquantized one than that), and
    greedy generation gives the tokens of the model on dequantized experts (bf16)."""
    torch.manual_seed(21)
    cfg = tiny_config(arch, moe_intermediate=64)  # int4's group of 32 and NVFP4's 16 divide H and I
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    original, reference = copy.deepcopy(model), copy.deepcopy(model)
    converter = make_format(fmt, torch.bfloat16)
    with torch.no_grad():
        for _, experts in find_experts_modules(reference):
            gate_up, down = experts.gate_up_proj, experts.down_proj
            for e in range(gate_up.shape[0]):
                gate_up[e], down[e] = converter.expert_weights(converter.quantize(gate_up[e], down[e]))
    num_layers = len(find_experts_modules(model))
    rows = max(cfg.num_experts_per_tok, num_layers * num_routed_experts(cfg) // 3)
    moe = pool_experts(model, PoolConfig(pool_rows=rows, device="cpu", weight_format=fmt))
    assert moe.format.name == fmt and moe.bank is not None

    g = torch.Generator().manual_seed(22)
    E, K, H = num_routed_experts(cfg), cfg.num_experts_per_tok, cfg.hidden_size
    pooled = [m for m in model.modules() if isinstance(m, PooledExperts)]
    pairs = zip(pooled, find_experts_modules(reference), find_experts_modules(original), strict=True)
    with torch.no_grad():
        for layer, (mine, (_, dequantized), (_, unquantized)) in enumerate(pairs):
            x = torch.randn(9, H, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(9)])  # [T, K]
            weights = torch.rand(9, K, generator=g).to(torch.bfloat16)  # [T, K]
            got = mine(x, ids, weights).float()
            near = (got - dequantized(x, ids, weights).float()).abs().max()
            far = (got - unquantized(x, ids, weights).float()).abs().max()
            assert near <= 0.02 * got.abs().max(), f"layer {layer}: {near:.3g} from the dequantized experts"
            assert far > 4 * near, (
                f"layer {layer}: {far:.3g} from unquantized experts, {near:.3g} from dequantized"
            )
    prompt = torch.randint(0, 256, (2, 13), generator=g)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
    out, ref = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
    assert torch.equal(out, ref), f"pooled tokens {out.tolist()} != reference {ref.tolist()}"
    assert moe.stats().misses > 0


def test_model_without_experts_is_refused():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no routed-experts module"):
        pool_experts(model, PoolConfig(pool_rows=4, device="cpu"))


def test_pooled_module_holds_no_parameters():
    model = _model("qwen3_moe", seed=1)
    before = sum(p.numel() for p in model.parameters())
    moe = pool_experts(model, PoolConfig(pool_rows=5, device="cpu"))
    after = sum(p.numel() for p in model.parameters())
    E, H, inter = 13, 64, 40
    assert before - after == 3 * E * 3 * H * inter  # every expert left the model's parameters
    assert moe.bank is not None and moe.bank.num_total_experts == 3 * E


class _Holder(nn.Module):
    """A model-shaped wrapper of one experts module (config for the top-k)."""

    def __init__(self, config: object, experts: nn.Module):
        super().__init__()
        self.config = config
        self.experts = experts


def test_experts_that_gate_their_own_way_are_refused():
    """DeepSeek-V4's experts clamp gate and up (swiglu_limit) in `_apply_gate`; the pool does not: refused
    rather than silently wrong."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    DeepseekV4Experts = modeling.DeepseekV4Experts
    cfg = transformers.DeepseekV4Config(
        hidden_size=16,
        moe_intermediate_size=8,
        n_routed_experts=5,
        num_experts_per_tok=2,
        num_hidden_layers=1,
    )
    model = _Holder(cfg, DeepseekV4Experts(cfg))
    with pytest.raises(ValueError, match=r"experts: DeepseekV4Experts gates its experts its own way"):
        pool_experts(model, PoolConfig(pool_rows=4, device="cpu"))


def test_experts_with_biases_are_refused():
    model = _model("qwen3_moe", seed=2)
    name, experts = find_experts_modules(model)[1]
    E = experts.gate_up_proj.shape[0]
    experts.register_parameter("down_proj_bias", nn.Parameter(torch.randn(E, experts.down_proj.shape[1])))
    with pytest.raises(ValueError, match=rf"{name}: parameters \['down_proj_bias'\] besides gate_up_proj"):
        pool_experts(model, PoolConfig(pool_rows=5, device="cpu"))
