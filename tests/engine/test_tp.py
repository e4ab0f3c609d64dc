"""TP=2 on the CPU through our launcher: the embedded model, float32, each rank with its own bank and pool.

Greedy tokens must equal the TP=1 pooled server, the unpooled server and transformers; with
`POOLED_RUNNER_DEBUG_CHECKS=1` the ranks compare hashes of their location tables at every stats boundary
(every 4 steps here) and the log must show many such checks, all agreeing, after steps with misses.

Note: on the CPU SGLang pads the expert intermediate size to a multiple of tp * 32 (32 -> 64 for this model),
so rank 0 holds the 32 real rows of every expert and rank 1 zero padding; the real two-way split of the
pooled stack is covered by tests/test_tp.py (two gloo ranks) and tests/test_tp_gpu.py.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engine.conftest import NEW_TOKENS, POOL_ROWS
from tests.engine.server import generate_ids, launched

TP_ARGS = ["--tp-size", "2", "--dtype", "float32", "--moe-expert-pool-stats-interval", "4"]
CHECK_LINE = re.compile(
    r"TP rank (\d)/2: debug check (\d+): location tables agree across 2 TP ranks at step (\d+) "
    r"\(digest (0x[0-9a-f]+)\)"
)
STATS_LINE = re.compile(
    r"TP rank (\d)/2: expert pool after (\d+) steps: hit rate [0-9.]+ \((\d+) hits, (\d+) misses\), "
    r"(\d+) admissions, (\d+) evictions"
)


@dataclass
class TPRun:
    sequential: list[list[int]]
    concurrent: list[list[int]]
    log: str


@pytest.fixture(scope="module")
def tp_run(
    embedded_model: Path,
    prompt_ids: list[list[int]],
    unpooled_ids: list[list[int]],
    pooled_ids: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TPRun]:
    """One TP=2 pooled server (debug checks on), after the reference servers have stopped; stopped here."""
    del unpooled_ids, pooled_ids  # requested first so their servers never run next to this one
    log_path = tmp_path_factory.mktemp("tp2") / "server.log"
    args = ["--model-path", str(embedded_model), "--moe-expert-pool-rows", str(POOL_ROWS), *TP_ARGS]
    with launched(args, log_path, extra_env={"POOLED_RUNNER_DEBUG_CHECKS": "1"}) as server:
        sequential = [generate_ids(server.url, ids, NEW_TOKENS) for ids in prompt_ids]
        jobs = [ids for ids in prompt_ids for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            batched = list(pool.map(lambda ids: generate_ids(server.url, ids, NEW_TOKENS), jobs))
        assert server.process.poll() is None, "the TP=2 server stopped while serving"
    yield TPRun(sequential, batched, log_path.read_text(errors="replace"))


def test_tp2_greedy_tokens_equal_tp1_pooled_unpooled_and_transformers(
    tp_run: TPRun,
    prompt_ids: list[list[int]],
    pooled_ids: list[list[int]],
    unpooled_ids: list[list[int]],
    transformers_ids: list[list[int]],
) -> None:
    for i, got in enumerate(tp_run.sequential):
        assert got == pooled_ids[i], f"prompt {prompt_ids[i]}: TP=2 {got} != TP=1 pooled {pooled_ids[i]}"
        assert got == unpooled_ids[i], f"prompt {prompt_ids[i]}: TP=2 {got} != unpooled {unpooled_ids[i]}"
        assert got == transformers_ids[i], f"prompt {prompt_ids[i]}: TP=2 {got} != transformers"
    for j, got in enumerate(tp_run.concurrent):  # batched steps: each request still gets its tokens
        assert got == pooled_ids[j // 3], f"concurrent job {j}: {got} != {pooled_ids[j // 3]}"


def test_tp2_tables_agree_across_ranks_after_many_steps_with_misses(tp_run: TPRun) -> None:
    assert "TablesDisagree" not in tp_run.log and "TP ranks disagree" not in tp_run.log
    checks: dict[int, dict[int, str]] = {}  # step -> rank -> digest
    for rank, _n, step, digest in CHECK_LINE.findall(tp_run.log):
        checks.setdefault(int(step), {})[int(rank)] = digest
    assert len(checks) >= 10, f"only {len(checks)} debug checks ran:\n{tp_run.log[-3000:]}"
    for step, by_rank in checks.items():
        assert set(by_rank) == {0, 1}, f"step {step}: checks logged by ranks {sorted(by_rank)}"
        assert by_rank[0] == by_rank[1], f"step {step}: digests {by_rank}"
    assert len(set(d[0] for d in checks.values())) > 1  # the tables really changed between checks
    stats: dict[int, dict[int, tuple[int, ...]]] = {}
    for rank, step, *counts in STATS_LINE.findall(tp_run.log):
        stats.setdefault(int(step), {})[int(rank)] = tuple(int(c) for c in counts)
    last = max(stats)
    assert stats[last][0] == stats[last][1], f"step {last}: rank counters {stats[last]}"
    _hits, misses, admissions, evictions = stats[last][0]
    assert misses > 0 and admissions > 0 and evictions > 0, stats[last]


def test_tp2_startup_log_reports_each_rank(tp_run: TPRun) -> None:
    log = tp_run.log
    assert "SGLANG_CPU_OMP_THREADS_BIND=0|1" in log
    # SGLang pads I = 32 to 64 on the CPU for TP=2: 32 per rank, float32 rows of 3 x 64 x 32 x 4 B = 24 KiB.
    assert "expert memory per rank (TP=2, I/rank=32): 12 rows x 24.0 KiB" in log
    for rank in (0, 1):
        assert f"TP rank {rank}/2: 4 MoE layers pooled (64 experts, bf16), 0 not pooled" in log
        assert f"TP rank {rank}/2: holds its shard of every expert (intermediate 32 per rank, 64 over" in log
