"""The inline decode path's tiles at one shape and M, one GEMM at a time (GPU): issue #4's bf16 target is 1.2x
stock SGLang at Qwen3-like M=1, and the earlier sweeps of this path (`bench/kernels.py`, `kernel_variants.py`)
tried few warps / stages / K-tile combinations.

gemm1's tile is swept with gemm2 at its default, then gemm2's with gemm1 at its default (their times add up,
nearly: the two launches are stream-ordered). The best of each sweep, and both together, are then timed against
the default in interleaved rounds (`common.time_graphs`), the numbers to read; the sweep's own single timings
only rank the tiles. Every expert resident, graph replay, fresh random weights and routing (seeded).

Usage: python -m bench.inline_sweep [--shape qwen3] [--format bf16] [--m 1] [--budget 240] [--out sweep.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import time

import torch
import triton
from pooled_runner.kernels.fused_moe import make_projections, pick_configs, pooled_fused_moe
from pooled_runner.kernels.moe_gemm import GemmConfig
from pooled_runner.kernels.operands import kernel_format

from bench.common import commit_id, read_bandwidth, time_graphs
from bench.common import write_progress as write
from bench.kernels import SHAPES, random_rows, stock_us, time_graph
from pooled_runner.formats import make_format

BLOCK_N = (16, 32, 64, 128)
BLOCK_K = (64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--format", default="bf16", help="weight format (bf16 only has unswapped inline tiles)")
    ap.add_argument("--m", type=int, default=1, help="tokens per step")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the two sweeps together")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.inline_sweep needs a CUDA GPU")
    H, I, E, K = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = random_rows(args.format, H, I, E, "cuda", g)
    fmt = kernel_format(make_format(args.format, torch.bfloat16))
    p13, p2 = make_projections(fmt, rows, None, H, I)
    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
    x = torch.randn(args.m, H, generator=g, device="cuda").bfloat16()
    w, ids = torch.softmax(torch.randn(args.m, E, generator=g, device="cuda"), -1).topk(K, -1)
    default = pick_configs(args.m, K, E, H, I, fmt.fmt)
    if default[0].swap_ab or default[1].swap_ab:
        raise SystemExit(
            f"{args.format}: its default tiles are swapped; this sweep covers unswapped tiles only"
        )
    hbm = read_bandwidth(next(iter(rows.values())))
    row_bytes = sum(t[0].numel() * t.element_size() for t in rows.values())
    distinct = int(ids.unique().numel())
    bound_us = distinct * row_bytes / (hbm * 1e9) * 1e6

    def run(cfgs: tuple[GemmConfig, GemmConfig]):  # type: ignore[no-untyped-def]
        return functools.partial(pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt, cfgs, variant="inline")

    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {args.commit or commit_id()}",
        f"{args.shape} {args.format} M={args.m}, inline path, resident; HBM read {hbm:.0f} GB/s; bound "
        f"{bound_us:.1f} µs ({distinct} experts x {row_bytes / 1e6:.2f} MB / HBM read)",
        f"default tiles: gemm1 {_cfg(default[0])}, gemm2 {_cfg(default[1])}",
    ]
    write(args.out, lines)
    t0 = time.perf_counter()
    best = []
    for which in (0, 1):
        ranked = _sweep(run, default, which, t0 + args.budget * (which + 1) / 2, lines, args.out)
        best.append(ranked[0][1] if ranked else default[which])
    fns = {
        "default": run(default),
        "best gemm1": run((best[0], default[1])),
        "best gemm2": run((default[0], best[1])),
        "both": run((best[0], best[1])),
    }
    t = time_graphs(fns, rounds=7)
    lines += [
        "",
        f"interleaved (7 rounds): gemm1 {_cfg(best[0])}, gemm2 {_cfg(best[1])}",
        "",
        "| tiles | µs | / default | % of bound | stock SGLang (DESIGN.md §4, H200 only) / this |",
        "|---|---|---|---|---|",
    ]
    for name, ms in t.items():
        us = ms * 1e3
        stock_time = (
            stock_us(args.shape, args.m, torch.cuda.get_device_name()) if args.format == "bf16" else None
        )
        stock = f"{stock_time / us:.3f}x" if stock_time else "-"
        lines.append(f"| {name} | {us:.2f} | {ms / t['default']:.3f} | {bound_us / us:.0%} | {stock} |")
    write(args.out, lines)


def _cfg(c: GemmConfig) -> str:
    return f"(BN {c.block_n}, BK {c.block_k}, warps {c.num_warps}, stages {c.num_stages})"


def _sweep(run, default, which: int, deadline: float, lines: list[str], out: str | None) -> list:  # type: ignore[no-untyped-def]
    """Time every tile of one GEMM (the other at its default) until `deadline`: [(µs, config)] fastest first."""
    lines += ["", f"gemm{which + 1} sweep (single timings, to rank):", "", "| BN | BK | warps | stages | µs |",
              "|---|---|---|---|---|"]  # fmt: skip
    ranked = []
    for bn, bk, warps, stages in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
        if time.perf_counter() > deadline:
            lines.append("| (budget reached) | | | | |")
            break
        cfg = GemmConfig(16, bn, bk, 1, warps, stages)
        cfgs = (cfg, default[1]) if which == 0 else (default[0], cfg)
        try:
            us = time_graph(run(cfgs), min_ms=10.0)
        except Exception as exc:  # a tile this GEMM cannot take (shared memory, shape): listed, skipped
            lines.append(f"| {bn} | {bk} | {warps} | {stages} | {type(exc).__name__} |")
            continue
        ranked.append((us, cfg))
        lines.append(f"| {bn} | {bk} | {warps} | {stages} | {us:.2f} |")
    write(out, lines)
    return sorted(ranked, key=lambda r: r[0])


if __name__ == "__main__":
    main()
