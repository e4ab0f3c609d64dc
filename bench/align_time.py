"""The align kernel alone (GPU): `align_blocks` at decode-to-prefill widths of the Qwen3-like and DeepSeek-like
routing (top-8), graph replay (`bench.common.time_graphs`), each output checked against `align_blocks_ref`
first; the default path of each width (`align.default_path`) and, with `--paths`, each path forced where it
reaches (`align.PATHS`), timed interleaved. Stock SGLang's CUDA align, which `bench.stock_compare` does not time,
is of this kind: these rows say how much of a stock comparison's gap is the align.

Usage: python -m bench.align_time [--ms 8,16,64,128,512] [--shapes qwen3,deepseek] [--paths tiny,sort,wide]
    [--out align.md]
"""

from __future__ import annotations

import argparse
import functools

import torch
from pooled_runner.kernels.align import (
    PATHS,
    TINY_FORCED_MAX_PAIRS,
    align_blocks,
    align_blocks_ref,
    default_path,
)
from pooled_runner.kernels.align_sort import SORT_COMPILED_MAX_PAIRS
from pooled_runner.kernels.fused_moe import pick_configs

from bench.common import time_graphs, write
from bench.kernels import SHAPES, measured_header

FIELDS = ("sorted_pairs", "block_experts", "block_codes", "block_order", "num_post_padded")


LIMITS = {"tiny": TINY_FORCED_MAX_PAIRS, "sort": SORT_COMPILED_MAX_PAIRS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="8,16,64,128,512")
    ap.add_argument("--shapes", default="qwen3,deepseek")
    ap.add_argument(
        "--paths", default="", help=f"comma list of {', '.join(PATHS)}, each forced where it reaches"
    )
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = [p for p in args.paths.split(",") if p and p not in PATHS]
    if unknown:
        ap.error(f"--paths {args.paths!r}: unknown {unknown}; choose from {list(PATHS)}")
    _, _, lines = measured_header(args.commit)
    lines += ["", "| shape | M | pairs | block_m | path | align µs |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape in args.shapes.split(","):
        H, I, E, K = SHAPES[shape]
        l2p = torch.arange(E, dtype=torch.int32, device="cuda")
        for M in (int(m) for m in args.ms.split(",")):
            g = torch.Generator(device="cuda").manual_seed(M)
            _w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
            ids = ids.int().contiguous()
            block_m = pick_configs(M, K, E, H, I)[0].block_m
            paths = {f"default ({default_path(M * K)})": None}
            paths |= {p: p for p in args.paths.split(",") if p and M * K <= LIMITS.get(p, M * K)}
            want = align_blocks_ref(ids.cpu(), l2p.cpu(), E, E, block_m)
            for name, path in paths.items():
                got = align_blocks(ids, l2p, E, E, block_m, path=path)
                wrong = [f for f in FIELDS if not torch.equal(getattr(got, f).cpu(), getattr(want, f))]
                if wrong:
                    raise SystemExit(f"{shape} M={M} {name}: align differs from its reference in {wrong}")
            fns = {
                n: functools.partial(align_blocks, ids, l2p, E, E, block_m, path=p) for n, p in paths.items()
            }
            ms = time_graphs(fns, rounds=3)
            for name, t in ms.items():
                lines.append(f"| {shape} | {M} | {M * K} | {block_m} | {name} | {t * 1e3:.2f} |")
                print(lines[-1], flush=True)
            write(args.out, lines)


if __name__ == "__main__":
    main()
