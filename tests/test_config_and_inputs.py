"""PoolConfig resolution and validation, the bank's layout, and bad input at every public boundary."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from pooled_runner import ExpertBank, PoolConfig, PooledMoE
from pooled_runner.config import add_cli_arguments, config_from_cli
from pooled_runner.formats import Bf16Format


def test_resolve_without_cuda_picks_cpu_and_turns_staging_off(caplog):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU resolution")
    with caplog.at_level(logging.INFO, logger="pooled_runner"):
        cfg = PoolConfig.resolve(pool_rows=8)
    assert cfg.device == "cpu" and cfg.prefill_staging is False
    assert "prefill staging disabled" in caplog.text


def test_config_is_frozen_and_refuses_auto():
    cfg = PoolConfig.resolve(pool_rows=3, device="cpu")
    with pytest.raises(AttributeError):
        cfg.pool_rows = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="call PoolConfig.resolve"):
        PoolConfig(pool_rows=3)


def test_config_lists_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        PoolConfig.resolve(pool_rows=0, weight_format="int3", staging_min_tokens=0, device="cpu")
    msg = str(err.value)
    assert "pool_rows=0" in msg and "--moe-expert-pool-rows" in msg
    assert "weight_format='int3'" in msg and "staging_min_tokens=0" in msg


def test_cli_flags_derive_from_the_dataclass():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--moe-expert-pool-rows", "12", "--no-moe-expert-pool-prefill-staging"])
    cfg = config_from_cli(args)
    assert cfg.pool_rows == 12 and cfg.prefill_staging is False
    assert cfg.staging_min_tokens == PoolConfig.__dataclass_fields__["staging_min_tokens"].default
    with pytest.raises(ValueError, match="--moe-expert-pool-rows N is required"):
        config_from_cli(parser.parse_args([]))


def test_bank_layout_and_size():
    ops = Bf16Format(torch.bfloat16).operands(8, 3)
    bank = ExpertBank(ops, [2, 5], pin=False)
    assert bank.layer(1)["w13"].shape == (5, 6, 8) and bank.layer(0)["w2"].shape == (2, 8, 3)
    assert bank.nbytes == 7 * (6 * 8 + 8 * 3) * 2
    assert not bank.pinned and not bank.tensors_host["w13"].is_pinned()
    w = {"w13": torch.randn(6, 8).bfloat16(), "w2": torch.randn(8, 3).bfloat16()}
    bank.write_expert(1, 4, w)
    assert torch.equal(bank.layer(1)["w13"][4], w["w13"]) and torch.equal(bank.row(1, 4)["w2"], w["w2"])
    with pytest.raises(ValueError, match=r"expert 5 out of range \[0, 5\) for layer 1"):
        bank.write_expert(1, 5, w)
    with pytest.raises(ValueError, match="layer 0 has num_experts=0"):
        ExpertBank(ops, [0], pin=False)


def _moe(rows: int, top_k: int = 2, layers: int = 1, E: int = 4) -> PooledMoE:
    moe = PooledMoE(PoolConfig.resolve(pool_rows=rows, device="cpu"), 8, 4, top_k=top_k, dtype=torch.float32)
    for _ in range(layers):
        moe.register_layer(E)
    return moe


def _loader(layer: int, expert: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer * 100 + expert)
    return {"w13": torch.randn(8, 8, generator=g), "w2": torch.randn(8, 4, generator=g)}


def test_rows_below_top_k_refused_with_the_fix():
    moe = _moe(rows=1, top_k=2)
    with pytest.raises(ValueError, match="use --moe-expert-pool-rows >= 2"):
        moe.install(_loader)


def test_rows_covering_every_expert_keep_everything_resident(caplog):
    moe = _moe(rows=100, layers=2)
    with caplog.at_level(logging.INFO, logger="pooled_runner"):
        moe.install(_loader)
    assert moe.bank is None and moe.pool.num_rows == 8
    assert "every expert resident, no host bank" in caplog.text


def test_loader_output_checked():
    moe = _moe(rows=2)
    with pytest.raises(ValueError, match=r"loader\(layer=0, expert=0\): w2 has shape \(4, 8\)"):
        moe.install(lambda layer, e: {"w13": torch.randn(8, 8), "w2": torch.randn(4, 8)})


@pytest.mark.parametrize(
    ("hidden", "ids", "weights", "match"),
    [
        (
            torch.randn(3, 7),
            torch.zeros(3, 2, dtype=torch.long),
            torch.rand(3, 2),
            r"hidden has shape \(3, 7\), expected \[T, 8\]",
        ),
        (
            torch.randn(3, 8).double(),
            torch.zeros(3, 2, dtype=torch.long),
            torch.rand(3, 2),
            "hidden has dtype torch.float64",
        ),
        (
            torch.randn(3, 8),
            torch.zeros(2, 2, dtype=torch.long),
            torch.rand(2, 2),
            r"topk_ids has shape \(2, 2\), expected \[3, K\]",
        ),
        (torch.randn(3, 8), torch.zeros(3, 2), torch.rand(3, 2), "topk_ids has dtype torch.float32"),
        (
            torch.randn(3, 8),
            torch.zeros(3, 2, dtype=torch.long),
            torch.rand(3, 3),
            r"topk_weights has shape \(3, 3\)",
        ),
        (
            torch.randn(3, 8),
            torch.tensor([[0, 4], [1, 2], [0, 1]]),
            torch.rand(3, 2),
            r"topk_ids values in \[0, 4\], expected -1 \(padding\) or \[0, 4\)",
        ),
        (
            torch.randn(3, 8),
            torch.tensor([[0, -2], [1, 2], [0, 1]]),
            torch.rand(3, 2),
            r"values in \[-2, 2\]",
        ),
    ],
)
def test_forward_rejects_bad_routing(hidden, ids, weights, match):
    moe = _moe(rows=2)
    moe.install(_loader)
    before = moe.pool.l2p_host.clone()
    with pytest.raises(ValueError, match=match):
        moe.forward(0, hidden, ids, weights)
    assert torch.equal(moe.pool.l2p_host, before)


@pytest.mark.gpu
def test_forward_rejects_routing_on_another_device():
    moe = _moe(rows=2)
    moe.install(_loader)
    with pytest.raises(ValueError, match="topk_ids is on cuda"):
        moe.forward(0, torch.randn(1, 8), torch.zeros(1, 2, dtype=torch.long).cuda(), torch.rand(1, 2))


def test_forward_before_install_and_bad_layer():
    moe = _moe(rows=2)
    with pytest.raises(RuntimeError, match="before install"):
        moe.forward(0, torch.randn(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 2))
    moe.install(_loader)
    with pytest.raises(ValueError, match=r"layer 3 out of range \[0, 1\)"):
        moe.forward(3, torch.randn(1, 8), torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 2))
    with pytest.raises(RuntimeError, match=r"register_layer\(\) after allocate\(\)/install\(\)"):
        moe.register_layer(4)


def test_misspelt_environment_knob_is_refused_with_the_closest_name(monkeypatch):
    """A POOLED_RUNNER_ variable no knob reads (say the PLAN_ of POOLED_RUNNER_PLAN_PDL left out) is refused at
    the first knob read, naming the knob it resembles; known names pass, and every reader's name is known."""
    import re
    from pathlib import Path

    from pooled_runner import envs

    envs.check_names({"POOLED_RUNNER_PLAN_PDL": "0", "POOLED_RUNNER_TEST_WORKERS": "2", "OTHER": "x"})
    with pytest.raises(
        ValueError, match=r"POOLED_RUNNER_COOPERATIVE \(did you mean POOLED_RUNNER_PLAN_COOPERATIVE\?\)"
    ):
        envs.check_names({"POOLED_RUNNER_COOPERATIVE": "1"})
    monkeypatch.setattr(envs, "_checked", False)
    monkeypatch.setenv("POOLED_RUNNER_PLAN_OVERLAPP", "0")
    with pytest.raises(ValueError, match="POOLED_RUNNER_PLAN_OVERLAPP"):
        envs.plan_overlap()
    monkeypatch.delenv("POOLED_RUNNER_PLAN_OVERLAPP")
    monkeypatch.setenv("POOLED_RUNNER_PLAN_OVERLAP", "0")
    assert envs.plan_overlap() is False
    source = Path(envs.__file__).read_text()
    read = set(re.findall(r'_get_(?:bool|str)\("([A-Z_0-9]+)"', source))
    assert read and read <= envs.KNOWN, sorted(read - envs.KNOWN)
