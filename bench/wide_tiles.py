"""Our tiles for steps where stock SGLang was faster on the same card (GPU): one resident bf16 layer per shape and
width M, the same routing for stock (`bench.stock_sglang`, its CUDA align made before capture) and for ours at
its default and at each candidate (the align path with explicit tiles up to 32 tokens, the wide path's tiles
above), timed interleaved (`bench.common.time_graphs`). Prints µs and stock / each.

Usage: python -m bench.wide_tiles [--cases qwen3:16,64,128,512;mixtral:4,8] [--seed 0] [--out wide.md]
"""

from __future__ import annotations

import argparse
import functools

import torch
from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
from pooled_runner.kernels.moe_gemm import GemmConfig
from pooled_runner.kernels.operands import kernel_format

from bench.common import time_graphs, write
from bench.kernels import measured_header, random_rows
from bench.stock_compare import STOCK_SHAPES
from bench.stock_sglang.moe import stock_call
from pooled_runner.formats import make_format

# (block_m, BN1, BN2, BK, group_m, warps, stages), both GEMMs
TILES = [
    (16, 32, 32, 64, 1, 4, 3),
    (16, 32, 64, 128, 1, 4, 3),
    (16, 64, 64, 128, 1, 4, 3),
    (16, 64, 128, 128, 1, 4, 4),
    (16, 128, 128, 128, 1, 8, 4),
    (16, 64, 256, 128, 1, 8, 3),
    (32, 64, 128, 128, 1, 4, 3),
    (32, 64, 128, 64, 8, 4, 3),
    (64, 64, 128, 64, 8, 4, 3),
]


def _configs(t: tuple[int, ...]) -> tuple[GemmConfig, GemmConfig]:
    bm, bn1, bn2, bk, gm, w, s = t
    return GemmConfig(bm, bn1, bk, gm, w, s), GemmConfig(bm, bn2, bk, gm, w, s)


def run_case(shape: str, M: int, g: torch.Generator, layer: tuple) -> list[str]:  # type: ignore[type-arg]
    H, _, E, K = STOCK_SHAPES[shape]
    pool, p13, p2, fmt, l2p = layer
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
    ids32 = ids.int().contiguous()
    ours = functools.partial(pooled_fused_moe, x, ids32, w, l2p, E, p13, p2, fmt)
    fns = {
        "stock": stock_call(x, pool["w13"], pool["w2"], w, ids32)[0],
        "default": ours,
    }
    if M <= 32:
        for v in ("align", "align-fc", "inline", "mma"):
            fns[v] = functools.partial(ours, variant=v)
    for t in TILES:
        tiles = "/".join(map(str, t))
        if M > 32:
            fns[tiles] = functools.partial(ours, configs=_configs(t))
        elif t[0] == 16:  # decode widths: the align path and, up to its pairs, the inline one
            for v in ("align", "inline") if M * K <= 32 else ("align",):
                fns[f"{v} {tiles}"] = functools.partial(ours, configs=_configs(t), variant=v)
    want = fns["default"]().float()
    ms = time_graphs(fns, rounds=5)
    lines = []
    for name, t_ms in ms.items():
        diff = (fns[name]().float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        lines.append(f"| {shape} | {M} | {name} | {t_ms * 1e3:.1f} | {ms['stock'] / t_ms:.3f} | {diff:.1e} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="qwen3:16,64,128,512;mixtral:4,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    _, _, lines = measured_header(args.commit)
    lines += [
        "",
        "| shape | M | kernels (tiles: block_m/BN1/BN2/BK/group/warps/stages) | µs | stock / it | max diff vs default |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    fmt = kernel_format(make_format("bf16", torch.bfloat16))
    for case in args.cases.split(";"):
        shape, ms = case.split(":")
        H, I, E, _K = STOCK_SHAPES[shape]
        pool = random_rows("bf16", H, I, E, "cuda", g)
        p13, p2 = make_projections(fmt, pool, None, H, I)
        l2p = torch.arange(E, dtype=torch.int32, device="cuda")
        for M in (int(m) for m in ms.split(",")):
            rows = run_case(shape, M, g, (pool, p13, p2, fmt, l2p))
            print("\n".join(rows), flush=True)
            lines += rows
            write(args.out, lines)
        del pool, p13, p2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
