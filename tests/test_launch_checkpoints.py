"""What the launcher does with quantized checkpoints: fp8 (block, per-tensor, compressed-tensors), NVIDIA ModelOpt
FP8/NVFP4 and llm-compressor NVFP4 checkpoints served in their own pool format, everything else refused naming
what works (tests/test_launch_refusals.py: SGLang's --quantization with the pool on)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_launch_plan import QWEN3_MOE, plan
from tests.test_launch_refusals import refusal


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
