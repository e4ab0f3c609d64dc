"""transformers adapter on a CUDA GPU: greedy tokens with the pool equal the unpooled model's."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from pooled_runner import PoolConfig
from pooled_runner.hf import find_experts_modules, pool_experts
from tests.hf_models import ARCHS, num_routed_experts, tiny_config

pytestmark = pytest.mark.gpu
logging.getLogger("transformers").setLevel(logging.ERROR)


def _generate(model, prompt, n=16):
    mask = torch.ones_like(prompt)
    return model.generate(prompt, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


def _pooled(arch: str, dtype: torch.dtype, frac: float | None, staging: bool):
    torch.manual_seed(3)
    cfg = tiny_config(arch, hidden=256, layers=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()  # built on the CPU
    moe = None
    if frac is not None:
        num_layers = len(find_experts_modules(model))
        rows = max(cfg.num_experts_per_tok, int(frac * num_layers * num_routed_experts(cfg)))
        moe = pool_experts(
            model, PoolConfig(pool_rows=rows, device="cuda", prefill_staging=staging, staging_min_tokens=32)
        )
    return model.cuda(), moe


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("frac", "staging"), [(0.25, True), (0.25, False), (0.5, True)])
def test_fp32_greedy_equals_unpooled(arch, frac, staging):
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4)).cuda()
    ref_model, _ = _pooled(arch, torch.float32, None, False)
    ref = _generate(ref_model, prompt)
    del ref_model
    model, moe = _pooled(arch, torch.float32, frac, staging)
    out = _generate(model, prompt)
    assert torch.equal(out, ref), f"{arch}: pooled {out.tolist()} != unpooled {ref.tolist()}"
    s = moe.stats()
    assert s.misses > 0 and s.admissions > 0
    if staging:
        assert moe.stager.stats.steps_staged >= 1 and moe.stager.stats.rows_staged > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_pool_sizes_agree_bitwise(arch):
    prompt = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(5)).cuda()
    tight, moe = _pooled(arch, torch.bfloat16, 0.25, True)
    full, _ = _pooled(arch, torch.bfloat16, 1.0, False)
    assert torch.equal(_generate(tight, prompt), _generate(full, prompt))
    assert moe.stats().misses > 0
