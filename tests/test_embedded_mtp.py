"""The embedded MTP checkpoint: deterministic, `mtp.*` tensors SGLang's Qwen3MoeForCausalLMMTP loads, and an
"agree" target whose greedy next token is sigma(current token) (checked with transformers, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from pooled_runner.sglang import embedded, embedded_mtp

MTP_NAMES = (
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
)


@pytest.mark.parametrize("mode", embedded_mtp.MODES)
def test_mtp_checkpoint_is_deterministic_and_complete(tmp_path: Path, mode: str) -> None:
    from safetensors import safe_open

    a, b = tmp_path / "a", tmp_path / "b"
    embedded_mtp.write_mtp_checkpoint(a, mode)
    embedded_mtp.write_mtp_checkpoint(b, mode)
    assert embedded.digest(a) == embedded.digest(b)
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_nextn_predict_layers"] == 1
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert set(MTP_NAMES) <= names
    last = embedded.NUM_EXPERTS - 1
    for proj in ("gate_proj", "up_proj", "down_proj"):  # per-expert names, as SGLang loads them
        assert f"mtp.layers.0.mlp.experts.{last}.{proj}.weight" in names
    assert "mtp.layers.0.self_attn.q_proj.weight" in names and "mtp.layers.0.mlp.gate.weight" in names


def test_bad_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MTP mode 'nope' is not one of"):
        embedded_mtp.write_mtp_checkpoint(tmp_path, "nope")


def test_agree_target_follows_the_permutation(tmp_path: Path) -> None:
    """The target's greedy continuation is x, sigma(x), sigma(sigma(x)), ... (what the agreeing head predicts)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    embedded_mtp.write_mtp_checkpoint(tmp_path, "agree")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    sigma = embedded_mtp.permutation(model.config.vocab_size)
    seq = [329, 400, 303]
    with torch.no_grad():
        for _ in range(6):
            logits = model(torch.tensor([seq])).logits[0, -1]
            top = logits.topk(2).values
            assert top[0] - top[1] > 5.0, f"near tie after {seq}: margin {float(top[0] - top[1])}"
            seq.append(int(logits.argmax()))
    assert seq[3:] == [int(sigma[t]) for t in seq[2:-1]], seq
