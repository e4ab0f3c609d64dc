"""The launcher's checks of its command line, before SGLang is imported: SGLang flags read from argv, every
problem with our flags and SGLang's against this machine and the model's config.json (each with its fix), and
the model's facts from a local folder or the local Hugging Face cache. `launch.py` gathers them and refuses a
launch with all of them at once."""

from __future__ import annotations

import argparse
import difflib
import logging
from pathlib import Path

import torch

from pooled_runner.config import flag_name
from pooled_runner.formats import FORMATS, make_format
from pooled_runner.sglang.model_facts import ModelFacts, read_model_facts
from pooled_runner.tp import rank_intermediate, tp_problems

logger = logging.getLogger("pooled_runner")

PROG = "python -m pooled_runner.launch"
MODEL_FLAGS = ("--model-path", "--model")
TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}
DTYPES |= {"float16": torch.float16, "half": torch.float16}
# SGLang 0.5.23's CUDA-graph switches (sglang/srt/arg_groups/cuda_graph_hook.py `parse_cuda_graph_config`):
# --cuda-graph-config (JSON) wins over --cuda-graph-backend-<phase>, which wins over --disable-<phase>-cuda-graph
# and the deprecated --disable-cuda-graph
GRAPH_FLAGS = (
    "--cuda-graph-config",
    "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill",
    "--disable-cuda-graph",
    "--disable-decode-cuda-graph",
    "--disable-prefill-cuda-graph",
)
GRAPHS_OFF = ("--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled")
GRAPH_PHASES = ("decode", "prefill")
# SGLang 0.5.23 settings the pooled layers need on CUDA, added unless the user sets them: DeepSeek-V3/R1 fuse
# their shared expert into the routed experts by default on capability >= 8.0 (`deepseek_v2.py`
# `_shared_experts_fusion_disabled_reason`), which would keep every expert on the device; Blackwell picks the
# flashinfer_trtllm runner for DeepSeek fp8 when the backend is auto (`arg_groups/overrides.py`), whose layout
# the pool does not read
POOL_MOE_FLAGS = (("--disable-shared-experts-fusion",), ("--moe-runner-backend", "triton"))
# SGLang flags the launcher reads from argv itself (so an abbreviation of one, which SGLang would take, is refused)
READ_FLAGS = frozenset(
    {*MODEL_FLAGS, *TP_FLAGS, "--device", "--dtype", "--enable-metrics", "--speculative-algorithm"}
    | {"--speculative-adaptive", "--disable-cuda-graph", "--max-total-tokens", "--quantization", "--config"}
    | {"--enable-paged-experts", "--revision", "--download-dir", *GRAPH_FLAGS}
    | {flags[0] for flags in POOL_MOE_FLAGS}
)


def has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` in argv (SGLang's argparse keeps the last one too); None if absent."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


def graph_phases_maybe_on(argv: list[str]) -> list[str]:
    """The phases ("decode", "prefill") whose CUDA graphs SGLang's flags in argv do not turn off, by SGLang's
    precedence (see GRAPH_FLAGS). With --cuda-graph-config both: its JSON is not read here."""
    if has_flag(argv, "--cuda-graph-config"):
        return list(GRAPH_PHASES)
    out = []
    for phase in GRAPH_PHASES:
        backend = flag_value(argv, f"--cuda-graph-backend-{phase}")
        if backend is not None:
            off = backend == "disabled"
        else:
            off = has_flag(argv, "--disable-cuda-graph", f"--disable-{phase}-cuda-graph")
        if not off:
            out.append(phase)
    return out


def tp_size_of(argv: list[str]) -> int:
    """SGLang's `--tp-size` (or its aliases) from argv; 1 when absent. ValueError when not a positive integer
    (checked here, not only against the model: its config.json may not be on this machine)."""
    raw = flag_value(argv, *TP_FLAGS)
    if raw is None:
        return 1
    try:
        size = int(raw)
    except ValueError:
        raise ValueError(f"--tp-size {raw!r} is not an integer") from None
    if size < 1:
        raise ValueError(f"--tp-size {size}: must be a positive number of ranks")
    return size


def weight_dtype(argv: list[str], facts: ModelFacts) -> torch.dtype:
    """The dtype SGLang will build the model in: `--dtype`, else (auto) config.json's, except that SGLang 0.5.23
    serves a float32 checkpoint, or one whose config says no dtype, in float16 (bfloat16 for Gemma:
    `model_config._get_and_verify_dtype`; the same bytes and the same formats fit, so not told apart here)."""
    requested = flag_value(argv, "--dtype")
    if requested is not None and requested.lower() in DTYPES:
        return DTYPES[requested.lower()]
    config_dtype = DTYPES.get(facts.dtype, torch.float32)
    return torch.float16 if config_dtype == torch.float32 else config_dtype


def pool_problems(
    rows: int | None,
    facts: ModelFacts | None,
    tp_size: int = 1,
    cpu: bool = False,
    weight_format: str = "bf16",
) -> list[str]:
    """Every problem with `--moe-expert-pool-rows` (per rank), `--tp-size` and a quantized checkpoint against
    the model and the pool's `weight_format`, with fixes."""
    flag = flag_name("pool_rows")
    out: list[str] = []
    if rows is None:
        out.append(f"{flag} N is required (N = device rows of the expert pool, shared by all MoE layers)")
    elif rows <= 0:
        out.append(f"{flag} {rows}: must be a positive number of rows")
    if facts is None:
        return out
    if facts.num_moe_layers == 0:
        out.append(
            "the model has no MoE layer (no routed experts in config.json): serve it with SGLang directly"
        )
        return out
    # where config.json does not settle the experts' format, each MoE layer decides (the startup log names the
    # layers kept on the device, and why)
    decided = not facts.native_format_per_layer
    if decided and facts.quantization is not None and not facts.native_format:
        out.append(
            f"quantization {facts.quantization!r}: the pool takes unquantized (bf16/fp16/fp32) experts, and fp8 "
            "e4m3 ones in square blocks of 16, 32, 64 or 128 (DeepSeek-style weight_block_size) or with one "
            "scale per tensor (quant_method fp8 without weight_block_size), and llm-compressor's fp8 "
            "(compressed-tensors: fp8 weights and activations, per tensor, channel or square block) and NVFP4 "
            f"(nvfp4-pack-quantized, with {flag_name('weight_format')} nvfp4), NVIDIA ModelOpt FP8 (quant_algo "
            f"FP8) with {flag_name('weight_format')} fp8, and ModelOpt NVFP4 (quant_algo NVFP4 or W4A16_NVFP4, "
            f"group 16) with {flag_name('weight_format')} nvfp4; "
            "use such a checkpoint or pass --no-moe-expert-pool"
        )
    elif decided and facts.native_format and weight_format != facts.native_format:
        out.append(
            f"{flag_name('weight_format')} {weight_format}: the checkpoint's experts are {facts.native_format} "
            f"already (quantization {facts.quantization!r}); the pool serves them as they are with "
            f"{flag_name('weight_format')} {facts.native_format}"
        )
    if tp_size != 1:
        out += tp_problems(rows or 0, facts.top_k, facts.moe_intermediate_size, tp_size, cpu)
    if rows is not None and rows > 0:
        if facts.top_k and rows < facts.top_k and tp_size == 1:
            out.append(
                f"{flag} {rows} is below top-k {facts.top_k}: one token's experts must fit; use >= {facts.top_k}"
            )
        if rows > facts.num_total_experts:
            out.append(
                f"{flag} {rows} is above the {facts.num_total_experts} routed experts of the model "
                f"({facts.num_moe_layers} MoE layers x {facts.num_experts}); use <= {facts.num_total_experts}"
            )
    return out


def format_problems(
    weight_format: str, dtype: torch.dtype, facts: ModelFacts, tp_size: int = 1, cpu: bool = False
) -> list[str]:
    """Whether the model's experts (each rank's shard) fit `--moe-expert-pool-weight-format`: a quantized
    format needs a bf16/fp16 model and K dimensions its groups divide; the refusal lists the formats that fit."""
    if facts.hidden_size <= 0 or facts.moe_intermediate_size <= 0 or weight_format not in FORMATS:
        return []  # unknown sizes: the layers check when they register; an unknown format: PoolConfig says so
    try:
        per_rank = rank_intermediate(facts.moe_intermediate_size, tp_size, cpu)
    except ValueError:
        return []  # reported by tp_problems

    def why_not(name: str, served: torch.dtype) -> str | None:
        try:
            make_format(name, served).operands(facts.hidden_size, per_rank)
        except ValueError as exc:
            return str(exc)
        return None

    why = why_not(weight_format, dtype)
    if why is None and weight_format == facts.native_format and weight_format.startswith("fp8-b"):
        block = int(weight_format.removeprefix("fp8-b"))
        if per_rank % block:  # the checkpoint's blocks must not straddle gate and up, nor two ranks
            why = f"the checkpoint's {block}x{block} blocks do not divide the expert intermediate size"
    if why is None:
        return []
    half = dtype in (torch.bfloat16, torch.float16)
    where = (
        f"{flag_name('weight_format')} {weight_format}: {why} (hidden {facts.hidden_size}, expert intermediate "
        f"{per_rank} per rank, {str(dtype).removeprefix('torch.')})"
    )
    if weight_format == facts.native_format:  # the checkpoint's own format: the fix is elsewhere
        units = "groups of 16" if weight_format == "nvfp4" else "blocks"  # nvfp4's scale groups along K
        fix = (
            "serve in bf16 (--dtype bfloat16)"
            if not half
            else f"use a --tp-size whose shard of it is whole {units}"
        )
        return [f"{where}; {fix}"]
    # a float32 model fits bf16 rows only: list what would fit it served in bf16
    fitting = [name for name in FORMATS if why_not(name, dtype if half else torch.bfloat16) is None]
    fit = "formats that fit this model" + ("" if half else " served in bf16 (--dtype bfloat16)")
    return [f"{where}; {fit}: {', '.join(fitting)}"]


def spec_governor_problems(governor: str, argv: list[str], tp_size: int = 1) -> list[str]:
    """`--moe-expert-pool-spec-governor cost` decides SGLang's adaptive speculation: it needs it on, and one
    scheduler (each TP rank times its own steps: ranks could choose different depths and stall the collectives)."""
    if governor != "cost":
        return []
    flag = flag_name("spec_governor")
    if not has_flag(argv, "--speculative-algorithm"):
        return [f"{flag} cost chooses the speculative depth: add --speculative-algorithm (EAGLE or NEXTN)"]
    if not has_flag(argv, "--speculative-adaptive"):
        return [f"{flag} cost decides SGLang's adaptive speculation: add --speculative-adaptive"]
    if tp_size > 1:
        return [
            f"{flag} cost times each rank's steps on its own clock, so tensor-parallel ranks could choose "
            f"different depths: it runs with --tp-size 1 only (got {tp_size}); use {flag} off with TP"
        ]
    return []


def argv_problems(argv: list[str], pooled: bool, our_flags: list[str]) -> list[str]:
    """Problems with SGLang's argv that the launcher cannot serve or cannot see through, each with the fix.
    `our_flags`: the launcher's own long flags (a misspelt one is told the closest)."""
    out: list[str] = []
    if has_flag(argv, "--config"):
        # SGLang merges the file under the command line; the launcher reads the command line only, so it would
        # check (and prepend the embedded model for) a command line that is not the one SGLang serves
        out.append(
            "--config FILE is not read by this launcher (its model, --tp-size and speculative settings would "
            "escape the pool's checks): pass those options on the command line instead"
        )
    for arg in argv:
        name = arg.split("=", 1)[0]
        # our flags never reach argv: one that looks like ours is misspelt (or a --no- form no flag has)
        if name.startswith(("--moe-expert-pool", "--no-moe-expert-pool")):
            close = difflib.get_close_matches(name, our_flags, n=1, cutoff=0.6)
            out.append(
                f"unknown flag {name}" + (f": did you mean {close[0]}?" if close else f" (see {PROG} --help)")
            )
        # SGLang's parser takes abbreviations; the launcher's scan of argv would miss this one
        full = sorted(f for f in READ_FLAGS if f.startswith(name) and f != name)
        if len(name) > 2 and name.startswith("--") and full and name not in READ_FLAGS:
            out.append(
                f"{name} abbreviates {' or '.join(full)}: write it in full (the launcher reads it too)"
            )
    if pooled and flag_value(argv, "--quantization") not in (None, "unquant"):
        out.append(
            "--quantization: the pool quantizes experts itself (--moe-expert-pool-weight-format) and reads a "
            "checkpoint's own fp8 (blocks, per tensor or per channel) or ModelOpt FP8/NVFP4 from its config.json (or "
            "hf_quant_config.json); drop --quantization or pass --no-moe-expert-pool"
        )
    return out


def device_problems(
    argv: list[str], ours: argparse.Namespace, cuda_available: bool, tp_size: int
) -> list[str]:
    """SGLang's `--device` against this machine and the pool's device."""
    out: list[str] = []
    sglang_device = flag_value(argv, "--device")
    if sglang_device is not None and sglang_device != "cpu" and not sglang_device.startswith("cuda"):
        out.append(
            f"--device {sglang_device}: the pooled server runs on CUDA or the CPU (--device cuda or cpu)"
        )
    elif sglang_device is not None and sglang_device.startswith("cuda") and not cuda_available:
        out.append(f"--device {sglang_device} but CUDA is not available on this machine: use --device cpu")
    elif sglang_device == "cpu" and cuda_available:
        # SGLang 0.5.23 picks its ops' code by platform, not by --device, and the CPU patches refuse a CUDA
        # machine: hiding the GPUs is what makes it a CPU machine for both
        out.append(
            "--device cpu on a machine with CUDA: to serve on the CPU, hide the GPUs (CUDA_VISIBLE_DEVICES= "
            "python -m pooled_runner.launch ...); to serve on the GPU, drop --device cpu"
        )
    pool_device = str(getattr(ours, "device", "auto"))  # (a CUDA pool without CUDA: PoolConfig says it)
    if pool_device == "cpu" and cuda_available and sglang_device != "cpu":
        out.append(
            f"{flag_name('device')} cpu while the model runs on CUDA: the pool must be where the model runs; "
            f"drop {flag_name('device')} (auto follows the machine)"
        )
    if tp_size > 1 and pool_device.startswith("cuda:"):
        out.append(
            f"{flag_name('device')} {pool_device} with --tp-size {tp_size}: each rank's pool belongs on that "
            f"rank's GPU; use {flag_name('device')} cuda (or auto)"
        )
    return out


def find_model_facts(
    model_path: str, revision: str | None = None, cache_dir: str | None = None
) -> ModelFacts | None:
    """`read_model_facts` of a local folder, or of a hub id's config.json at SGLang's `--revision` when it is
    already in the local Hugging Face cache (SGLang's `--download-dir`, else the default; no download here);
    None, with a warning, when neither is there."""
    facts = read_model_facts(model_path)
    if facts is not None or Path(model_path).expanduser().exists():
        return facts
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # not a hub id, or no huggingface_hub: nothing to read
        cached = None
    if isinstance(cached, str):
        return read_model_facts(str(Path(cached).parent))
    logger.warning(
        "pooled_runner: no config.json of %s on this machine (not a local folder, not in the Hugging Face cache): "
        "the checks of %s, quantization and --tp-size against the model are skipped. Download it first "
        "(huggingface-cli download %s) or pass a local path to have them",
        model_path,
        flag_name("pool_rows"),
        model_path,
    )
    return None
