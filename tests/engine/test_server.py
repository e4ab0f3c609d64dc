"""The pooled server end to end: SGLang/OpenAI endpoints, equality with transformers, misses, bad requests."""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import requests

from tests.engine.conftest import NEW_TOKENS, POOL_ROWS
from tests.engine.server import Server, generate_ids

openai = pytest.importorskip("openai")


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(server: Server) -> str:
    return client(server).models.list().data[0].id


def test_greedy_tokens_equal_unpooled_server(
    unpooled_ids: list[list[int]],
    pooled_server: Server,
    prompt_ids: list[list[int]],
    greedy_cache: dict[str, list[list[int]]],
) -> None:
    # First test of the file: `unpooled_ids` runs (and stops) its server before the pooled one starts.
    got_all = []
    for ids, expected in zip(prompt_ids, unpooled_ids):
        got = generate_ids(pooled_server.url, ids, NEW_TOKENS)
        assert got == expected, f"prompt {ids}: pooled server {got} != unpooled server {expected}"
        got_all.append(got)
    greedy_cache["pooled"] = got_all  # the TP test compares with these (fixture `pooled_ids`)


def test_greedy_tokens_equal_transformers(
    pooled_server: Server, prompt_ids: list[list[int]], transformers_ids: list[list[int]]
) -> None:
    for ids, expected in zip(prompt_ids, transformers_ids):
        got = generate_ids(pooled_server.url, ids, NEW_TOKENS)
        assert got == expected, f"prompt {ids}: pooled server {got} != transformers {expected}"


def test_models_endpoint(pooled_server: Server, embedded_model) -> None:  # type: ignore[no-untyped-def]
    models = client(pooled_server).models.list().data
    assert [m.id for m in models] == [str(embedded_model)]


def test_chat_completion_plain_and_streamed(pooled_server: Server) -> None:
    c = client(pooled_server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(
        model=model_id(pooled_server),
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    text = plain.choices[0].message.content
    assert isinstance(text, str) and text
    assert plain.usage is not None and plain.usage.completion_tokens <= 12
    stream = c.chat.completions.create(
        model=model_id(pooled_server),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == text  # greedy: the stream carries the same text


def test_completion(pooled_server: Server) -> None:
    out = client(pooled_server).completions.create(
        model=model_id(pooled_server), prompt="Once upon a time", max_tokens=10, temperature=0
    )
    assert out.choices[0].text
    usage, finish = out.usage, out.choices[0].finish_reason
    assert finish == "stop" or (usage is not None and usage.completion_tokens == 10), (finish, usage)


def test_native_generate_text(pooled_server: Server) -> None:
    body = {"text": "Hello world!", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = requests.post(pooled_server.url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    data = r.json()
    assert isinstance(data["text"], str)
    assert data["meta_info"]["completion_tokens"] <= 8


def test_concurrent_requests_match_sequential(pooled_server: Server, prompt_ids: list[list[int]]) -> None:
    """Batched steps (several requests in one forward) give each request its sequential greedy tokens."""
    jobs = [ids for ids in prompt_ids for _ in range(3)]
    sequential = [generate_ids(pooled_server.url, ids, 16) for ids in prompt_ids]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda ids: generate_ids(pooled_server.url, ids, 16), jobs))
    for i, got in enumerate(results):
        assert got == sequential[i // 3], f"job {i}: concurrent {got} != sequential {sequential[i // 3]}"


def test_pool_misses_really_happen(pooled_server: Server, prompt_ids: list[list[int]]) -> None:
    generate_ids(pooled_server.url, prompt_ids[0], 16)  # at least 16 steps: several stats boundaries
    metrics = requests.get(pooled_server.url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        m = re.search(rf"^pooled_runner_pool_{name} ([0-9.e+-]+)$", metrics, re.M)
        assert m, f"metric pooled_runner_pool_{name} missing from /metrics"
        return float(m.group(1))

    assert value("misses") > 0 and value("evictions") > 0 and value("admissions") > 0
    assert 0.0 <= value("hit_rate") < 1.0
    assert value("host_bytes_per_token") > 0
    rows = [
        float(v)
        for v in re.findall(r'^pooled_runner_pool_rows_in_use\{layer="[^"]+"\} ([0-9.]+)$', metrics, re.M)
    ]
    assert len(rows) == 4 and sum(rows) == POOL_ROWS, rows
    log = pooled_server.log()
    assert "4 MoE layers pooled (64 experts, bf16), 0 not pooled" in log
    assert f"pool {POOL_ROWS} rows" in log and "pageable (not pinned)" in log
    assert re.search(r"route telemetry window closed: hottest experts pinned, \d+ rows copied", log), (
        "no residency plan was applied at a stats boundary"
    )


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"messages": []}, 400),
        ({"max_tokens": -1}, 400),
        # SGLang 0.5.23 serves every model name with its one model (no 404): the test pins that behaviour.
        ({"model": "no-such-model"}, 200),
    ],
)
def test_bad_requests_get_sglang_errors_and_server_keeps_serving(
    pooled_server: Server, kwargs: dict, status: int
) -> None:
    body = {
        "model": model_id(pooled_server),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **kwargs,
    }
    r = requests.post(pooled_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, (r.status_code, r.text)
    if status != 200:
        assert "message" in r.text or "detail" in r.text, r.text
    ok = client(pooled_server).chat.completions.create(
        model=model_id(pooled_server),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,  # type: ignore[list-item]
    )
    assert ok.choices[0].message.content is not None
