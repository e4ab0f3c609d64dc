"""The launcher's plan, without SGLang: flag validation against config.json, CPU defaults, child config."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pooled_runner.config import PoolConfig
from pooled_runner.launch import CPU_MAX_TOTAL_TOKENS, build_parser, cuda_graph_warning, resolve_launch
from pooled_runner.launch_checks import GRAPHS_OFF
from pooled_runner.sglang.model_facts import facts_from_config
from pooled_runner.sglang.serve_config import ServeConfig

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 6,
    "num_experts": 10,
    "num_experts_per_tok": 3,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
}


# what the launcher adds for the pooled layers on CUDA (DeepSeek's shared-expert fusion off, the triton runner)
MOE_ADDED = ["--disable-shared-experts-fusion", "--moe-runner-backend", "triton"]


def write_model(tmp_path: Path, config: dict) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def plan(argv: list[str], cuda: bool = False):  # type: ignore[no-untyped-def]
    ours, rest = build_parser().parse_known_args(argv)
    return resolve_launch(ours, rest, cuda_available=cuda)


def test_facts_count_moe_layers_of_each_family() -> None:
    f = facts_from_config(QWEN3_MOE)
    assert (f.num_moe_layers, f.num_experts, f.top_k, f.num_total_experts) == (5, 10, 3, 50)
    deepseek = {
        "num_hidden_layers": 7,
        "n_routed_experts": 9,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 3,
    }
    assert facts_from_config(deepseek).num_total_experts == 4 * 9
    sparse_step = {
        "num_hidden_layers": 8,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "decoder_sparse_step": 3,
    }
    assert facts_from_config(sparse_step).num_moe_layers == 2  # layers 2 and 5
    nested = {"text_config": {**QWEN3_MOE}, "quantization_config": {"quant_method": "fp8"}}
    assert facts_from_config(nested).quantization == "fp8"
    assert facts_from_config({"num_hidden_layers": 4}).num_moe_layers == 0


def test_user_model_rows_pass_through_with_cpu_defaults(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    p = plan(["--model", str(model), "--moe-expert-pool-rows", "7", "--enable-metrics", "--dtype", "float32"])
    assert p.serve.pool == PoolConfig.resolve(pool_rows=7, device="cpu")
    assert p.serve.cpu and p.serve.metrics and not p.embedded
    assert p.sglang_argv == [
        "--model", str(model), "--enable-metrics", "--dtype", "float32",
        "--device", "cpu", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS),
    ]  # fmt: skip


def test_user_cpu_flags_are_kept_and_cuda_adds_nothing(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    argv = [
        "--model-path=" + str(model),
        "--moe-expert-pool-rows",
        "50",
        "--device=cpu",
        "--max-total-tokens",
        "99",
    ]
    assert plan(argv).sglang_argv == argv[:1] + argv[3:]
    cuda = plan(["--model-path", str(model), "--moe-expert-pool-rows", "4"], cuda=True)
    assert cuda.sglang_argv == ["--model-path", str(model), *GRAPHS_OFF, *MOE_ADDED] and not cuda.serve.cpu
    # the user's own MoE settings are kept (and the pooled layers' checks judge them)
    mine = ["--model-path", str(model), "--moe-runner-backend", "auto", "--disable-shared-experts-fusion"]
    assert plan([*mine, "--moe-expert-pool-rows", "4"], cuda=True).sglang_argv == [*mine, *GRAPHS_OFF]
    unpooled = plan(["--model-path", str(model), "--no-moe-expert-pool"], cuda=True)
    assert unpooled.sglang_argv == ["--model-path", str(model)]


@pytest.mark.parametrize(
    ("graph_flags", "added", "warned"),
    [
        ([], True, "CUDA graphs disabled"),
        (["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill", "disabled"], False, None),
        (["--disable-cuda-graph"], False, None),  # SGLang's deprecated spelling: both phases off
        (["--disable-decode-cuda-graph"], False, "leave the prefill graphs on"),
        (
            ["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"],
            False,
            "leave the decode graphs on",
        ),
        (
            ["--disable-prefill-cuda-graph", "--cuda-graph-backend-decode=breakable"],
            False,
            "the decode graphs",
        ),
        (["--disable-cuda-graph", "--cuda-graph-config", "{}"], False, "decode and prefill graphs"),
    ],
)
def test_cuda_graphs_off_unless_the_user_sets_them_and_the_log_says_which(
    tmp_path: Path, graph_flags: list[str], added: bool, warned: str | None
) -> None:
    """SGLang's per-phase backends (and its JSON config) override the deprecated --disable-cuda-graph: the
    launcher adds both phases' `disabled` only when no graph flag is given, and warns where the user's flags
    leave a phase's graphs on over the pooled layers."""
    model = write_model(tmp_path, QWEN3_MOE)
    argv = ["--model-path", str(model), "--moe-expert-pool-rows", "4", *graph_flags]
    p = plan(argv, cuda=True)
    expected = ["--model-path", str(model), *graph_flags] + (list(GRAPHS_OFF) if added else []) + MOE_ADDED
    assert p.sglang_argv == expected
    warning = cuda_graph_warning(p, argv)
    if warned is None:
        assert warning is None, warning
    else:
        assert warning is not None and warned in warning, warning
    assert cuda_graph_warning(plan(argv), argv) is None  # the CPU: no graphs
    unpooled = plan(["--model-path", str(model), "--no-moe-expert-pool", *graph_flags], cuda=True)
    assert cuda_graph_warning(unpooled, argv) is None


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (None, "--moe-expert-pool-rows N is required"),
        ("0", "must be a positive number of rows"),
        ("-3", "must be a positive number of rows"),
        ("2", "below top-k 3"),
        ("51", "above the 50 routed experts of the model (5 MoE layers x 10); use <= 50"),
    ],
)
def test_bad_rows_are_refused_with_the_fix(tmp_path: Path, rows: str | None, expected: str) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    argv = ["--model", str(model)] + (["--moe-expert-pool-rows", rows] if rows is not None else [])
    with pytest.raises(ValueError, match="cannot launch") as info:
        plan(argv)
    assert expected in str(info.value)


def test_every_problem_in_one_message(tmp_path: Path) -> None:
    model = write_model(tmp_path, {**QWEN3_MOE, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError) as info:
        plan(["--model", str(model), "--moe-expert-pool-rows", "1", "--enable-paged-experts"])
    message = str(info.value)
    for part in ("--enable-paged-experts", "quantization 'awq'", "below top-k 3"):
        assert part in message, message


def test_model_without_moe_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path, {"num_hidden_layers": 4, "intermediate_size": 64})
    with pytest.raises(ValueError, match="no MoE layer"):
        plan(["--model", str(model), "--moe-expert-pool-rows", "4"])


def test_no_pool_needs_no_rows_and_allows_paged_experts(tmp_path: Path) -> None:
    model = write_model(tmp_path, {"num_hidden_layers": 4})
    p = plan(["--model", str(model), "--no-moe-expert-pool", "--enable-paged-experts"])
    assert p.serve.pool is None and "--enable-paged-experts" in p.sglang_argv


def test_unknown_flags_are_left_to_sglang(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    # No abbreviation matching: an SGLang flag sharing a prefix with ours is not swallowed.
    p = plan(
        [
            "--model",
            str(model),
            "--moe-expert-pool-rows",
            "8",
            "--moe-runner-backend",
            "triton",
            "--moe-a2a-backend",
            "none",
        ]
    )
    assert "--moe-runner-backend" in p.sglang_argv and "--moe-a2a-backend" in p.sglang_argv
    # the launcher reads --moe-runner-backend (it adds triton on CUDA unless set): an abbreviation is refused
    with pytest.raises(ValueError, match="--moe-runner abbreviates --moe-runner-backend"):
        plan(["--model", str(model), "--moe-expert-pool-rows", "8", "--moe-runner", "triton"])


def test_serve_config_round_trips_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = ServeConfig(
        pool=PoolConfig.resolve(pool_rows=5, device="cpu", telemetry=True), cpu=True, metrics=True
    )
    monkeypatch.delenv("POOLED_RUNNER_SERVE_CONFIG", raising=False)
    assert ServeConfig.from_env() is None
    serve.export()
    assert ServeConfig.from_env() == serve
    assert ServeConfig.from_json(ServeConfig(pool=None, cpu=False).to_json()).pool is None


def test_core_and_launch_plan_import_without_sglang(tmp_path: Path) -> None:
    """The core (and the launcher's planning) must import where SGLang is not installed (the GPU image)."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "sglang" or name.startswith("sglang."):
                    raise ImportError("sglang blocked for this test")
        sys.meta_path.insert(0, Block())
        import pooled_runner, pooled_runner.launch, pooled_runner.sglang.model_facts
        import pooled_runner.sglang.serve_config, pooled_runner.sglang.runtime
        assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules), "sglang was imported"
        try:
            import pooled_runner.sglang.layer
        except ImportError as exc:
            assert "blocked" in str(exc)
        else:
            raise AssertionError("the block did not work")
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_speculative_flag_reaches_the_children(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    p = plan(["--model-path", str(model), "--moe-expert-pool-rows", "8", "--speculative-algorithm", "NEXTN"])
    assert p.serve.speculative and p.facts is not None and p.facts.top_k == 3
    assert ServeConfig.from_json(p.serve.to_json()) == p.serve
    assert not plan(["--model-path", str(model), "--moe-expert-pool-rows", "8"]).serve.speculative


def test_cost_aware_speculation_needs_sglangs_adaptive_speculation(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_MOE)
    base = [
        "--model-path",
        str(model),
        "--moe-expert-pool-rows",
        "8",
        "--moe-expert-pool-spec-governor",
        "cost",
    ]
    with pytest.raises(ValueError, match="add --speculative-algorithm"):
        plan(base)
    with pytest.raises(ValueError, match="decides SGLang's adaptive speculation: add --speculative-adaptive"):
        plan([*base, "--speculative-algorithm", "EAGLE"])
    p = plan([*base, "--speculative-algorithm", "EAGLE", "--speculative-adaptive"])
    assert p.serve.pool is not None and p.serve.pool.spec_governor == "cost"
    assert (
        ServeConfig.from_json(p.serve.to_json()) == p.serve
    )  # reaches the scheduler, which applies the patch
    assert plan(["--model-path", str(model), "--moe-expert-pool-rows", "8"]).serve.pool.spec_governor == "off"
    with pytest.raises(ValueError, match="runs with --tp-size 1 only \\(got 2\\)"):
        plan([*base, "--speculative-algorithm", "EAGLE", "--speculative-adaptive", "--tp-size", "2"])
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        plan([*base[:-1], "fast"])
    with pytest.raises(ValueError, match=r"spec_governor='fast' is not one of \['off', 'cost'\]"):
        PoolConfig(pool_rows=4, device="cpu", spec_governor="fast")


def test_router_facts_say_when_logits_are_not_the_selection_scores() -> None:
    assert facts_from_config(QWEN3_MOE).router_logits_differ == ""
    assert facts_from_config({**QWEN3_MOE, "scoring_func": "softmax"}).router_logits_differ == ""
    deepseek_v2 = {**QWEN3_MOE, "model_type": "deepseek_v2", "topk_method": "greedy"}
    assert facts_from_config(deepseek_v2).router_logits_differ == ""
    grouped = {
        **deepseek_v2,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
    }
    why = facts_from_config(grouped).router_logits_differ
    assert "scoring_func sigmoid" in why and "noaux_tc" in why and "4 of 8 groups" in why
    assert facts_from_config({**QWEN3_MOE, "n_group": 1, "topk_group": 1}).router_logits_differ == ""
    # GLM-4.5 adds a correction bias that its config.json does not name: not on the allowlist
    glm = {**QWEN3_MOE, "model_type": "glm4_moe", "n_group": 1, "topk_group": 1}
    assert "model_type 'glm4_moe' is not one known" in facts_from_config(glm).router_logits_differ
    assert "model_type None" in facts_from_config({"num_hidden_layers": 2}).router_logits_differ


def test_router_scores_reach_the_children_only_for_a_policy_that_reads_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    qwen = write_model(tmp_path, QWEN3_MOE)
    base = ["--model-path", str(qwen), "--moe-expert-pool-rows", "8"]
    assert not plan(base).serve.router_scores  # the default policy (lru-cycle) reads none
    assert not plan([*base, "--moe-expert-pool-planner-policy", "adaptive"]).serve.router_scores
    p = plan([*base, "--moe-expert-pool-planner-policy", "adaptive-router"])
    assert p.serve.router_scores and p.serve.pool is not None
    assert p.serve.pool.planner_policy == "adaptive-router"
    duel = plan([*base, "--moe-expert-pool-planner-policy", "adaptive-router-duel"])
    assert duel.serve.router_scores and duel.serve.pool is not None
    assert duel.serve.pool.planner_policy == "adaptive-router-duel"
    assert ServeConfig.from_json(p.serve.to_json()) == p.serve
    (tmp_path / "ds").mkdir()
    sigmoid = write_model(
        tmp_path / "ds", {**QWEN3_MOE, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    )
    with caplog.at_level("WARNING", logger="pooled_runner"):
        p = plan(["--model-path", str(sigmoid), "--moe-expert-pool-rows", "8",
                  "--moe-expert-pool-planner-policy", "adaptive-router"])  # fmt: skip
    assert not p.serve.router_scores
    assert "scoring_func sigmoid" in caplog.text and "hit counts alone" in caplog.text
    with pytest.raises(SystemExit):  # argparse's choices name the valid policies
        plan([*base, "--moe-expert-pool-planner-policy", "mru"])
    with pytest.raises(ValueError, match="planner_policy='mru' is not one of"):
        PoolConfig.resolve(pool_rows=4, planner_policy="mru")
