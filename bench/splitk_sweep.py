"""The one-launch split path (`kernels/splitk.py`) against the other decode paths, dense weights (GPU).

First its tiles at one shape and M (single timings, to rank), then the default tile (and the best of the
sweep, and the `--forms`) against the default path (which is splitk itself where `default_variant` picks it),
"inline", "align" and "gemv" at each shape and M, in interleaved rounds
(`common.time_graphs`, the numbers to read). Every expert resident, graph replay, fresh random weights and
routing (seeded); the split path's largest difference from the inline path is printed beside each row.

Usage: python -m bench.splitk_sweep [--sweep-shape qwen3] [--sweep-m 1] [--cases qwen3:1,qwen3:2,...]
       [--budget 150 (0: no sweep)] [--forms fp32] [--out splitk.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import random
import time

import torch
import triton
from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
from pooled_runner.kernels.operands import kernel_format
from pooled_runner.kernels.splitk import SplitConfig, splitk_configs, splitk_moe

from bench.common import commit_id, read_bandwidth, time_graphs
from bench.common import write_progress as write
from bench.inline_sweep import STOCK_QWEN3_BF16_M1_US
from bench.kernels import SHAPES, random_rows, time_graph
from pooled_runner.formats import make_format

# the first sweep (2026-12-02, Qwen3-like M=1; BN 16-64, BK 64-128, BH 64-256, 2-4 stages) ranked the largest
# tiles and deepest pipelines first: this grid goes on from there
BLOCK_N = (32, 64, 128)
BLOCK_H = (128, 256, 512)
STAGES = (3, 4, 5)
WARPS = (4, 8)
BLOCK_K = (128, 256)
# SplitConfig fields other than the tiles (`kernels/splitk.py`). Measured and dropped (2026-12-02, H100): the
# down slice asked into L2 (`prefetch.global.L2::evict_last`) at each program's start with gate/up loads
# evict-first: 4-26% slower; fp64 `red` through inline PTX did not compile (pointer and fp64 operands).
# And (2026-12-03, H200, Qwen3-like M=1, one interleaved run; split path then 27.18 µs): slices of I narrower than
# block_n so the grid covers the SMs (16 slices of 48, 128 programs, not 12 of 64): 27.86, and 26.70 against
# 26.15 with the one-load tail (since the default); every add masked off by a test on the data: 27.85, so the
# fp64 adds cost nothing measurable there. Each program's down loop started at its own tile of H (fewer programs
# adding into the same sums at once): from 0.6% slower to 1.1% faster over three runs and six shapes: dropped.
# And (2026-12-06, H100, 5 interleaved rounds): both projections as one loop, each iteration's other phase's loads
# masked off (the first down tiles in flight during the last gate/up MMAs), bitwise equal: Qwen3-like M=1 / 2 /
# 4 / 8 42.18 / 78.76 / 124.76 / 243.16 µs against 33.51 / 62.25 / 109.28 / 192.26 (down tiles of 128, 3 stages:
# no better): dropped.
# And (2026-12-06, H100, H100 tiles, 5 interleaved rounds): the first 1 / 2 / 4 down tiles asked into L2
# (`prefetch.global.L2`, one line per row) during the last gate/up iterations: M=1 32.42 / 32.42 / 33.17 µs
# against 32.12, M=2 59.56 / 59.68 / 59.04 against 59.32, M=4 104.68 / 104.83 / 105.41 against 105.74 (one run),
# bitwise equal: dropped.
# `bh256-w8`: the H200's tile where the card's default is another (`splitk.DEVICE_TILES`: the H100's)
FORMS = {"fp32": {"fp32_sums": True}, "bh256-w8": {"block_h": 256, "num_warps": 8}}


def _layer(shape: str, m: int, seed: int):  # type: ignore[no-untyped-def]
    H, I, E, K = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = random_rows("bf16", H, I, E, "cuda", g)
    fmt = kernel_format(make_format("bf16", torch.bfloat16))
    p13, p2 = make_projections(fmt, rows, None, H, I)
    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
    x = torch.randn(m, H, generator=g, device="cuda").bfloat16()
    w, ids = torch.softmax(torch.randn(m, E, generator=g, device="cuda"), -1).topk(K, -1)
    row_bytes = sum(t[0].numel() * t.element_size() for t in rows.values())
    return (x, ids, w, l2p, E, p13, p2, fmt), rows, row_bytes * int(ids.unique().numel())


def _cfg(c: SplitConfig) -> str:
    return f"BN {c.block_n}, BK {c.block_k}, BH {c.block_h}, warps {c.num_warps}, stages {c.num_stages}"


def _sweep(args_: tuple, deadline: float, lines: list[str], out: str | None) -> list:  # type: ignore[type-arg]
    lines += ["", "tile sweep (single timings, to rank):", "", "| tiles | µs |", "|---|---|"]
    ranked = []
    grid = list(itertools.product(BLOCK_N, BLOCK_H, STAGES, WARPS, BLOCK_K))
    random.Random(0).shuffle(grid)  # the budget may end the sweep: cover the grid evenly
    d = splitk_configs(0, 0, torch.device("cuda"))  # this card's default tile first
    grid.insert(0, grid.pop(grid.index((d.block_n, d.block_h, d.num_stages, d.num_warps, d.block_k))))
    for bn, bh, stages, warps, bk in grid:
        if time.perf_counter() > deadline:
            lines.append("| (budget reached) | |")
            break
        cfg = SplitConfig(bn, bk, bh, warps, stages)
        try:
            us = time_graph(functools.partial(splitk_moe, *args_, cfg), min_ms=10.0)
        except Exception as exc:  # a tile the device cannot take (shared memory): listed, skipped
            lines.append(f"| {_cfg(cfg)} | {type(exc).__name__} |")
            continue
        ranked.append((us, cfg))
        lines.append(f"| {_cfg(cfg)} | {us:.2f} |")
    write(out, lines)
    return sorted(ranked, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep-shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--sweep-m", type=int, default=1)
    ap.add_argument("--cases", default="qwen3:1,qwen3:2,qwen3:3,qwen3:4,deepseek:1,deepseek:2")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the tile sweep")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--forms", default="", help=f"splitk forms to time beside the default: {','.join(FORMS)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.splitk_sweep needs a CUDA GPU")
    args_, rows, _ = _layer(args.sweep_shape, args.sweep_m, 0)
    hbm = read_bandwidth(next(iter(rows.values())))
    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {args.commit or commit_id()}; HBM read {hbm:.0f} GB/s",
        f"sweep at {args.sweep_shape} bf16 M={args.sweep_m}; default tile ({_cfg(splitk_configs(0, 0, torch.device('cuda')))})",
    ]
    write(args.out, lines)
    ranked = _sweep(args_, time.perf_counter() + args.budget, lines, args.out) if args.budget > 0 else []
    best = ranked[0][1] if ranked else splitk_configs(0, 0, torch.device("cuda"))
    del args_, rows
    forms = {"splitk": splitk_configs(0, 0, torch.device("cuda"))}
    if best != forms["splitk"]:
        forms["best tile"] = best
    for name in args.forms.split(",") if args.forms else []:
        if name not in FORMS:
            raise SystemExit(f"unknown form {name!r}: expected one of {', '.join(FORMS)}")
        forms[name] = dataclasses.replace(forms["splitk"], **FORMS[name])
    names = list(forms)  # the table's columns (a form that fails is left out of later cases)
    head = " | ".join(f"{n} µs (% bound)" for n in names)
    lines += [
        "",
        f"interleaved ({args.rounds} rounds); splitk: the default tile ({_cfg(forms['splitk'])}); best tile of "
        f"the sweep: {_cfg(best)}; forms: {', '.join(f'{n} {FORMS[n]}' for n in forms if n in FORMS)}",
        "",
        f"| shape | M | bound µs | default path µs (% bound) | inline µs | align µs | gemv µs | {head} | fastest "
        "other path / splitk | fastest other path / fastest splitk form | stock SGLang / fastest | max diff vs "
        "inline |",
        "|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|",
    ]
    for case in args.cases.split(","):
        shape, m = case.split(":")
        a, _rows, nbytes = _layer(shape, int(m), 1)
        bound = nbytes / (hbm * 1e9) * 1e6
        fns = {
            "default": functools.partial(pooled_fused_moe, *a),
            "inline": functools.partial(pooled_fused_moe, *a, variant="inline"),
            "align": functools.partial(pooled_fused_moe, *a, variant="align"),
            "gemv": functools.partial(pooled_fused_moe, *a, variant="gemv"),
        }
        fns.update({n: functools.partial(splitk_moe, *a, c) for n, c in forms.items()})
        for n in list(forms):  # a form that does not compile or run here is reported, not timed
            try:
                fns[n]()
            except Exception as exc:
                if n == "splitk":  # the baseline of every ratio
                    raise
                lines.append(f"({shape} M={m}: form {n} failed: {type(exc).__name__}: {str(exc)[:200]})")
                forms.pop(n)
                fns.pop(n)
        t = {k: v * 1e3 for k, v in time_graphs(fns, rounds=args.rounds).items()}
        fastest = min(forms, key=lambda n: t[n])
        ref = fns["splitk"]().float()
        form_diffs = {n: (fns[n]().float() - ref).abs().max().item() for n in forms if n != "splitk"}
        diff = (ref - fns["inline"]().float()).abs().max().item()
        other = min(("inline", "align", "gemv"), key=lambda n: t[n])  # the fastest path that is not splitk
        stock = f"{STOCK_QWEN3_BF16_M1_US / t[fastest]:.3f}x" if (shape, m) == ("qwen3", "1") else "-"
        cells = " | ".join(f"{t[n]:.2f} ({bound / t[n]:.0%})" if n in t else "failed" for n in names)
        lines.append(
            f"| {shape} | {m} | {bound:.1f} | {t['default']:.2f} ({bound / t['default']:.0%}) | {t['inline']:.2f} | "
            f"{t['align']:.2f} | {t['gemv']:.2f} | {cells} | {t[other] / t['splitk']:.3f} ({other}) | "
            f"{t[other] / t[fastest]:.3f} ({fastest}) | {stock} | {diff:.1e} |"
        )
        lines.append(f"({shape} M={m}: forms' max diff vs splitk: {form_diffs})")
        write(args.out, lines)
        del a, _rows, fns


if __name__ == "__main__":
    main()
