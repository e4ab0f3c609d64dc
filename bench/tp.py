"""Tensor-parallel benchmark (GPUs): decode step time per rank of a model-shaped pooled stack, TP=2 vs TP=1.

Each rank is one process (torch.multiprocessing, NCCL) running `tests/tp_stack.py`: L pooled layers of
Qwen3-30B-like experts (H 2048, I 768, top-8 of 128), each rank with its shard of every expert in its pinned
bank and `--rows-frac` x (its experts) rows. Per decode step of M tokens: the pooled forward of every layer
plus its all-reduce, synchronized and timed per layer (routing is replicated and left out); the median over
the steps after warm-up. The location tables are compared across ranks every 8 steps (they must agree).
Bound per step and rank = hit bytes / B_hbm + host-view bytes / B_zero-copy + bytes copied into rows / B_copy,
averaged over the run, with the bandwidths measured here (bench/common.py); the hit rate and the bound use
each rank's `PooledMoE.stats()` (the device planner's tables synced and its counters included: the pool's
own host counters see no device-planned step). Seeded.

Usage: python bench/tp.py [--layers 8] [--tokens 1 4 16] [--rows-frac 0.5] [--out results.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import socket
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tp_stack (the two-process stack shared with tests/test_tp_gpu.py)
sys.path.insert(0, str(ROOT / "bench"))

from bench.common import commit_id, measure_bandwidths  # noqa: E402
from tests.tp_stack import StackSpec, launch  # noqa: E402

GB = 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bound_ms(result: dict, bw: object) -> float:
    """Average per-step bound of one rank from its synced counters (tests/tp_stack.py's `moe.stats()`; all
    steps, warm-up included, checks excluded)."""
    steps = result["spec"]["steps"]
    hit_bytes = result["hits"] * result["row_bytes"]
    seconds = (
        hit_bytes / bw.hbm_read  # type: ignore[attr-defined]
        + result["bytes_read_host_view"] / bw.host_zero_copy  # type: ignore[attr-defined]
        + result["bytes_copied_to_rows"] / bw.host_to_device_copy  # type: ignore[attr-defined]
    )
    return seconds / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rows-frac", type=float, default=0.5, help="pool rows per rank / experts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default="", help="commit to print (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    bw = measure_bandwidths()
    total = args.layers * args.experts
    rows = max(args.top_k, int(total * args.rows_frac))
    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name(0)} x{args.world}, torch {torch.__version__}, "
        f"commit {commit_id(args.commit)}",
        f"measured: {bw.describe()}",
        f"stack: {args.layers} layers x {args.experts} experts, H {args.hidden}, I {args.intermediate}, "
        f"top-{args.top_k}, bf16, {rows} rows per rank ({args.rows_frac:.0%} of the experts), {args.steps} steps",
        "",
        "| M | TP | rank | I/rank | step ms (median) | hit rate | bound ms | % of bound | speedup vs TP=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.tokens:
        base = StackSpec(
            num_layers=args.layers,
            num_experts=args.experts,
            hidden=args.hidden,
            intermediate=args.intermediate,
            top_k=args.top_k,
            pool_rows=rows,
            dtype="bfloat16",
            steps=args.steps,
            tokens=m,
            check_every=8,
            warmup_steps=4,
            reference=False,
            generate_on_device=True,
        )
        tp1_ms = None
        for world in (1, args.world):
            with tempfile.TemporaryDirectory() as tmp:
                results = launch(dataclasses.replace(base), world, Path(tmp), free_port())
            for r in results:
                assert r["l2p"] == results[0]["l2p"], "ranks disagree"
                ms = r["step_ms_median"]
                if world == 1:
                    tp1_ms = ms
                hits, misses = r["hits"], r["misses"]
                assert hits + misses > 0, (
                    f"rank {r['rank']}: no planned expert counted (counters not synced?)"
                )
                b = bound_ms(r, bw)
                vs = f"{tp1_ms / ms:.2f}x" if tp1_ms and world > 1 else ""
                lines.append(
                    f"| {m} | {world} | {r['rank']} | {r['intermediate_per_rank']} | {ms:.3f} | "
                    f"{hits / max(1, hits + misses):.3f} | {b:.3f} | {100 * b / ms:.0f}% | {vs} |"
                )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
