"""The embedded default model: deterministic, loadable by transformers, a real tokenizer with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from pooled_runner.sglang import embedded


def test_generation_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    embedded.write_checkpoint(a)
    embedded.write_checkpoint(b)
    assert embedded.digest(a) == embedded.digest(b)


def test_checkpoint_layout_has_per_expert_names(tmp_path: Path) -> None:
    from safetensors import safe_open

    embedded.write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_experts"] == embedded.NUM_EXPERTS >= 16
    assert embedded.DEFAULT_POOL_ROWS < embedded.NUM_LAYERS * embedded.NUM_EXPERTS
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        vocab = f.get_tensor("model.embed_tokens.weight").shape[0]
    last = embedded.NUM_EXPERTS - 1
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.{embedded.NUM_LAYERS - 1}.mlp.experts.{last}.{proj}.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    assert vocab == config["vocab_size"]


def test_tokenizer_round_trips_and_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    embedded.write_checkpoint(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, how are you today? The capital of France is Paris. 3.14 != 2.718"
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text) // 2  # merges were learnt: not one token per byte
    assert tok.decode(ids) == text
    assert (
        tok.decode(tok("naïve café ☕")["input_ids"]) == "naïve café ☕"
    )  # byte-level: any text round-trips
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert max(tok.get_vocab().values()) < json.loads((tmp_path / "config.json").read_text())["vocab_size"]


def test_ensure_uses_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLED_RUNNER_CACHE_DIR", str(tmp_path))
    path = embedded.ensure_embedded_model()
    assert path.parent == tmp_path and (path / "model.safetensors").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert embedded.ensure_embedded_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
