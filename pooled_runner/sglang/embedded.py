"""The embedded default model: a tiny Qwen3-MoE checkpoint with a real tokenizer, generated offline.

`python -m pooled_runner.launch` with no `--model` serves this model, so the main job works on a fresh
machine with no network access to a model hub. Everything is deterministic (fixed seeds, a fixed training
text for the tokenizer), written once into a cache directory (`POOLED_RUNNER_CACHE_DIR`, default
`~/.cache/pooled_runner`) and reused. The weights are random: the generated text is noise; the model is for
checking that serving, pooling and the endpoints work.

Expert weights are written under per-expert names (`mlp.experts.N.gate_proj.weight` ...), the layout SGLang
and transformers both load (transformers 5's own `state_dict()` has fused names SGLang cannot load).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pooled_runner import envs

logger = logging.getLogger("pooled_runner")

# Bump when anything below changes what is written: the cache directory name carries it.
EMBEDDED_VERSION = 1
NAME = "qwen3-moe-tiny"

NUM_LAYERS = 4
NUM_EXPERTS = 16
TOP_K = 4
HIDDEN = 64
MOE_INTERMEDIATE = 32
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
# Largest tokenizer vocabulary; the model's vocab_size is the trained size, so every id decodes.
MAX_VOCAB = 1024
# Default pool rows for the embedded model: fewer than its NUM_LAYERS * NUM_EXPERTS = 64 experts, so the
# pool really misses and evicts.
DEFAULT_POOL_ROWS = 24

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Training text of the tokenizer: fixed, so the vocabulary is the same on every machine.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
Experts that do not fit in GPU memory live in host memory; a pool of rows on the GPU keeps the hot ones.
What is the capital of France? Paris is the capital of France. How are you today? I am fine, thank you.
Hello world! Hello, how can I help you? Please write a short poem about the sea and the sky.
Once upon a time there was a small model with random weights. It answered every question with noise.
The server speaks the OpenAI protocol: chat completions, completions, models, and a native generate call.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 2.718 -1 +1 = < > ( ) [ ] { } , . ; : ! ? ' "
def main():\n    print("hello")\n    return 0\n
import torch\nx = torch.randn(4, 8)\ny = x @ x.T\n
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July
user assistant system tool function message content role name answer question request response token
"""


def cache_root() -> Path:
    """Where generated checkpoints live (`POOLED_RUNNER_CACHE_DIR` or `~/.cache/pooled_runner`)."""
    return Path(envs.cache_dir()).expanduser()


def model_dir() -> Path:
    return cache_root() / f"{NAME}-v{EMBEDDED_VERSION}"


def ensure_embedded_model() -> Path:
    """Path of the embedded checkpoint, generating it on first use (atomic: a partial write is never seen)."""
    target = model_dir()
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        write_checkpoint(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("embedded model written to %s (random weights: its text is noise)", target)
    return target


def write_checkpoint(out: Path) -> None:
    """Write config, tokenizer files and weights of the embedded model into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    special_ids, vocab_size = write_tokenizer(out)
    config = model_config(special_ids, vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    from safetensors.torch import save_file

    save_file(make_state_dict(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})


def model_config(special_ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "torch_dtype": "bfloat16",
    }


def _randn(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    # One generator per tensor, seeded from its name: a tensor does not change when another is added.
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).contiguous()


def make_state_dict(vocab_size: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under Qwen3-MoE checkpoint names, per-expert expert weights."""
    sd: dict[str, torch.Tensor] = {}

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        sd[name] = _randn(name, (out_f, in_f), gain / math.sqrt(in_f))

    def norm(name: str, size: int) -> None:
        sd[name] = 1.0 + _randn(name, (size,), 0.1)

    sd["model.embed_tokens.weight"] = _randn("model.embed_tokens.weight", (vocab_size, HIDDEN), 1.0)
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", HIDDEN)
        norm(f"{p}.post_attention_layernorm.weight", HIDDEN)
        linear(f"{p}.self_attn.q_proj.weight", NUM_HEADS * HEAD_DIM, HIDDEN)
        linear(f"{p}.self_attn.k_proj.weight", NUM_KV_HEADS * HEAD_DIM, HIDDEN)
        linear(f"{p}.self_attn.v_proj.weight", NUM_KV_HEADS * HEAD_DIM, HIDDEN)
        linear(f"{p}.self_attn.o_proj.weight", HIDDEN, NUM_HEADS * HEAD_DIM)
        norm(f"{p}.self_attn.q_norm.weight", HEAD_DIM)
        norm(f"{p}.self_attn.k_norm.weight", HEAD_DIM)
        # A stronger router spreads the routing probabilities, so top-k choices are not near-ties.
        linear(f"{p}.mlp.gate.weight", NUM_EXPERTS, HIDDEN, gain=4.0)
        for e in range(NUM_EXPERTS):
            q = f"{p}.mlp.experts.{e}"
            linear(f"{q}.gate_proj.weight", MOE_INTERMEDIATE, HIDDEN)
            linear(f"{q}.up_proj.weight", MOE_INTERMEDIATE, HIDDEN)
            linear(f"{q}.down_proj.weight", HIDDEN, MOE_INTERMEDIATE)
    norm("model.norm.weight", HIDDEN)
    linear("lm_head.weight", vocab_size, HIDDEN, gain=4.0)
    return sd


def write_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """Train a byte-level BPE on the fixed corpus; write tokenizer.json and tokenizer_config.json.

    Returns the ids of the special tokens and the vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)

    tok.save(str(out / "tokenizer.json"))
    special_ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"embedded tokenizer lost special token {t!r}")
        special_ids[t] = token_id
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t, i in special_ids.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n"
    )
    return special_ids, tok.get_vocab_size()


def digest(path: Path) -> str:
    """sha256 over the files of a checkpoint directory (tests use it to check determinism)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()
