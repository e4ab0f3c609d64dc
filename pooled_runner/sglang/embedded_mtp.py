"""The embedded model with an MTP head: the tiny Qwen3-MoE of `embedded.py` plus one MTP layer, generated offline.

SGLang serves it with `--speculative-algorithm NEXTN` (no draft model path): for a draft model it rewrites the
architecture `Qwen3MoeForCausalLM` to `Qwen3MoeForCausalLMMTP`, which reads the `mtp.*` tensors of the same
checkpoint (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`) and
shares the target's embedding and lm_head. The MTP layer is a full Qwen3-MoE decoder layer: its MoE layer is
built in SGLang's draft scope (`is_draft`) and must stay off the pool.

Two modes, both deterministic:
  - "random": the target is exactly the embedded model; the MTP head is random, so SGLang rejects (almost)
    every draft (accept length ~1).
  - "agree": a head that predicts what the target will say, so drafts get accepted. The target is built so its
    greedy next token is a fixed permutation of the current token, `sigma(x)`: the lm_head rows are the
    embeddings permuted (`lm_head[sigma(x)] = embed[x]`), and every layer adds a small residual (attention and
    expert output projections scaled by `AGREE_RESIDUAL_GAIN`), so the argmax margin of the embedding survives
    the layers while every layer, experts included, still changes the hidden state and the logits. The head's
    `fc` passes the normed embedding of its input token through (plus a small share of the target's hidden),
    so it predicts `sigma(token)` too.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from pooled_runner.sglang import embedded

logger = logging.getLogger("pooled_runner")

MTP_VERSION = 1
MODES = ("random", "agree")
# Scale of every layer's residual contribution (attention o_proj, expert down_proj) in "agree" mode.
AGREE_RESIDUAL_GAIN = 0.15
# Scale of the target-hidden half of the head's fc in "agree" mode (0 would ignore the target's hidden).
AGREE_HIDDEN_SHARE = 0.05
_PERMUTATION_SEED = 7


def mtp_model_dir(mode: str) -> Path:
    return embedded.cache_root() / f"{embedded.NAME}-mtp-{mode}-v{embedded.EMBEDDED_VERSION}.{MTP_VERSION}"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"MTP mode {mode!r} is not one of {MODES}")


def ensure_embedded_mtp_model(mode: str = "agree") -> Path:
    """Path of the embedded MTP checkpoint in `mode`, generating it on first use (atomic rename)."""
    _check_mode(mode)
    target = mtp_model_dir(mode)
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_mtp_checkpoint(tmp, mode)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("embedded MTP model (%s head) written to %s", mode, target)
    return target


def permutation(vocab_size: int) -> torch.Tensor:
    """`sigma`: the "agree" target's greedy next token of token x is `sigma[x]`."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(_PERMUTATION_SEED))


def write_mtp_checkpoint(out: Path, mode: str) -> None:
    """Config, tokenizer and weights (target + `mtp.*`) of the embedded MTP model in `mode`."""
    _check_mode(mode)
    out.mkdir(parents=True, exist_ok=True)
    special_ids, vocab_size = embedded.write_tokenizer(out)
    config = embedded.model_config(special_ids, vocab_size)
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    from safetensors.torch import save_file

    save_file(
        make_mtp_state_dict(vocab_size, mode), str(out / "model.safetensors"), metadata={"format": "pt"}
    )


def _mtp_layer(vocab_size: int) -> dict[str, torch.Tensor]:
    """One random decoder layer under `mtp.layers.0.*`, drawn like the target's (its own seeds)."""
    layer = embedded.make_state_dict(vocab_size)
    out: dict[str, torch.Tensor] = {}
    for name in layer:
        if name.startswith("model.layers.0."):
            mtp_name = "mtp." + name[len("model.") :]
            out[mtp_name] = embedded._randn(mtp_name, tuple(layer[name].shape), float(layer[name].std()))
            if name.endswith("norm.weight"):
                out[mtp_name] = 1.0 + embedded._randn(mtp_name, tuple(layer[name].shape), 0.1)
    return out


def _is_residual_output(name: str) -> bool:
    return name.endswith("self_attn.o_proj.weight") or name.endswith("down_proj.weight")


def make_mtp_state_dict(vocab_size: int, mode: str) -> dict[str, torch.Tensor]:
    """float32 weights: the target (see module docstring for "agree") plus the `mtp.*` head."""
    _check_mode(mode)
    sd = embedded.make_state_dict(vocab_size)
    H = embedded.HIDDEN
    sd.update(_mtp_layer(vocab_size))
    if mode == "random":
        sd["mtp.fc.weight"] = embedded._randn("mtp.fc.weight", (H, 2 * H), (2 * H) ** -0.5)
        sd["mtp.pre_fc_norm_embedding.weight"] = 1.0 + embedded._randn("mtp.pre_fc_norm_embedding", (H,), 0.1)
        sd["mtp.pre_fc_norm_hidden.weight"] = 1.0 + embedded._randn("mtp.pre_fc_norm_hidden", (H,), 0.1)
        sd["mtp.norm.weight"] = 1.0 + embedded._randn("mtp.norm.weight", (H,), 0.1)
        return sd
    for name in list(sd):
        if _is_residual_output(name):
            sd[name] = sd[name] * AGREE_RESIDUAL_GAIN
    embed = sd["model.embed_tokens.weight"]  # [V, H]
    sigma = permutation(vocab_size)
    lm_head = torch.empty_like(embed)
    lm_head[sigma] = embed  # row sigma[x] is embed[x]: logits peak at sigma[x] for a hidden near embed[x]
    sd["lm_head.weight"] = lm_head.contiguous()
    sd["model.norm.weight"] = torch.ones(H)
    fc = torch.zeros(H, 2 * H)
    fc[:, :H] = torch.eye(H)
    fc[:, H:] = embedded._randn("mtp.fc.hidden", (H, H), AGREE_HIDDEN_SHARE / H**0.5)
    sd["mtp.fc.weight"] = fc
    sd["mtp.pre_fc_norm_embedding.weight"] = torch.ones(H)
    sd["mtp.pre_fc_norm_hidden.weight"] = torch.ones(H)
    sd["mtp.norm.weight"] = torch.ones(H)
    return sd
