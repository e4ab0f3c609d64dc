"""Two H200s, two processes, NCCL: a model-shaped pooled stack where each rank holds its shard of every expert.

Qwen3-30B-like experts (H 2048, I 768 -> 384 per rank, top-8 of 64, 4 layers), bf16, 96 rows per rank (of
256 experts): one 512-token prefill step (prefill staging, per rank) then 40 decode steps of 4 tokens with
misses. Checks: every layer's all-reduced output against the unsharded experts (fp32 reference, same inputs),
equal location tables on both ranks (all-gathered hashes every 8 steps), a forced disagreement stops both
ranks, and the decode step time per rank is printed (pytest -s; bench/tp.py makes the table).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tests.tp_stack import StackSpec, launch

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_ranks_model_shaped_stack(tmp_path: Path) -> None:
    spec = StackSpec(
        num_layers=4,
        num_experts=64,
        hidden=2048,
        intermediate=768,
        top_k=8,
        pool_rows=96,
        dtype="bfloat16",
        steps=40,
        tokens=4,
        prefill_tokens=512,
        check_every=8,
        warmup_steps=4,
    )
    results = launch(spec, world=2, out_dir=tmp_path, port=_free_port())
    r0, r1 = results
    assert (r0["device"], r1["device"]) == ("cuda:0", "cuda:1")
    assert r0["intermediate_per_rank"] == r1["intermediate_per_rank"] == 384
    assert r0["row_bytes"] == 3 * 2048 * 384 * 2  # the shard: w13 [768, 2048] + w2 [2048, 384], bf16
    assert r0["bank_bytes"] == 4 * 64 * r0["row_bytes"]  # every expert's shard in each rank's bank
    assert r0["l2p"] == r1["l2p"]
    for key in ("hits", "misses", "admissions", "evictions"):
        assert r0[key] == r1[key], (key, r0[key], r1[key])
    assert r0["misses"] > 0 and r0["evictions"] > 0
    assert r0["num_checks"] == 41 // 8 + 1
    # bf16 shards, each rounded before the all-reduce: a few 1e-3 relative; a wrong shard would be O(1).
    assert r0["max_rel_err"] < 2e-2, (r0["max_rel_err"], r0["max_abs_err"])
    for r in results:
        assert "TP ranks disagree at step 42: location table of pooled layer 1" in str(r["disagreement"])
        print(
            f"rank {r['rank']}: decode step (4 tokens, 4 layers, forward + all-reduce) median "
            f"{r['step_ms_median']:.3f} ms over {len(r['step_ms'])} steps; hits {r['hits']}, misses {r['misses']}"
        )
