"""The align path's decode tiles against each other, interleaved (GPU): one shape and format, every expert
resident, fresh seeded weights and routing per M; each tile's time, % of the HBM bound and largest difference
from the default tiles (`fused_moe.pick_configs`) printed side by side. For the tile choice at decode widths the
split and inline paths leave to the align path (Qwen3-like bf16 M = 4-16, where stock SGLang is level with it).

Usage: python -m bench.align_tiles [--shape qwen3] [--format bf16] [--ms 4,8,16] [--variant align]
       [--rounds 5] [--out align_tiles.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools

import torch
import triton
from pooled_runner.kernels.fused_moe import pick_configs, pooled_fused_moe
from pooled_runner.kernels.gemm_parts import GemmConfig

from bench.common import commit_id, read_bandwidth, time_graphs
from bench.common import write_progress as write
from bench.kernel_variants import resident_layer
from bench.kernels import SHAPES

# (BN1, BN2, BK, warps, stages) with block_m 16 and group_m 1, both GEMMs; unswapped. The first is bf16's
# default at these widths (pick_configs). Stock SGLang 0.5.23's tuned H100 tile for the Qwen3-like layer at M = 8
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
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--variant", default="align", choices=("align", "align-fc", "inline"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.align_tiles needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    probe = torch.empty(1 << 28, dtype=torch.int32, device="cuda").random_()
    hbm = read_bandwidth(probe)
    del probe
    H, I, E, K = SHAPES[args.shape]
    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {args.commit or commit_id()}; HBM read {hbm:.0f} GB/s",
        f"{args.shape} {args.format}, variant {args.variant}, {args.rounds} interleaved rounds (graph replay); "
        "tiles BN1/BN2/BK/warps/stages (block_m 16); µs (% of the HBM bound), max |diff| / max |default|",
        "",
        "| M | default tiles | " + " | ".join(_label(t) for t in TILES) + " | fastest / first |",
        "|---|---|" + "---|" * len(TILES) + "---|",
    ]
    print("\n".join(lines[:-1]), flush=True)
    write(args.out, lines)
    for m in (int(v) for v in args.ms.split(",")):
        layer = resident_layer(args.shape, args.format, m, g)
        default = pick_configs(m, K, E, H, I, layer.args[-1].fmt)
        fns = {}
        for t in TILES:
            bn1, bn2, bk, warps, stages = t
            cfgs = (GemmConfig(16, bn1, bk, 1, warps, stages), GemmConfig(16, bn2, bk, 1, warps, stages))
            fns[t] = functools.partial(pooled_fused_moe, *layer.args, cfgs, variant=args.variant)
        ref = fns[TILES[0]]().float()
        scale = ref.abs().max().item() or 1.0
        diffs, failed = {}, {}
        for t, fn in list(fns.items()):
            try:  # a tile this card cannot run (shared memory): its cell says so
                diffs[t] = (fn().float() - ref).abs().max().item() / scale
            except Exception as exc:
                failed[t] = type(exc).__name__
                del fns[t]
        times = {t: ms * 1e3 for t, ms in time_graphs(fns, rounds=args.rounds).items()}
        bound = layer.nbytes / (hbm * 1e9) * 1e6
        best = min(times, key=lambda t: times[t])
        cells = " | ".join(
            failed[t] if t in failed else f"{times[t]:.1f} ({bound / times[t]:.0%}) {diffs[t]:.0e}"
            for t in TILES
        )
        d1, d2 = default
        lines.append(
            f"| {m} | {d1.block_n}/{d2.block_n}/{d1.block_k}/{d1.num_warps}/{d1.num_stages} | {cells} | "
            f"{times[TILES[0]] / times[best]:.3f} ({_label(best)}) |"
        )
        write(args.out, lines)
        del layer, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
