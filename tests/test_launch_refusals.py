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
