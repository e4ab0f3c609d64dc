"""A server whose pool quantizes the embedded model's experts while they load (`--moe-expert-pool-weight-format
int4-g32`, bf16), and ones serving fp8 checkpoints of it as they are (16x16 blocks: fp8-b16; one scale per
tensor, or llm-compressor's per channel: fp8) and a ModelOpt NVFP4 one (nvfp4), each serve exactly what a bf16 pool serves from a checkpoint whose experts already hold the
dequantized weights: the same greedy tokens and the same log-probabilities, prompt and output.

(Both servers run SGLang's attention and our torch path on the same bf16 values, so any difference is the
quantized load itself. The bank rows' bytes are checked against the format's converter in test_layer.py; here
the flag goes through the launcher, SGLang's loader and the served forward.)"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import requests
import torch

from tests.engine.conftest import POOL_ROWS
from tests.engine.server import launched

FORMAT = "int4-g32"
NEW_TOKENS = 12
EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\.(gate|up|down)_proj\.weight$")


def _fp8_checkpoint(embedded_model: Path, folder: Path, kind: str) -> tuple[Path, Path]:
    """An fp8 copy of the embedded checkpoint, attention left unquantized, and a copy whose experts hold its
    dequantized weights in bf16. `kind`: "blocks" (DeepSeek-style e4m3 with `weight_scale_inv` per 16x16 tile,
    dynamic activations); "per-tensor" (quant_method fp8 without blocks: one `weight_scale` per tensor, static
    activations with an `input_scale` per tensor, which the pool checks and does not use; "modelopt-fp8": the
    same tensors under NVIDIA ModelOpt's quant_algo FP8); "compressed-channel"
    (llm-compressor's FP8-dynamic: compressed-tensors, a `weight_scale` [N, 1] per output channel). Scales per
    tensor and channel are amax / 448, in plain torch."""
    import json

    from safetensors.torch import load_file, save_file

    from pooled_runner.formats.quant import dequantize_fp8, quantize_fp8

    fp8_folder, dense_folder = folder / "fp8", folder / "dequantized"
    shutil.copytree(embedded_model, fp8_folder)
    shutil.copytree(embedded_model, dense_folder)
    sd = load_file(str(embedded_model / "model.safetensors"))
    fp8, dense = dict(sd), dict(sd)
    for name, w in sd.items():
        if not EXPERT_TENSOR.match(name):
            continue
        w = w.to(torch.bfloat16)
        if kind == "blocks":
            q, scale = quantize_fp8(w, 16)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dense[name] = dequantize_fp8(q, scale, 16, torch.bfloat16).float()
            continue
        per_channel = kind == "compressed-channel"
        amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax()
        scale = amax / 448.0
        q = (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale"] = q, scale
        if kind in ("per-tensor", "modelopt-fp8"):
            fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
        dense[name] = (q.float() * scale).to(torch.bfloat16).float()
    save_file(fp8, str(fp8_folder / "model.safetensors"))
    save_file(dense, str(dense_folder / "model.safetensors"))
    config = json.loads((embedded_model / "config.json").read_text())
    attention = sorted({n.rsplit(".", 1)[0] for n in sd if ".self_attn." in n and n.endswith("_proj.weight")})
    if kind == "compressed-channel":
        e4m3 = {"num_bits": 8, "type": "float", "symmetric": True}
        group = {
            "targets": ["Linear"],
            "weights": {**e4m3, "dynamic": False, "strategy": "channel"},
            "input_activations": {**e4m3, "dynamic": True, "strategy": "token"},
        }
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", *attention],
        }
    elif kind == "modelopt-fp8":
        quant = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "*self_attn*"]}
    else:
        quant = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic" if kind == "blocks" else "static",
            "fmt": "e4m3",
            **({"weight_block_size": [16, 16]} if kind == "blocks" else {}),
            "ignored_layers": attention,
        }
    config["quantization_config"] = quant
    (fp8_folder / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_folder, dense_folder


def _nvfp4_checkpoint(embedded_model: Path, folder: Path, flavor: str) -> tuple[Path, Path]:
    """An NVFP4 copy of the embedded checkpoint, quantized in plain torch (`test_layer_nvfp4_modelopt.quantize`,
    gate and up sharing one global as ModelOpt's export syncs them; attention and lm_head left unquantized), and a
    copy whose experts hold its dequantized weights in bf16. `flavor`: "modelopt" (config.json's flat
    `quantization_config`, quant_method modelopt, quant_algo NVFP4: `weight`, `weight_scale`, `weight_scale_2`,
    `input_scale`) or "compressed" (llm-compressor's NVFP4A16: compressed-tensors, `weight_packed`,
    `weight_scale`, `weight_global_scale` = 1 / weight_scale_2, whose reciprocal the rows hold)."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.engine.test_layer_nvfp4_modelopt import E2M1_MAX, E4M3_MAX, dequantize, quantize

    nvfp4_folder, dense_folder = folder / "nvfp4", folder / "dequantized"
    shutil.copytree(embedded_model, nvfp4_folder)
    shutil.copytree(embedded_model, dense_folder)
    sd = load_file(str(embedded_model / "model.safetensors"))
    nvfp4, dense = dict(sd), dict(sd)
    experts = sorted({m.group(1) for k in sd if (m := EXPERT_TENSOR.match(k))})
    for prefix in experts:
        w = {p: sd[f"{prefix}.{p}_proj.weight"].to(torch.bfloat16).float() for p in ("gate", "up", "down")}
        shared = max(w["gate"].abs().amax(), w["up"].abs().amax()) / (E2M1_MAX * E4M3_MAX)
        for p, g in (
            ("gate", shared),
            ("up", shared),
            ("down", w["down"].abs().amax() / (E2M1_MAX * E4M3_MAX)),
        ):
            name = f"{prefix}.{p}_proj."
            q, scale = quantize(w[p], g)
            del nvfp4[name + "weight"]
            nvfp4[name + "weight_scale"] = scale
            if flavor == "modelopt":
                nvfp4[name + "weight"] = q
                nvfp4[name + "weight_scale_2"] = g.reshape(()).clone()  # gate's and up's: one tensor each
                nvfp4[name + "input_scale"] = torch.tensor(0.05)
            else:
                global_scale = (torch.tensor(1.0) / g).reshape(1)  # [1], as llm-compressor writes it
                nvfp4[name + "weight_packed"], nvfp4[name + "weight_global_scale"] = q, global_scale.clone()
                g = torch.tensor(1.0) / global_scale  # what the rows hold
            dense[name + "weight"] = dequantize(q, scale, float(g)).to(torch.bfloat16).float()
    save_file(nvfp4, str(nvfp4_folder / "model.safetensors"))
    save_file(dense, str(dense_folder / "model.safetensors"))
    config = json.loads((embedded_model / "config.json").read_text())
    if flavor == "modelopt":
        quant = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": ["lm_head", "*self_attn*"],
        }
    else:
        attention = sorted(
            {n.rsplit(".", 1)[0] for n in sd if ".self_attn." in n and n.endswith("_proj.weight")}
        )
        nvfp4_args = {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor_group",
            "group_size": 16,
        }
        quant = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": nvfp4_args}},
            "ignore": ["lm_head", *attention],
        }
    config["quantization_config"] = quant
    (nvfp4_folder / "config.json").write_text(json.dumps(config, indent=2))
    return nvfp4_folder, dense_folder


def _dequantized_checkpoint(embedded_model: Path, folder: Path) -> Path:
    """A copy of the embedded checkpoint whose expert tensors hold dequantize(quantize(w)) in bf16, quantized
    as the pool does: w13 = [gate; up] as one projection, after the bf16 cast SGLang's loader makes."""
    from safetensors.torch import load_file, save_file

    from pooled_runner.formats import make_format

    shutil.copytree(embedded_model, folder)
    sd = load_file(str(embedded_model / "model.safetensors"))
    converter = make_format(FORMAT, torch.bfloat16)
    experts = sorted({m.group(1) for k in sd if (m := EXPERT_TENSOR.match(k))})
    assert len(experts) == 64, f"{len(experts)} experts in the embedded checkpoint"
    for prefix in experts:
        gate, up, down = (sd[f"{prefix}.{p}_proj.weight"].to(torch.bfloat16) for p in ("gate", "up", "down"))
        w13, w2 = converter.expert_weights(converter.quantize(torch.cat([gate, up]), down))
        assert not torch.equal(w2, down)  # the format really rounds: the comparison is not trivial
        inter = gate.shape[0]
        for name, w in (("gate", w13[:inter]), ("up", w13[inter:]), ("down", w2)):
            sd[f"{prefix}.{name}_proj.weight"] = w.float().contiguous()  # bf16 values, exactly
    save_file(sd, str(folder / "model.safetensors"))
    return folder


def _served(url: str, ids: list[int]) -> tuple[list[int], list[float]]:
    """(greedy output ids, log-probabilities of the prompt from its second token, then of the output)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    logprobs = [float(v[0]) for v in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    return list(r.json()["output_ids"]), logprobs


def _serve(args: list[str], log: Path, prompts: list[list[int]]) -> tuple[list, str]:
    common = ["--moe-expert-pool-rows", str(POOL_ROWS), "--dtype", "bfloat16"]
    with launched([*args, *common], log) as server:
        return [_served(server.url, ids) for ids in prompts], server.log()


def test_int4_pool_serves_what_bf16_serves_of_the_dequantized_experts(
    embedded_model: Path, prompt_ids: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("quantized")
    quantized, log = _serve(
        ["--model-path", str(embedded_model), "--moe-expert-pool-weight-format", FORMAT],
        tmp / "int4.log",
        prompt_ids,
    )
    assert f"4 MoE layers pooled (64 experts, {FORMAT}), 0 not pooled" in log
    assert re.search(
        rf"experts quantized to {FORMAT} while loading \(64 experts; at most \d+ held dense", log
    )

    dequantized = _dequantized_checkpoint(embedded_model, tmp / "dequantized")
    reference, log = _serve(["--model-path", str(dequantized)], tmp / "bf16.log", prompt_ids)
    assert "4 MoE layers pooled (64 experts, bf16), 0 not pooled" in log
    for ids, (got_ids, got_lp), (ref_ids, ref_lp) in zip(prompt_ids, quantized, reference, strict=True):
        assert got_ids == ref_ids, f"prompt {ids[:4]}...: int4 pool {got_ids} != bf16 pool {ref_ids}"
        assert len(got_lp) == len(ids) - 1 + NEW_TOKENS
        assert got_lp == ref_lp, f"prompt {ids[:4]}...: log-probabilities {got_lp} != {ref_lp}"


@pytest.mark.parametrize(
    "kind",
    ["blocks", "per-tensor", "compressed-channel", "modelopt-fp8", "modelopt-nvfp4", "compressed-nvfp4"],
)
def test_checkpoint_served_as_it_is_serves_what_bf16_serves_of_its_dequantized_experts(
    embedded_model: Path, prompt_ids: list[list[int]], tmp_path_factory: pytest.TempPathFactory, kind: str
) -> None:
    tmp = tmp_path_factory.mktemp("as-it-is")
    if kind.endswith("nvfp4"):
        quantized, dense = _nvfp4_checkpoint(embedded_model, tmp, kind.removesuffix("-nvfp4"))
    else:
        quantized, dense = _fp8_checkpoint(embedded_model, tmp, kind)
    fmt = "fp8-b16" if kind == "blocks" else "nvfp4" if kind.endswith("nvfp4") else "fp8"
    served, log = _serve(
        ["--model-path", str(quantized), "--moe-expert-pool-weight-format", fmt],
        tmp / f"{kind}.log",
        prompt_ids,
    )
    assert f"4 MoE layers pooled (64 experts, {fmt}), 0 not pooled" in log
    assert "quantized to" not in log  # the checkpoint's weights are the rows: nothing quantized on load
    reference, log = _serve(["--model-path", str(dense)], tmp / "bf16.log", prompt_ids)
    assert "4 MoE layers pooled (64 experts, bf16), 0 not pooled" in log
    for ids, (got_ids, got_lp), (ref_ids, ref_lp) in zip(prompt_ids, served, reference, strict=True):
        assert got_ids == ref_ids, f"prompt {ids[:4]}...: {fmt} pool {got_ids} != bf16 pool {ref_ids}"
        assert got_lp == ref_lp, f"prompt {ids[:4]}...: log-probabilities {got_lp} != {ref_lp}"
