"""Ours against stock SGLang 0.5.23's Triton fused MoE, both timed in this run on this card (GPU; issue #4).

Per shape (the DeepSeek-like and Qwen3-like layers of `bench/kernels.py`, and DESIGN.md §4's Mixtral-like) and
width M (decode, or a prefill step): one bf16 layer with every expert resident, the same routing for both; our
default `pooled_fused_moe` and stock's launch sequence on its own kernels (`bench/stock_sglang/`, its tuned
configs for this card and Triton version), each captured in a CUDA graph and timed in turn for several rounds
(`bench.common.time_graphs`). Reports µs, the share of the HBM read bound (distinct experts' bytes / HBM read
bandwidth, measured here), stock / ours (> 1: ours faster) and the largest difference between the two outputs
(relative to the output's largest magnitude): both compute the same MoE.

Stock's CUDA kernels are not on the image; `bench/stock_sglang/moe.py` says what stands in for each. Where stock
runs its CUDA align (M x top_k > 64, or Mixtral's 9 buckets), its output is computed once before capture and not
timed (column "align"). So stock is timed (a) with the stand-ins of its gated SiLU and, above 32 tokens, its
top-k sum ("stock": the ratio to read), and (b) with its own launches only ("stock's own"). (b) is not a bound:
leaving a launch out also changes which kernel is the PDL dependent of which (on an H100, 2026-12-06, the
Mixtral-like layer at M = 1-4 took 7-20% longer without the SiLU between its GEMMs). A tuned
config that asks for TMA (the H100's at M = 4096) is not reproduced (row says so). sm_90+ only (below, stock's
top-k sum is another path). Stock's kernels are compiled by this Triton, not the 3.8 that SGLang 0.5.23's torch
pin brings.

Usage: python -m bench.stock_compare [--out stock.md] [--shapes qwen3,deepseek] [--ms 1,2,4,8,16] [--seed 0]
       [--commit SHA]
"""

from __future__ import annotations

import argparse
import functools

import torch
from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
from pooled_runner.kernels.operands import kernel_format

from bench.common import time_graphs, write
from bench.kernels import SHAPES, measured_header, random_rows
from bench.stock_sglang.moe import stock_call
from pooled_runner.formats import make_format

# (H, I, E, top_k): bench/kernels.py's shapes and DESIGN.md §4's Mixtral-like layer
STOCK_SHAPES = {**SHAPES, "mixtral": (4096, 14336, 8, 2)}


def compare(shape: str, ms: list[int], hbm: float, g: torch.Generator) -> list[str]:
    """The table rows of one shape (module docstring)."""
    H, I, E, K = STOCK_SHAPES[shape]
    pool = random_rows("bf16", H, I, E, "cuda", g)
    fmt = kernel_format(make_format("bf16", torch.bfloat16))
    p13, p2 = make_projections(fmt, pool, None, H, I)
    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
    row_bytes = sum(t[0].numel() * t.element_size() for t in pool.values())
    rows = []
    for M in ms:
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
        ids32 = ids.int().contiguous()  # SGLang's top-k gives int32 ids, fp32 weights
        try:
            stock, configs, cuda_align = stock_call(x, pool["w13"], pool["w2"], w, ids32)
        except NotImplementedError as e:
            rows.append(f"| {shape} | {M} | | | | | | | | | not reproduced: {e} |")
            print(rows[-1], flush=True)
            continue
        ours = functools.partial(pooled_fused_moe, x, ids32, w, l2p, E, p13, p2, fmt)
        own = functools.partial(stock, skip_stand_ins=True)
        ms_ = time_graphs({"ours": ours, "stock": stock, "own": own}, rounds=5)
        out_ours, out_stock = ours().float(), stock().float()
        diff = (out_ours - out_stock).abs().max().item() / max(out_stock.abs().max().item(), 1e-30)
        bound_us = torch.unique(ids).numel() * row_bytes / (hbm * 1e9) * 1e6
        us_ours, us_stock, us_own = (ms_[k] * 1e3 for k in ("ours", "stock", "own"))
        tiles = "/".join(str(configs[0][k]) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
        rows.append(
            f"| {shape} | {M} | {us_ours:.1f} | {us_stock:.1f} | {100 * bound_us / us_ours:.0f}% | "
            f"{100 * bound_us / us_stock:.0f}% | **{us_stock / us_ours:.2f}x** | {us_own:.1f} | "
            f"{us_own / us_ours:.2f}x | {'CUDA: not timed' if cuda_align else 'Triton, timed'} | "
            f"{diff:.1e} (stock M/N/K {tiles}) |"
        )
        print(rows[-1], flush=True)
        del x, w, ids, ids32, ours, stock, own, out_ours, out_stock
        torch.cuda.empty_cache()
    del pool, p13, p2
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="qwen3,deepseek", help=f"comma list of {', '.join(STOCK_SHAPES)}")
    ap.add_argument("--ms", default="1,2,4,8,16", help="comma list of widths M (tokens)")
    ap.add_argument("--commit", default="", help="commit to print (default: git rev-parse HEAD)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and routing")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in STOCK_SHAPES]
    if unknown or not shapes:
        raise SystemExit(f"--shapes {args.shapes!r}: unknown {unknown}; choose from {list(STOCK_SHAPES)}")
    ms = [int(m) for m in args.ms.split(",") if m]
    if torch.cuda.get_device_capability()[0] < 9:  # before any pool is built
        raise SystemExit(
            "stock's decode sequence is reproduced for sm_90+ only (its top-k sum differs below)"
        )
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    hbm, _, lines = measured_header(args.commit)
    lines += [
        f"ours vs stock SGLang 0.5.23 fused MoE, bf16, resident, graph replay, both in this run (seed {args.seed}):",
        "",
        "| shape | M | ours µs | stock µs | ours % of HBM bound | stock % of HBM bound | stock / ours | "
        "stock's own µs | stock's own / ours | stock's align | max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for shape in shapes:
        lines += compare(shape, ms, hbm, g)
        write(args.out, lines)
    lines += [
        "",
        "stock: SGLang 0.5.23's own Triton kernels and tuned configs (bench/stock_sglang/), compiled by this run's "
        "Triton; its CUDA gated SiLU as a Triton kernel of the same grid, bytes and PDL hooks, its CUDA top-k sum "
        "(above 32 tokens) as its own Triton one; its CUDA align (M x top_k > 64, or <= 64 buckets) made before "
        "capture, not timed. 'stock's own': stock's own launches only, without those stand-ins (not a bound: it "
        "changes the launches' PDL chain).",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()
