"""What the launcher and `PoolConfig` refuse before anything starts, each with the fix: options the launcher
cannot see through (SGLang's --config), misspelt pool flags, configurations serving cannot load (quantized
checkpoints, pool formats the experts do not fit), devices that do not match the machine or SGLang's --device, bad knob values,
wrongly typed config values; and a hub model id read from the local Hugging Face cache."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest
import torch

from pooled_runner import envs
from pooled_runner.config import PoolConfig
from pooled_runner.launch import main
from tests.test_launch_plan import QWEN3_MOE, plan


def refusal(argv: list[str], cuda: bool = False) -> str:
    with pytest.raises(ValueError, match="cannot launch") as info:
        plan(argv, cuda)
    return str(info.value)


@pytest.fixture
def model(tmp_path: Path) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_MOE))
    return str(folder)


def test_sglang_config_file_is_refused(model: str) -> None:
    # SGLang would serve the file's model under the command line's checks (or the embedded model's)
    assert "--config FILE is not read by this launcher" in refusal(["--config", "serve.yaml"])
    assert "--config FILE" in refusal(
        ["--model", model, "--moe-expert-pool-rows", "8", "--config=serve.yaml"]
    )


def test_misspelt_pool_flag_names_the_right_one(model: str) -> None:
    message = refusal(["--model", model, "--moe-expert-pool-row", "8"])
    assert "unknown flag --moe-expert-pool-row: did you mean --moe-expert-pool-rows?" in message
    message = refusal(
        ["--model", model, "--moe-expert-pool-rows", "8", "--no-moe-expert-pool-prefil-staging"]
    )
    assert "did you mean --no-moe-expert-pool-prefill-staging?" in message
    message = refusal(
        ["--model", model, "--no-moe-expert-pool-rows"]
    )  # only the on/off flags have --no- forms
    assert "unknown flag --no-moe-expert-pool-rows" in message
    # SGLang's own --moe-* flags still pass (no abbreviation, no prefix of ours)
    assert (
        "--moe-runner-backend"
        in plan(
            ["--model", model, "--moe-expert-pool-rows", "8", "--moe-runner-backend", "triton"]
        ).sglang_argv
    )


def test_abbreviated_sglang_flags_the_launcher_reads_are_refused(model: str) -> None:
    # SGLang would take --model-p as --model-path while the launcher served (and checked) the embedded model
    assert "--model-p abbreviates --model-path: write it in full" in refusal(["--model-p", model])
    assert "--tensor-parallel abbreviates --tensor-parallel-size" in refusal(
        ["--model", model, "--moe-expert-pool-rows", "8", "--tensor-parallel=2"]
    )
    ok = plan(
        [
            "--model",
            model,
            "--moe-expert-pool-rows",
            "8",
            "--tp",
            "1",
            "--enable-metrics-for-all-schedulers",
            "--",
        ]
    )
    assert ok.tp_size == 1  # full names (and longer SGLang flags, and a bare --) pass


def test_quantized_checkpoints_are_refused_for_serving(model: str) -> None:
    message = refusal(["--model", model, "--moe-expert-pool-rows", "8", "--quantization", "fp8"])
    assert (
        "--quantization: the pool quantizes experts itself" in message and "--no-moe-expert-pool" in message
    )
    unpooled = plan(["--model", model, "--no-moe-expert-pool", "--quantization", "fp8"])
    assert unpooled.serve.pool is None
    # SGLang's "unquant" means no quantization: what the pool needs
    assert plan(["--model", model, "--moe-expert-pool-rows", "8", "--quantization", "unquant"]).serve.pool


def test_fp8_block_checkpoints_are_served_in_their_own_format(tmp_path: Path) -> None:
    """A DeepSeek-style fp8 checkpoint (e4m3, weight_block_size [128, 128]) is served as it is with
    --moe-expert-pool-weight-format fp8-b128; any other pool format, other block shapes and other quantization
    methods are refused, naming what works."""

    def folder(name: str, quant: dict, inter: int = 768) -> list[str]:
        path = tmp_path / name
        path.mkdir()
        config = {**QWEN3_MOE, "hidden_size": 2048, "moe_intermediate_size": inter, "torch_dtype": "bfloat16"}
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        return ["--model", str(path), "--moe-expert-pool-rows", "8"]

    deepseek = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    base = folder("fp8", deepseek)
    served = plan([*base, "--moe-expert-pool-weight-format", "fp8-b128"])
    assert served.serve.pool is not None and served.serve.pool.weight_format == "fp8-b128"
    assert served.facts is not None and served.facts.native_format == "fp8-b128"
    message = refusal(base)  # the default bf16 pool
    assert (
        "--moe-expert-pool-weight-format bf16: the checkpoint's experts are fp8-b128 already (quantization 'fp8'); "
        "the pool serves them as they are with --moe-expert-pool-weight-format fp8-b128"
    ) in message
    assert "fp8-b128 already" in refusal([*base, "--moe-expert-pool-weight-format", "int4-g128"])
    # 768 / 4 = 192 per rank on CUDA: not whole 128-blocks
    message = refusal([*base, "--moe-expert-pool-weight-format", "fp8-b128", "--tp-size", "4"], cuda=True)
    assert "the checkpoint's 128x128 blocks do not divide the expert intermediate size" in message
    assert "expert intermediate 192 per rank" in message
    assert message.rstrip().endswith("use a --tp-size whose shard of it is whole blocks"), message
    assert "formats that fit" not in message  # no other format takes this checkpoint
    for name, quant in (
        ("rect", {**deepseek, "weight_block_size": [128, 64]}),
        ("e5m2", {**deepseek, "fmt": "e5m2"}),
        ("awq", {"quant_method": "awq", "bits": 4}),
    ):
        message = refusal([*folder(name, quant), "--moe-expert-pool-weight-format", "fp8-b128"])
        assert (
            "the pool takes unquantized (bf16/fp16/fp32) experts, and fp8 e4m3 ones in square blocks"
            in message
        ), name


def test_fp8_tensor_checkpoints_are_served_in_the_fp8_format(tmp_path: Path) -> None:
    """An fp8 checkpoint with one scale per tensor (quant_method fp8, no weight_block_size; static or dynamic
    activations) is served as it is with --moe-expert-pool-weight-format fp8 (per-channel scales hold it exactly),
    under any --tp-size whose shards exist; other pool formats are refused naming that one."""
    config = {**QWEN3_MOE, "hidden_size": 2048, "moe_intermediate_size": 768, "torch_dtype": "bfloat16"}
    for scheme in ("static", "dynamic"):
        path = tmp_path / scheme
        path.mkdir()
        quant = {"quant_method": "fp8", "activation_scheme": scheme}
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        base = ["--model", str(path), "--moe-expert-pool-rows", "8"]
        served = plan([*base, "--moe-expert-pool-weight-format", "fp8"])
        assert served.serve.pool is not None and served.serve.pool.weight_format == "fp8"
        assert served.facts is not None and served.facts.native_format == "fp8"
        # no blocks to straddle ranks: 768 / 4 = 192 rows per rank take their shard's scale
        tp = plan([*base, "--moe-expert-pool-weight-format", "fp8", "--tp-size", "4"], cuda=True)
        assert tp.serve.pool is not None
        for other in ("bf16", "fp8-b128", "int4-g128"):
            message = refusal([*base, "--moe-expert-pool-weight-format", other])
            assert (
                f"--moe-expert-pool-weight-format {other}: the checkpoint's experts are fp8 already "
                "(quantization 'fp8'); the pool serves them as they are with --moe-expert-pool-weight-format fp8"
            ) in message, message


def test_compressed_tensors_fp8_checkpoints_are_served_in_their_format(tmp_path: Path) -> None:
    """llm-compressor fp8 checkpoints (quant_method compressed-tensors): strategy tensor or channel is served with
    --moe-expert-pool-weight-format fp8, square blocks with fp8-b{block} (groups normalised as compressed-tensors
    does); int4 groups, fp8 weights without fp8 activations and pairs SGLang refuses are refused; where config.json
    does not settle the experts' format (several groups, an ignore entry that may name experts, no weight group),
    the launcher leaves it to the layers."""
    config = {**QWEN3_MOE, "hidden_size": 2048, "moe_intermediate_size": 768, "torch_dtype": "bfloat16"}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    dynamic = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}

    def folder(name: str, *groups: dict) -> list[str]:
        path = tmp_path / name
        path.mkdir()
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {f"group_{i}": {"targets": ["Linear"], **g} for i, g in enumerate(groups)},
            "ignore": ["lm_head"],
        }
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        return ["--model", str(path), "--moe-expert-pool-rows", "8"]

    served = {
        "channel": ({"weights": {**fp8, "strategy": "channel"}, "input_activations": dynamic}, "fp8"),
        "tensor": (
            {"weights": {**fp8, "strategy": "tensor"}, "input_activations": {**fp8, "strategy": "tensor"}},
            "fp8",
        ),
        "block": (
            {
                "weights": {**fp8, "strategy": "block", "block_structure": [128, 128]},
                "input_activations": dynamic,
            },
            "fp8-b128",
        ),
    }
    # llm-compressor's NVFP4A16 and NVFP4 (W4A4: SGLang serves it weight-only below Blackwell, as the pool does)
    nv = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
    packed = "nvfp4-pack-quantized"
    served["nvfp4a16"] = ({"format": packed, "weights": nv}, "nvfp4")
    served["nvfp4"] = (
        {"format": packed, "weights": nv, "input_activations": {**nv, "dynamic": "local"}},
        "nvfp4",
    )
    for name, (group, fmt) in served.items():
        base = folder(name, group)
        got = plan([*base, "--moe-expert-pool-weight-format", fmt])
        assert got.facts is not None and got.facts.native_format == fmt, name
        assert got.serve.pool is not None and got.serve.pool.weight_format == fmt
        assert f"the checkpoint's experts are {fmt} already" in refusal(base), name  # the default bf16 pool
    # what compressed-tensors normalises: a "128x128" block string, an upper-case strategy, a default strategy
    normalised = {
        "block string": (
            {
                "weights": {**fp8, "strategy": "block", "block_structure": "128x128"},
                "input_activations": dynamic,
            },
            "fp8-b128",
        ),
        "upper case": ({"weights": {**fp8, "strategy": "CHANNEL"}, "input_activations": dynamic}, "fp8"),
        "default strategy": ({"weights": fp8, "input_activations": {**fp8, "strategy": "tensor"}}, "fp8"),
    }
    for name, (group, fmt) in normalised.items():
        got = plan([*folder(name, group), "--moe-expert-pool-weight-format", fmt])
        assert got.facts is not None and got.facts.native_format == fmt, name
    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    refused = {
        "int4": ({"weights": int4},),
        "fp8 weights only": ({"weights": {**fp8, "strategy": "channel"}},),
        "nvfp4 groups of 32": ({"format": "nvfp4-pack-quantized", "weights": {**nv, "group_size": 32}},),
        "nvfp4 not packed": ({"weights": nv},),
        "nvfp4 with fp8 activations": (
            {
                "format": "nvfp4-pack-quantized",
                "weights": nv,
                "input_activations": {**fp8, "strategy": "tensor"},
            },
        ),
        # pairs SGLang's fp8 MoE scheme does not take (it asserts): per-tensor weights with per-token inputs,
        # per-channel weights with static inputs
        "tensor-token": ({"weights": {**fp8, "strategy": "tensor"}, "input_activations": dynamic},),
        "channel-static": (
            {"weights": {**fp8, "strategy": "channel"}, "input_activations": {**fp8, "strategy": "tensor"}},
        ),
    }
    for name, groups in refused.items():
        message = refusal([*folder(name, *groups), "--moe-expert-pool-weight-format", "fp8"])
        assert "quantization 'compressed-tensors': the pool takes unquantized" in message, (name, message)
        assert "llm-compressor's fp8 (compressed-tensors" in message
        assert "and NVFP4 (nvfp4-pack-quantized, with --moe-expert-pool-weight-format nvfp4)" in message
    # config.json alone does not settle the experts' format: no refusal on it, the layers decide
    ignore_experts = folder("ignore experts", served["channel"][0])
    config_path = Path(ignore_experts[1]) / "config.json"
    data = json.loads(config_path.read_text())
    data["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.experts.*"]
    config_path.write_text(json.dumps(data))
    per_layer = {
        "two schemes": folder("two schemes", served["channel"][0], served["block"][0]),
        "ignore experts": ignore_experts,
        "kv cache only": folder("kv cache only"),
    }
    for name, base in per_layer.items():
        got = plan(base)  # the default bf16 pool
        assert got.facts is not None and got.facts.native_format_per_layer, name
        assert got.serve.pool is not None and got.serve.pool.weight_format == "bf16", name


NVFP4_CONFIG = {**QWEN3_MOE, "hidden_size": 2048, "moe_intermediate_size": 768, "torch_dtype": "bfloat16"}


def nvfp4_folder(
    tmp_path: Path, name: str, quant: dict | None = None, legacy: dict | None = None
) -> list[str]:
    """A ModelOpt checkpoint folder: `quant` as config.json's quantization_config, `legacy` as the separate
    hf_quant_config.json file."""
    path = tmp_path / name
    path.mkdir()
    config = {**NVFP4_CONFIG, **({"quantization_config": quant} if quant is not None else {})}
    (path / "config.json").write_text(json.dumps(config))
    if legacy is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(legacy))
    return ["--model", str(path), "--moe-expert-pool-rows", "8"]


def test_modelopt_nvfp4_checkpoints_are_served_in_the_nvfp4_format(tmp_path: Path) -> None:
    """NVIDIA ModelOpt NVFP4 checkpoints (quant_algo NVFP4 or W4A16_NVFP4, groups of 16; config.json's flat
    quantization_config with quant_method modelopt or none, or the legacy hf_quant_config.json SGLang reads when
    config.json has none) are served as they are with --moe-expert-pool-weight-format nvfp4; NVFP4_AWQ, other
    group sizes and mixed precision are refused naming what the pool takes."""
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    legacy = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.self_attn*"],
        },
    }
    no_method = {k: v for k, v in flat.items() if k != "quant_method"}
    w4a16 = {**flat, "quant_algo": "W4A16_NVFP4"}
    served = {
        "flat": (nvfp4_folder(tmp_path, "flat", flat), "modelopt"),
        "no quant_method": (nvfp4_folder(tmp_path, "no method", no_method), "NVFP4"),
        "no group_size": (nvfp4_folder(tmp_path, "no group", {**flat, "group_size": None}), "modelopt"),
        "w4a16": (nvfp4_folder(tmp_path, "w4a16", w4a16), "modelopt"),
        "legacy file": (nvfp4_folder(tmp_path, "legacy", legacy=legacy), "NVFP4"),
    }
    for name, (base, quantization) in served.items():
        got = plan([*base, "--moe-expert-pool-weight-format", "nvfp4"])
        assert got.facts is not None and got.facts.native_format == "nvfp4", name
        assert got.facts.quantization == quantization and not got.facts.native_format_per_layer, name
        assert got.serve.pool is not None and got.serve.pool.weight_format == "nvfp4", name
        message = refusal(base)  # the default bf16 pool
        assert (
            f"--moe-expert-pool-weight-format bf16: the checkpoint's experts are nvfp4 already (quantization "
            f"{quantization!r}); the pool serves them as they are with --moe-expert-pool-weight-format nvfp4"
        ) in message, (name, message)
    # config.json's own quantization_config wins over the file (SGLang reads the file only without one)
    both = nvfp4_folder(tmp_path, "both", {"quant_method": "fp8", "weight_block_size": [128, 128]}, legacy)
    assert plan([*both, "--moe-expert-pool-weight-format", "fp8-b128"]).facts.native_format == "fp8-b128"
    # a file whose quant_algo SGLang does not know is not a quantization to it: an unquantized checkpoint
    kv_only = {**legacy, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    got = plan(nvfp4_folder(tmp_path, "kv only", legacy=kv_only))
    assert got.facts is not None and got.facts.quantization is None and got.serve.pool is not None
    refused = {
        "awq": nvfp4_folder(tmp_path, "awq", {**flat, "quant_algo": "NVFP4_AWQ"}),
        "group 32": nvfp4_folder(tmp_path, "group 32", {**flat, "group_size": 32}),
        "legacy group 32": nvfp4_folder(
            tmp_path,
            "legacy 32",
            legacy={**legacy, "quantization": {**legacy["quantization"], "group_size": 32}},
        ),
        "no legacy group": nvfp4_folder(
            tmp_path, "legacy none", legacy={"quantization": {"quant_algo": "NVFP4", "exclude_modules": []}}
        ),
        "mixed": nvfp4_folder(tmp_path, "mixed", {**flat, "quant_algo": "MIXED_PRECISION"}),
        "null ignore": nvfp4_folder(tmp_path, "null ignore", {**flat, "ignore": None}),
    }
    for name, base in refused.items():
        message = refusal([*base, "--moe-expert-pool-weight-format", "nvfp4"])
        assert "the pool takes unquantized (bf16/fp16/fp32) experts" in message, (name, message)
        assert (
            "ModelOpt NVFP4 (quant_algo NVFP4 or W4A16_NVFP4, group 16) with "
            "--moe-expert-pool-weight-format nvfp4" in message
        ), name
    # the checkpoint's groups of 16 must not straddle ranks: 768 / 16 = 48 per rank on CUDA is not whole groups
    base = served["flat"][0]
    assert plan([*base, "--moe-expert-pool-weight-format", "nvfp4", "--tp-size", "4"], cuda=True).serve.pool
    message = refusal([*base, "--moe-expert-pool-weight-format", "nvfp4", "--tp-size", "32"], cuda=True)
    assert "nvfp4 format: w2 has K=24, not a multiple of 16" in message, message
    assert "use a --tp-size whose shard of it is whole groups of 16" in message
    message = refusal([*base, "--moe-expert-pool-weight-format", "nvfp4", "--dtype", "float32"])
    assert "serve in bf16 (--dtype bfloat16)" in message


def test_modelopt_fp8_checkpoints_are_served_in_the_fp8_format(tmp_path: Path) -> None:
    """NVIDIA ModelOpt FP8 checkpoints (quant_algo FP8: one weight_scale and input_scale per tensor), in
    config.json or the legacy hf_quant_config.json, are served as they are with --moe-expert-pool-weight-format
    fp8; other pool formats are refused naming it; an exclude pattern naming experts leaves it to the layers."""
    flat = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "*self_attn*"]}
    legacy = {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "FP8", "exclude_modules": None},
    }
    served = {
        "flat": (nvfp4_folder(tmp_path, "flat", flat), "modelopt"),
        "no ignore": (
            nvfp4_folder(tmp_path, "no ignore", {"quant_method": "modelopt", "quant_algo": "FP8"}),
            "modelopt",
        ),
        "legacy file": (nvfp4_folder(tmp_path, "legacy", legacy=legacy), "FP8"),
    }
    for name, (base, quantization) in served.items():
        got = plan([*base, "--moe-expert-pool-weight-format", "fp8"])
        assert got.facts is not None and got.facts.native_format == "fp8", name
        assert got.facts.quantization == quantization and not got.facts.native_format_per_layer, name
        for other in ("bf16", "nvfp4"):
            message = refusal([*base, "--moe-expert-pool-weight-format", other])
            assert (
                f"--moe-expert-pool-weight-format {other}: the checkpoint's experts are fp8 already (quantization "
                f"{quantization!r}); the pool serves them as they are with --moe-expert-pool-weight-format fp8"
            ) in message, (name, message)
    naming = nvfp4_folder(tmp_path, "naming", {**flat, "ignore": ["*experts*"]})
    got = plan(naming)
    assert got.facts is not None and got.facts.native_format_per_layer and got.facts.native_format == ""
    bad = nvfp4_folder(tmp_path, "bad", {**flat, "ignore": "lm_head"})  # not a list: not read as patterns
    assert "quantization 'modelopt': the pool takes unquantized" in refusal(bad)


def test_modelopt_exclude_patterns_naming_experts(tmp_path: Path) -> None:
    """An exclude pattern that SGLang's `is_layer_excluded` would match against an MoE layer's experts (glob-style,
    whole prefix or one dotted part) keeps those experts unquantized. NVFP4: SGLang's own NVFP4 experts cannot be
    built on Hopper with the pool's triton runner, so the nvfp4 pool is still required (it keeps the excluded
    layers on the device), unless every MoE layer is excluded: then the layers decide. FP8: the layers decide
    as soon as one layer may be excluded. Patterns that name no MoE layer's experts (lm_head, attention, the
    router gate, a dense or MTP layer, shared experts) change nothing."""
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    # QWEN3_MOE: 6 layers, layer 2 dense (mlp_only_layers), no MTP layer
    every_layer = {
        "experts": {**flat, "ignore": ["lm_head", "*experts*"]},
        "a dotted part": {**flat, "ignore": ["mlp*"]},
        "mixtral's container": {**flat, "ignore": ["*block_sparse_moe*"]},
        "exclude_modules key": {**flat, "exclude_modules": ["*.mlp.experts"]},
        "legacy file": None,
    }
    for name, quant in every_layer.items():
        legacy = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["*experts"]}}
        base = nvfp4_folder(tmp_path, name, quant, legacy=None if quant else legacy)
        got = plan(base)  # the default bf16 pool: not refused
        assert got.facts is not None and got.facts.native_format_per_layer, name
        assert got.facts.native_format == "" and got.serve.pool is not None, name
    some_layers = {
        "one moe layer": ["model.layers.3.*"],
        "a layer index part": ["4"],
        "wrapped model": ["language_model.model.layers.1.mlp.experts"],
        "gemma-style wrapper": ["model.language_model.layers.1.*"],
    }
    not_naming = {
        "plain": ["lm_head", "*self_attn*", "*.mlp.gate", "model.layers.*.mlp.gate"],
        "dense layer": ["model.layers.2.*"],
        "mtp layer": ["model.layers.6*"],
        "shared expert": ["*shared_expert*"],
    }
    for name, patterns in {**some_layers, **not_naming}.items():
        base = nvfp4_folder(tmp_path, name, {**flat, "ignore": patterns})
        got = plan([*base, "--moe-expert-pool-weight-format", "nvfp4"])
        assert got.facts is not None and not got.facts.native_format_per_layer, name
        assert got.facts.native_format == "nvfp4", name
        assert "nvfp4 already" in refusal(base), name
        fp8_quant = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": patterns}
        fp8 = plan(
            [*nvfp4_folder(tmp_path, f"fp8 {name}", fp8_quant), "--moe-expert-pool-weight-format", "fp8"]
        )
        assert fp8.facts is not None and fp8.facts.native_format_per_layer == (name in some_layers), name


def test_hybrid_fp8_nvfp4_checkpoints_are_not_read_as_fp8(tmp_path: Path) -> None:
    """SGLang's hybrid FP8 + NVFP4 checkpoints (quant_method fp8 with moe_quant_algo NVFP4, e.g.
    DeepSeek-V4-Pro-NVFP4) have NVFP4 experts: not the fp8-b128 format their quant_method suggests."""
    quant = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "quant_algo": "MIXED_PRECISION",
        "moe_quant_algo": "NVFP4",
        "group_size": 16,
    }
    base = nvfp4_folder(tmp_path, "hybrid", quant)
    message = refusal([*base, "--moe-expert-pool-weight-format", "fp8-b128"])
    assert "quantization 'fp8': the pool takes unquantized" in message, message


def test_pool_formats_are_checked_against_the_experts(tmp_path: Path) -> None:
    """A quantized pool format quantizes an unquantized checkpoint while it loads: its groups must divide each
    rank's K dimensions (H for w13, I for w2) and the model must compute in bf16/fp16; the refusal lists the
    formats that fit."""
    folder = tmp_path / "sized"
    folder.mkdir()
    config = {**QWEN3_MOE, "hidden_size": 256, "moe_intermediate_size": 96, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    base = ["--model", str(folder), "--moe-expert-pool-rows", "8", "--moe-expert-pool-weight-format"]
    for fmt in ("int4-g32", "int4-g32-zp", "fp8", "fp8-b128", "nvfp4"):
        served = plan([*base, fmt])
        assert served.serve.pool is not None and served.serve.pool.weight_format == fmt
        assert served.rank_memory is not None
    # rows shrink with the format: int4 with a group of 32 holds 4.5 bits per weight, bf16 16
    bf16_row = plan([*base, "bf16"]).rank_memory.row_bytes
    assert plan([*base, "int4-g32"]).rank_memory.row_bytes * 16 == bf16_row * 4.5
    message = refusal([*base, "int4-g64"])
    assert (
        "--moe-expert-pool-weight-format int4-g64: int4 format: w2 has K=96, not a multiple of group 64"
        in (message)
    )
    assert "expert intermediate 96 per rank, bfloat16" in message
    assert "formats that fit this model: bf16, int4-g32, int4-g32-zp, fp8, fp8-b16, fp8-b32, fp8-b64, " in (
        message
    )
    assert "int4-g128" not in message.split("fit this model:")[1]
    message = refusal([*base, "nvfp4", "--dtype", "float32"])
    assert "nvfp4 format: compute dtype torch.float32 is not bf16 or fp16" in message
    assert (
        "formats that fit this model served in bf16 (--dtype bfloat16): bf16, int4-g32, int4-g32-zp, fp8, "
        in (message)
    )
    # SGLang serves a float32 checkpoint (or one with no dtype in config.json) in float16 unless --dtype says
    # otherwise: a quantized format fits it, and the rows are sized for 16-bit weights
    for dtype in ("float32", None):
        folder32 = tmp_path / f"fp32-{dtype}"
        folder32.mkdir()
        (folder32 / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}))
        base32 = [str(folder32) if a == str(folder) else a for a in base]
        assert plan([*base32, "nvfp4"]).serve.pool is not None
        assert plan([*base32, "bf16"]).rank_memory.row_bytes == bf16_row
        assert plan([*base32, "bf16", "--dtype", "float32"]).rank_memory.row_bytes == 2 * bf16_row
    # under TP each rank's shard is checked: 96 / 2 = 48 per rank on CUDA, which NVFP4's 16 divides
    # and int4's group of 32 does not
    assert "expert intermediate 48 per rank" in refusal([*base, "int4-g32", "--tp-size", "2"], cuda=True)


def test_devices_must_match_the_machine_and_sglang(model: str) -> None:
    base = ["--model", model, "--moe-expert-pool-rows", "8"]
    assert "--device cuda but CUDA is not available" in refusal([*base, "--device", "cuda"], cuda=False)
    # SGLang picks its ops by platform and the CPU patches refuse CUDA: a CPU server on a GPU box hides the GPUs
    message = refusal([*base, "--device", "cpu"], cuda=True)
    assert "--device cpu on a machine with CUDA" in message and "CUDA_VISIBLE_DEVICES=" in message
    assert "runs on CUDA or the CPU" in refusal([*base, "--device", "xpu"], cuda=True)
    message = refusal([*base, "--moe-expert-pool-device", "cpu"], cuda=True)
    assert "the pool must be where the model runs" in message
    message = refusal([*base, "--tp-size", "2", "--moe-expert-pool-device", "cuda:1"], cuda=True)
    assert "each rank's pool belongs on that rank's GPU" in message
    for bad in ("gpu", "meta"):
        message = refusal([*base, "--moe-expert-pool-device", bad])
        assert f"device={bad!r}" in message and "use cuda, cuda:N or cpu" in message
    assert plan([*base, "--device", "cpu"], cuda=False).serve.cpu  # the CPU machine's own case
    assert plan(["--model", model, "--no-moe-expert-pool", "--device", "cpu"], cuda=True).serve.pool is None


def test_the_last_of_a_repeated_flag_counts_as_in_sglang(model: str, tmp_path: Path) -> None:
    message = refusal(
        ["--model", str(tmp_path / "nowhere"), "--model", model, "--moe-expert-pool-rows", "999"]
    )
    assert "above the 50 routed experts" in message  # the model SGLang will serve is the one checked


def test_refusals_come_before_the_embedded_model_is_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    import pooled_runner.sglang.embedded as embedded

    def generate() -> None:
        raise AssertionError("the embedded model was generated for a refused launch")

    monkeypatch.setattr(embedded, "ensure_embedded_model", generate)
    assert "--config FILE" in refusal(["--config", "serve.yaml"])


def test_every_config_problem_in_one_message(model: str) -> None:
    message = refusal(
        ["--model", model, "--moe-expert-pool-rows", "0", "--moe-expert-pool-staging-min-tokens", "0"]
    )
    assert "must be a positive number of rows" in message and "staging_min_tokens=0" in message
    assert "pool_rows=" not in message  # the rows are reported once, with the model's numbers


def test_hub_id_is_read_from_the_local_cache_or_warned_about(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        p = plan(["--model", "some-org/some-moe", "--moe-expert-pool-rows", "999"])
    assert p.facts is None and p.serve.pool is not None  # nothing to check against: accepted, with a warning
    assert "no config.json of some-org/some-moe" in caplog.text and "checks" in caplog.text
    # the same id once its config.json is in the cache (the layout huggingface_hub writes): checked
    repo = tmp_path / "hub" / "models--some-org--some-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(QWEN3_MOE))
    assert "above the 50 routed experts" in refusal(
        ["--model", "some-org/some-moe", "--moe-expert-pool-rows", "999"]
    )
    # SGLang's --revision and --download-dir pick the config.json that is checked
    wide = json.dumps({**QWEN3_MOE, "num_experts": 200})  # 5 MoE layers x 200
    (repo / "refs" / "v2").write_text("def456")
    (repo / "snapshots" / "def456").mkdir()
    (repo / "snapshots" / "def456" / "config.json").write_text(wide)
    assert plan(["--model", "some-org/some-moe", "--revision", "v2", "--moe-expert-pool-rows", "999"]).facts
    other = tmp_path / "downloads" / repo.name
    (other / "refs").mkdir(parents=True)
    (other / "refs" / "main").write_text("abc123")
    (other / "snapshots" / "abc123").mkdir(parents=True)
    (other / "snapshots" / "abc123" / "config.json").write_text(wide)
    argv = [
        "--model",
        "some-org/some-moe",
        "--download-dir",
        str(other.parent),
        "--moe-expert-pool-rows",
        "999",
    ]
    assert plan(argv).facts is not None


def test_bad_knob_values_refused_at_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(envs, "_checked", False)
    monkeypatch.setenv("POOLED_RUNNER_DEBUG_CHECKS", "maybe")
    monkeypatch.setenv("POOLED_RUNNER_LOG_LEVEL", "verbose")
    problems = envs.check_all()
    assert len(problems) == 2, problems
    assert (
        "POOLED_RUNNER_DEBUG_CHECKS='maybe'" in problems[1]
        and "POOLED_RUNNER_LOG_LEVEL='VERBOSE'" in problems[0]
    )
    assert "DEBUG" in problems[0] and "WARNING" in problems[0]
    assert main(["--moe-expert-pool-rows", "8"]) == 2  # before any model is generated or SGLang imported
    assert "POOLED_RUNNER_DEBUG_CHECKS" in capsys.readouterr().err
    monkeypatch.setenv("POOLED_RUNNER_LOG_LEVEL", "warn")  # any name `logging` takes
    assert envs.log_level() == "WARN"


def test_check_all_reads_every_knob() -> None:
    readers = {
        name
        for name, fn in inspect.getmembers(envs, inspect.isfunction)
        if fn.__module__ == envs.__name__ and (fn.__doc__ or "").startswith(envs.PREFIX)
    }
    assert readers and readers == {fn.__name__ for fn in envs.READERS}, readers ^ {
        fn.__name__ for fn in envs.READERS
    }


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("prefill_staging", "no", "prefill_staging='no' must be True or False"),
        ("telemetry", "false", "telemetry='false' must be True or False"),
        ("draft_pruning", 1, "draft_pruning=1 must be True or False"),
        ("staging_min_tokens", 2.5, "staging_min_tokens=2.5 must be an integer >= 1"),
        ("staging_min_tokens", "512", "staging_min_tokens='512' must be an integer >= 1"),
        ("staging_min_tokens", True, "staging_min_tokens=True must be an integer >= 1"),
        ("device", "gpu", "device='gpu' is not a torch device"),
        ("device", "meta", "device='meta': the pool runs on CUDA or the CPU only"),
        ("weight_format", "int3", "'int3' is not one of ['bf16', "),
        ("weight_format", "int3", "(--moe-expert-pool-weight-format)"),
    ],
)
def test_python_api_refuses_wrongly_typed_values(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match="invalid PoolConfig") as info:
        PoolConfig.resolve(pool_rows=4, **{"device": "cpu", field: value})
    assert expected in str(info.value)


def test_cuda_pool_refused_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        PoolConfig.resolve(pool_rows=4, device="cuda")


def test_pool_flags_with_no_pool_are_warned_about(model: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        p = plan(
            [
                "--model",
                model,
                "--no-moe-expert-pool",
                "--moe-expert-pool-rows",
                "8",
                "--moe-expert-pool-telemetry",
            ]
        )
    assert p.serve.pool is None
    assert (
        "--moe-expert-pool-rows, --moe-expert-pool-telemetry have no effect with --no-moe-expert-pool"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        plan(["--model", model, "--no-moe-expert-pool"])
    assert "no effect" not in caplog.text
