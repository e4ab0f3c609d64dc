"""Engine-test fixtures: the embedded model, one pooled server per pytest run, a transformers reference.

Every test here is marked `engine` and skips when SGLang is not installed. Servers run in float32 so greedy
tokens are comparable exactly (bf16 near-ties flip on random weights).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="engine tests need the serve extra (sglang==0.5.23)")

from pooled_runner import PoolConfig
from tests.engine.server import Server, launched

# Pool rows far below the embedded model's 4 x 16 = 64 experts, so the pool misses and evicts.
POOL_ROWS = 12
# Telemetry on: every stats boundary closes a route window and pins its hottest experts (tokens must not change).
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--enable-metrics",
    "--moe-expert-pool-stats-interval",
    "4",
    "--moe-expert-pool-telemetry",
]
PROMPTS = ["The capital of France is", "Hello, how can I help you? Please write", "def main():\n    print("]
NEW_TOKENS = 24


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # scripts/test.sh runs these (`-m engine`) in one process after the others: one server at a time
    for item in items:
        if "tests/engine/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    from pooled_runner.sglang.embedded import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="module")
def pooled_server(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The pooled server of test_server.py (embedded model, float32, metrics on); module-scoped so it is
    stopped before another module (the TP test) starts its own server."""
    log = tmp_path_factory.mktemp("pooled") / "server.log"
    args = ["--model-path", str(embedded_model), "--moe-expert-pool-rows", str(POOL_ROWS), *SERVER_ARGS]
    with launched(args, log) as server:
        yield server


@pytest.fixture(scope="session")
def tokenizer(embedded_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="session")
def transformers_ids(embedded_model: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from transformers' own Qwen3-MoE on the same checkpoint, float32.

    A plain argmax loop over full forwards (no EOS handling), like SGLang's `ignore_eos` greedy decoding.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = list(ids)
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            out.append(seq[len(ids) :])
    return out


@pytest.fixture(scope="session")
def unpooled_ids(
    embedded_model: Path, prompt_ids: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> list[list[int]]:
    """Greedy ids from an unpooled server (SGLang's own MoE, `--no-moe-expert-pool`), same checkpoint.

    The server is started and stopped inside this fixture, so it never runs next to the pooled one as long
    as a test asks for this fixture before `pooled_server` (the first test of test_server.py does).
    """
    from tests.engine.server import generate_ids

    log = tmp_path_factory.mktemp("unpooled") / "server.log"
    args = ["--model-path", str(embedded_model), "--no-moe-expert-pool", *SERVER_ARGS]
    with launched(args, log) as server:
        ids = [generate_ids(server.url, p, NEW_TOKENS) for p in prompt_ids]
        assert "MoE layers pooled" not in server.log()
    return ids


@pytest.fixture(scope="session")
def greedy_cache() -> dict[str, list[list[int]]]:
    """Greedy ids of PROMPTS recorded by one test for another (one server at a time)."""
    return {}


@pytest.fixture(scope="session")
def pooled_ids(
    embedded_model: Path,
    prompt_ids: list[list[int]],
    greedy_cache: dict[str, list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[list[int]]:
    """Greedy ids from the TP=1 pooled server: those test_server.py recorded, else from a server of its own."""
    from tests.engine.server import generate_ids

    if "pooled" not in greedy_cache:
        log = tmp_path_factory.mktemp("pooled_tp1") / "server.log"
        args = ["--model-path", str(embedded_model), "--moe-expert-pool-rows", str(POOL_ROWS), *SERVER_ARGS]
        with launched(args, log) as server:
            greedy_cache["pooled"] = [generate_ids(server.url, p, NEW_TOKENS) for p in prompt_ids]
    return greedy_cache["pooled"]


# The layer tests (test_layer*.py): SGLang's runtime context in this process, a pool runtime, the checkpoint.
@pytest.fixture(scope="session")
def sglang_context() -> None:
    """World-size-1 gloo groups and SGLang's runtime context in this process (as SGLang's own layer UTs do);
    once per process: the groups cannot be made twice."""
    from pooled_runner.patches import apply_cpu_patches

    apply_cpu_patches()
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)


@pytest.fixture
def runtime(sglang_context: None):  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    rt = PoolRuntime(ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu"), cpu=True))
    set_runtime(rt)
    yield rt
    set_runtime(None)


@pytest.fixture(scope="session")
def checkpoint(embedded_model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(embedded_model / "model.safetensors"))
