"""The align path's decode tiles against each other, interleaved (GPU): one shape, dense weights (bf16/fp16: their
decode tiles are unswapped, as every tile here), every expert resident, fresh seeded weights and routing per M;
each tile's time, % of the HBM bound and largest difference from the first tile that runs, side by side, with
the default tiles (`fused_moe.pick_configs`) named per row. For the tile choice at decode widths the split and
inline paths leave to the align path (Qwen3-like bf16 M = 3-32, where stock SGLang is level with it at M=8).

Usage: python -m bench.align_tiles [--shape qwen3] [--format bf16] [--ms 4,8,16] [--variant align]
       [--rounds 5] [--out align_tiles.md]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from pooled_runner.kernels.fused_moe import pick_configs, pooled_fused_moe
from pooled_runner.kernels.moe_gemm import GemmConfig

from bench.common import time_graphs
from bench.common import write_progress as write
from bench.kernel_variants import resident_layer
from bench.kernels import SHAPES, measured_header

# (BN1, BN2, BK, warps, stages) with block_m 16 and group_m 1, both GEMMs; unswapped. The first is the dense
# default from 3 to 32 tokens on experts with I <= 1024 (pick_configs; BN1 32 at 1-2 tokens). Stock SGLang 0.5.23's tuned H100 tile for the Qwen3-like layer at M = 8
# and 16 (triton 3.7.1 file) is N 128, K 128, 8 warps, 5 stages for both GEMMs; its gemm1 N tile spans gate and
# up columns together, ours BN1 of each, so (64, 128, 128, 8, 5) reads what stock's does per program
TILES = [
    (64, 64, 128, 4, 3),
    (64, 64, 128, 4, 4),
    (64, 128, 128, 4, 4),
    (64, 128, 128, 8, 5),
    (64, 128, 128, 8, 4),
    (128, 128, 128, 4, 3),
    (64, 64, 256, 4, 3),
    (128, 64, 128, 8, 4),
]


def _label(t: tuple[int, ...]) -> str:
    return "/".join(map(str, t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--ms", default="4,8,16")
    # not "inline": above its 32 routed pairs it runs the align kernel anyway
    ap.add_argument("--variant", default="align", choices=("align", "align-fc"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.align_tiles needs a CUDA GPU")
    hbm, _, lines = measured_header(args.commit)
    g = torch.Generator(device="cuda").manual_seed(0)
    H, I, E, K = SHAPES[args.shape]
    lines += [
        f"{args.shape} {args.format}, variant {args.variant}, {args.rounds} interleaved rounds (graph replay); "
        "tiles BN1/BN2/BK/warps/stages (block_m 16); µs (% of the HBM bound), max |diff| / max |out| against the first tile that ran",
        "",
        "| M | default tiles | " + " | ".join(_label(t) for t in TILES) + " | fastest / first |",
        "|---|---|" + "---|" * len(TILES) + "---|",
    ]
    print("\n".join(lines[:-1]), flush=True)
    write(args.out, lines)
    for m in (int(v) for v in args.ms.split(",")):
        layer = resident_layer(args.shape, args.format, m, g)
        default = pick_configs(m, K, E, H, I, layer.args[-1].fmt)
        fns: dict[str, Callable[[], object]] = {}
        outs: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for t in TILES:
            bn1, bn2, bk, warps, stages = t
            cfgs = (GemmConfig(16, bn1, bk, 1, warps, stages), GemmConfig(16, bn2, bk, 1, warps, stages))
            fn = functools.partial(pooled_fused_moe, *layer.args, cfgs, variant=args.variant)
            try:  # a tile this card cannot run (shared memory): its cell says so
                outs[_label(t)] = fn().float()
                fns[_label(t)] = fn
            except Exception as exc:
                failed[_label(t)] = type(exc).__name__
        if not fns:
            raise SystemExit(f"M={m}: no tile ran ({failed})")
        ref = next(iter(outs.values()))  # the first tile that ran
        scale = ref.abs().max().item() or 1.0
        times = {n: ms * 1e3 for n, ms in time_graphs(fns, rounds=args.rounds).items()}
        bound = layer.nbytes / (hbm * 1e9) * 1e6
        best = min(times, key=lambda n: times[n])
        cells = " | ".join(
            failed[n]
            if n in failed
            else f"{times[n]:.1f} ({bound / times[n]:.0%}) {(outs[n] - ref).abs().max().item() / scale:.0e}"
            for n in map(_label, TILES)
        )
        first = _label(TILES[0])
        ratio = f"{times[first] / times[best]:.3f}" if first in times else "-"
        d1, d2 = default
        lines.append(
            f"| {m} | {d1.block_n}/{d2.block_n}/{d1.block_k}/{d1.num_warps}/{d1.num_stages} | {cells} | "
            f"{ratio} ({best}) |"
        )
        write(args.out, lines)
        del layer, fns, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
