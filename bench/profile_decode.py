"""One decode layer run eagerly a few times, for a profiler (GPU): `ncu ... python -m bench.profile_decode`.

Builds one pooled layer of a bench shape and format (random rows, all resident), routes M tokens by softmax
top-k of random logits, and calls `pooled_fused_moe` with the chosen decode variant `--warmup + --iters` times,
so that `ncu --launch-skip` can take the steady-state launches. Prints the variant's µs per call (CUDA events,
eager, so it includes launch gaps) for orientation only; bench/kernels.py is the benchmark.

Usage: python -m bench.profile_decode --shape deepseek --format int4-g128 --m 1 --variant inline
"""

from __future__ import annotations

import argparse

import torch
from pooled_runner.kernels.fused_moe import pooled_fused_moe

from bench.kernel_variants import resident_layer
from bench.kernels import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="deepseek")
    ap.add_argument("--format", default="int4-g128")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--variant", default=None, help="pooled_fused_moe variant (default: its default)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layer = resident_layer(args.shape, args.format, args.m, g)

    def step() -> torch.Tensor:
        return pooled_fused_moe(*layer.args, variant=args.variant)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / max(args.iters, 1)
    print(f"{args.shape} {args.format} M={args.m} variant={args.variant}: {us:.1f} µs per call (eager)")


if __name__ == "__main__":
    main()
