"""Prefill benchmark (GPU): a model-shaped stack of pooled MoE layers, one prefill step, four ways.

Modes per (shape, format, pool fraction, step tokens):
  resident   every expert in VRAM (the compute floor of the step)
  host_view  non-resident experts read in place from the pinned bank by the kernel (once per M-block)
  stage_sync prefill staging, each layer copied on the compute stream when needed (no prefetch)
  stage      prefill staging with next-layer prefetch on a side stream (the default)
Bound = max(resident time, non-resident bytes / measured H2D copy bandwidth), both measured in this run.
Pool rows are spread evenly over the layers (expert-major fill), routing is softmax top-k of random logits,
the step is timed with CUDA events around all layers (the host-side plan included), median of a few runs.

Usage: python -m bench.prefill [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

from bench.common import commit_id, copy_bandwidth, print_table, read_bandwidth, write
from bench.kernels import random_rows
from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.staging import LayerStager

SHAPES = {  # name: (H, I, E, top_k, layers); DeepSeek-like dims with fewer experts to keep the bank small
    "qwen3": (2048, 768, 128, 8, 8),
    "deepseek": (7168, 2048, 64, 8, 3),
}


def build(shape: str, fmt: str, rows_frac: float, mode: str, g: torch.Generator) -> PooledMoE:
    H, I, E, K, L = SHAPES[shape]
    total = E * L
    rows = total if mode == "resident" else max(K, int(rows_frac * total))
    staging = mode in ("stage", "stage_sync")
    cfg = PoolConfig(
        pool_rows=rows, weight_format=fmt, device="cuda", prefill_staging=staging, staging_min_tokens=256
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    moe.allocate()
    assert moe._storage is not None
    for layer in range(L):  # random rows made on the GPU, copied into the bank (or rows) layer by layer
        layer_rows = random_rows(fmt, H, I, E, "cuda", g)
        for name, t in layer_rows.items():
            moe._storage[name][layer * E : (layer + 1) * E].copy_(t)
    moe.finalize(priority=[(layer, e) for e in range(E) for layer in range(L)])
    if mode == "stage_sync":
        assert moe.stager is not None and moe.bank is not None and moe.pool is not None
        moe.stager = LayerStager(
            moe.operands, moe.bank, moe.pool.num_rows, torch.device("cuda"), 256, prefetch=False
        )
    return moe


def step_ms(moe: PooledMoE, T: int, g: torch.Generator, repeats: int = 3) -> float:
    H, K, L = moe.hidden_size, moe.top_k, len(moe.num_experts_per_layer)
    E = moe.num_experts_per_layer[0]
    xs = [torch.randn(T, H, generator=g, device="cuda").bfloat16() for _ in range(L)]
    routes = []
    for _ in range(L):
        logits = torch.randn(T, E, generator=g, device="cuda")
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        routes.append((ids, w))

    def run() -> None:
        for layer in range(L):
            moe.forward(layer, xs[layer], routes[layer][0], routes[layer][1], admit_misses=False)

    run()  # compile and warm up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def nonresident_bytes(moe: PooledMoE) -> int:
    assert moe.pool is not None
    host = int((moe.pool.l2p_host >= moe.pool.num_rows).sum())
    return host * moe.pool.row_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    hbm = read_bandwidth(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    header = (
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, commit {commit_id(args.commit)}"
    )
    print(header)
    print(f"measured: H2D copy {copy_bw:.1f} GB/s, HBM read {hbm:.0f} GB/s")
    tokens = [512, 4096, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    cases = (
        [("qwen3", "bf16"), ("deepseek", "bf16")]
        if args.quick
        else [("qwen3", "bf16"), ("qwen3", "int4-g128"), ("deepseek", "bf16"), ("deepseek", "int4-g128")]
    )
    rows_out = []
    modes = ("resident", "host_view", "stage_sync", "stage")
    for shape, fmt in cases:
        for frac in (0.25, 0.5):
            t: dict[str, dict[int, float]] = {}
            miss_gb = 0.0
            try:
                for mode in modes:  # one system at a time: each holds its own bank
                    moe = build(shape, fmt, frac, mode, g)
                    if mode == "stage":
                        miss_gb = nonresident_bytes(moe) / 1e9
                    t[mode] = {T: step_ms(moe, T, g) for T in tokens}
                    del moe
                    torch.cuda.empty_cache()
            except Exception as exc:  # report and keep going
                rows_out.append([shape, fmt, f"{frac:.0%}", "-", f"error: {type(exc).__name__}: {exc}"[:120]])
                continue
            for T in tokens:
                r = {m: t[m][T] for m in modes}
                bound = max(r["resident"], miss_gb / copy_bw * 1e3)
                rows_out.append(
                    [
                        shape,
                        fmt,
                        f"{frac:.0%}",
                        T,
                        f"{miss_gb:.2f}",
                        f"{r['resident']:.1f}",
                        f"{r['host_view']:.1f}",
                        f"{r['stage_sync']:.1f}",
                        f"{r['stage']:.1f}",
                        f"{r['host_view'] / r['stage']:.2f}x",
                        f"{r['stage'] / bound:.2f}x",
                        f"{r['stage_sync'] / r['stage']:.2f}x",
                    ]
                )
    table = print_table(
        "Prefill step, whole stack (ms)",
        [
            "shape",
            "format",
            "pool",
            "tokens",
            "non-res GB",
            "resident",
            "host view",
            "stage sync",
            "stage",
            "stage vs host",
            "stage / bound",
            "prefetch gain",
        ],
        rows_out,
    )
    write(args.out, [header, f"measured: H2D copy {copy_bw:.1f} GB/s, HBM read {hbm:.0f} GB/s", "", table])


if __name__ == "__main__":
    main()
