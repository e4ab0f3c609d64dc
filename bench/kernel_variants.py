"""`python -m bench.kernels --variants`: the decode kernels side by side (align path, its decode options, the
GEMV path) at the issue's shapes, ratios to the bandwidths measured in the same run, then align-path and GEMV
tile sweeps for as long as the time budget lasts. Seeded, warmed up, graph replay (bench/kernels.py helpers)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import torch
from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
from pooled_runner.kernels.gemv import GemvConfig, gemv_configs
from pooled_runner.kernels.operands import kernel_format

from bench.common import write
from bench.kernels import SHAPES, measured_header, pinned_bank, random_rows, time_graph
from pooled_runner.formats import make_format

# (shape, format, decode widths M, share of the step's experts read through the pinned host view): the cases
# the decode-kernel work targets, and one with host rows
VARIANT_CASES = [
    ("deepseek", "int4-g128", (1, 2, 4, 8, 12, 16), "0"),
    ("deepseek", "nvfp4", (1, 2, 4, 8, 12, 16), "0"),
    ("qwen3", "nvfp4", (1, 2, 4, 8, 16), "0"),
    ("qwen3", "bf16", (1, 4, 16), "0"),
    ("qwen3", "int4-g128", (1, 2, 4, 8, 16), "0"),
    ("deepseek", "bf16", (1, 8), "0"),
    ("deepseek", "fp8", (1, 8), "0"),
    ("qwen3", "bf16", (1,), "1/8"),
]


def variant_specs(H: int, I: int, fmt: int, num_pairs: int, group: int = 128) -> list[tuple[str, dict]]:
    """(column, pooled_fused_moe keyword arguments): the default first (the 'before' of the ratio), then the
    align and inline paths with their tiles as `pick_configs` gives them and swapped (`GemmConfig.swap_ab`),
    then the GEMV path."""
    from pooled_runner.kernels.fused_moe import pick_configs

    base = gemv_configs(H, I, fmt, num_pairs, group)
    tiles = pick_configs(max(1, num_pairs // 8), 8, 0, H, I, fmt)
    plain = tuple(dataclasses.replace(c, swap_ab=False) for c in tiles)
    swapped = tuple(dataclasses.replace(c, swap_ab=True) for c in tiles)
    return [
        ("default", {}),
        ("align", {"variant": "align", "configs": plain}),
        ("align swap", {"variant": "align", "configs": swapped}),
        ("inline", {"variant": "inline", "configs": plain}),
        ("inline swap", {"variant": "inline", "configs": swapped}),
        ("gemv", {"variant": "gemv", "gemv_config": base}),
    ]


def sweep_configs(base: GemvConfig) -> list[GemvConfig]:
    """GEMV tiles around the default (no repeats): Triton's software pipeline (3, 4 stages), the register
    prefetch and no prefetch, N blocks halved / doubled (8 warps), K tiles of 128/512, one launch."""
    r = dataclasses.replace
    plain = r(base, stages=0)  # the register prefetch (or none), as `prefetch` says
    half = {"block_n1": max(4, base.block_n1 // 2), "block_n2": max(8, base.block_n2 // 2)}
    double = {"block_n1": base.block_n1 * 2, "block_n2": base.block_n2 * 2}
    k128 = {"block_k1": 128, "block_k2": 128}
    configs = [
        base,
        r(base, stages=3),
        r(base, stages=4, **k128),
        r(plain, prefetch=True, down_peel=False),  # the register prefetch loads down's first tile itself
        r(plain, prefetch=False),
        r(base, **half),
        r(base, **double, num_warps=8),
        r(base, **k128),
        r(base, block_k1=512, block_k2=512, **half),
        r(
            base, one_launch=True, down_prefetch=-1, down_max_registers=-1, down_peel=False, **half
        ),  # one launch: both tiles alike
        # no prefetch, K tiles of 128 (int4 g128: one scale per row and tile), more rows per program
        r(plain, prefetch=False, **k128),
        r(plain, prefetch=False, **k128, **double),
        r(plain, prefetch=False, **k128, **double, num_warps=8),
        r(plain, prefetch=False, **half),
    ]
    return list(dict.fromkeys(configs))


def selected(cases: list, args: argparse.Namespace) -> list:
    """The cases (tuples starting with shape, format) that `--shapes` and `--formats` keep (empty: all)."""
    shapes = {s for s in args.shapes.split(",") if s}
    names = {f for f in args.formats.split(",") if f}
    return [c for c in cases if (not shapes or c[0] in shapes) and (not names or c[1] in names)]


@dataclasses.dataclass
class DecodeLayer:
    """One resident bench layer and one routed decode step of it."""

    args: tuple  # pooled_fused_moe's (hidden, topk_ids, topk_weights, l2p, num_experts, w13, w2, fmt)
    nbytes: int  # the step's distinct experts' bytes (weights + scales)
    host_nbytes: int = 0  # of those, the bytes of experts read from the pinned bank (host codes)

    def pct_hbm(self, us: float, hbm_gbs: float) -> float:
        """% of the HBM read bandwidth `hbm_gbs` (GB/s) that reading `nbytes` in `us` µs achieves."""
        return 100 * self.nbytes / (hbm_gbs * 1e9) / (us * 1e-6)

    def bound_us(self, hbm_gbs: float, zero_copy_gbs: float) -> float:
        """µs to read the pool rows' bytes at `hbm_gbs` and then the host rows' at `zero_copy_gbs` (GB/s), the
        bound of bench.kernels."""
        pool_nbytes = self.nbytes - self.host_nbytes
        return pool_nbytes / (hbm_gbs * 1e3) + self.host_nbytes / (zero_copy_gbs * 1e3)


def resident_layer(shape: str, name: str, M: int, g: torch.Generator, host_every: int = 0) -> DecodeLayer:
    """A layer of `shape` in format `name` with every expert in a pool row, and M tokens routed by softmax top-k
    of random logits (CUDA). `host_every` (>= 1): every `host_every`-th of the step's distinct experts (in expert
    order, the first included) read from a pinned bank copy of the pool instead (host codes `E + expert` in l2p),
    as bench.kernels' "1/8" (`host_every=8`); 1: every expert, a step whose experts all missed the pool."""
    if host_every < 0:
        raise ValueError(
            f"host_every={host_every}: 0 (none) or >= 1 (every n-th distinct expert on the host)"
        )
    H, I, E, K = SHAPES[shape]
    fmt = kernel_format(make_format(name, torch.bfloat16))
    pool = random_rows(name, H, I, E, "cuda", g)
    row_bytes = sum(t[0].numel() * t.element_size() for t in pool.values())
    p13, p2 = make_projections(fmt, pool, pinned_bank(pool) if host_every else None, H, I)
    x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
    distinct = torch.unique(ids)
    host = distinct[::host_every] if host_every else distinct[:0]
    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
    l2p[host] += E
    args = (x, ids, w, l2p, E, p13, p2, fmt)
    return DecodeLayer(args, distinct.numel() * row_bytes, host.numel() * row_bytes)


def _time_variant(fn) -> tuple[float | None, torch.Tensor | None, str]:
    """(µs per replay, eager output, error). A one-launch GEMV step whose wait gave up counts as an error."""
    from pooled_runner.kernels import gemv

    try:
        out = fn().clone()
        us = time_graph(fn)
    except Exception as exc:  # report the variant and go on
        print(f"  {exc!r}"[:300], file=sys.stderr, flush=True)
        return None, None, type(exc).__name__
    if gemv.spin_timeouts(out.device):
        gemv._COUNTERS[out.device][0] = 0
        return None, None, "wait timed out"
    return us, out, ""


def variants_main(args: argparse.Namespace) -> None:
    """Decode kernels side by side: per case, the default kernels and each variant, in µs per layer
    (graph replay) and % of the HBM read bandwidth measured here; max |difference| to the default's output
    relative to its max |value|; then GEMV tiles swept at M = 1 while the budget lasts."""
    t_start = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    hbm, zero_copy, lines = measured_header(args.commit)
    header_done = False
    sweep_cases = []
    for shape, name, ms, host in [] if args.sweeps_only else selected(VARIANT_CASES, args):
        if time.perf_counter() - t_start > args.budget:
            lines.append(
                f"| {shape} | {name} | {ms} | {host} | skipped: budget of {args.budget:.0f} s reached |"
            )
            continue
        H, I, E, K = SHAPES[shape]
        fmt = kernel_format(make_format(name, torch.bfloat16))
        pool = random_rows(name, H, I, E, "cuda", g)
        row_bytes = sum(t[0].numel() * t.element_size() for t in pool.values())
        bank = None
        if host != "0":
            bank = pinned_bank(pool)
        p13, p2 = make_projections(fmt, pool, bank, H, I)
        for M in ms:
            x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
            w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
            distinct = torch.unique(ids)
            l2p = torch.arange(E, dtype=torch.int32, device="cuda")
            if host != "0":  # every 8th distinct expert read through the host view
                l2p[distinct[::8]] = (E + distinct[::8]).int()
            num_host = int((l2p[distinct] >= E).sum())
            nbytes = distinct.numel() * row_bytes
            bound_us = ((nbytes - num_host * row_bytes) / hbm + num_host * row_bytes / zero_copy) / 1e3
            specs = variant_specs(H, I, fmt.fmt, M * K, fmt.group)
            if not header_done:
                cols = [c for c, _ in specs]
                lines += [
                    "| shape | format | M | host rows | MB | bound µs | "
                    + " | ".join(f"{c} µs (% bound)" for c in cols)
                    + " | best vs before | max diff vs default |",
                    "|---|---|---|---|---|---|" + "---|" * len(cols) + "---|---|",
                ]
                print("\n".join(lines), flush=True)
                header_done = True
            cells, times, diffs = [], [], []
            ref = None  # the default column's output: every diff is against it ("n/a" when it failed)
            for i, (col, kw) in enumerate(specs):
                fn = functools.partial(pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt, **kw)
                us, out, err = _time_variant(fn)
                if us is None:
                    cells.append(f"error: {err}")
                    if i:
                        diffs.append("err")
                    continue
                cells.append(f"{us:.1f} ({100 * bound_us / us:.0f}%)")  # % of the bound
                times.append((us, col))
                if i == 0:
                    ref = out.float()
                elif ref is None:
                    diffs.append("n/a")
                else:
                    scale = ref.abs().max().item() or 1.0
                    diffs.append(f"{(out.float() - ref).abs().max().item() / scale:.0e}")
            before = dict((c, t) for t, c in times).get(specs[0][0])
            best = ""
            if before and times:
                us_best, col_best = min(times)
                best = f"{before / us_best:.2f}x ({col_best})"
            row = (
                f"| {shape} | {name} | {M} | {host} | {nbytes / 1e6:.1f} | {bound_us:.1f} | "
                + " | ".join(cells)
                + f" | {best} | {' / '.join(diffs)} |"
            )
            print(row, flush=True)
            lines.append(row)
            write(args.out, lines)
            if M == 1 and host == "0":
                sweep_cases.append((shape, name))
        del pool, bank, p13, p2
        torch.cuda.empty_cache()
    lines += [
        "",
        "µs (% of the bound): bound = resident bytes / HBM read + host-view bytes / zero-copy read (both "
        "measured here); bytes = the step's distinct experts' weights + scales. Graph replay of one layer, "
        "softmax top-k of random logits; host rows 1/8: every 8th distinct expert is read through the pinned "
        "host view. Columns: default = pooled_fused_moe's default kernels (fused_moe.default_variant and "
        "pick_configs: the GEMV for int4 and NVFP4 up to 128 routed pairs over mostly distinct experts, "
        "kernels/splitk.py for bf16/fp16 up to 16 such pairs with I <= 1024, H <= 4096 and T*H <= 4096, else swapped tiles on the align path where fused_moe.swapped_tiles says so, else inline up "
        "to 8 routed pairs, else align); align = align + gemm1 + gemm2 + combine and inline = gemm1 + gemm2 "
        "computing the align inside every program, combine fused (<= 32 pairs, else as align with the combine "
        "fused), both with pick_configs' tiles unswapped; 'swap' = the same tiles with swapped operands "
        "(GemmConfig.swap_ab: the weight tile is the MMA's left operand, acc^T = W @ x^T); gemv = "
        "kernels/gemv.py, two launches (more GEMV options in the sweep). best vs before: the default's time / "
        "the fastest column's. max diff vs default: max |column - default| / max |default| for each column "
        "after the first, in order (a column computing the default's kernels: 0; swapped against unswapped "
        "tiles and gemv sum in another order: ~1e-3 to 1e-2 is expected, > 1e-1 is a bug).",
    ]
    write(args.out, lines)
    if not args.no_align_sweep:
        lines += sweep_align(g, hbm, t_start, args.budget, selected(ALIGN_SWEEP_CASES, args))
    write(args.out, lines)
    # the targets first: Qwen3-like bf16 (launch-bound) and the packed formats; DeepSeek-like bf16 last
    sweep_cases.sort(key=lambda c: c == ("deepseek", "bf16"))
    lines += sweep_gemv(g, hbm, sweep_cases, t_start, args.budget)
    write(args.out, lines)


# (shape, format, variant, M): the decode cases whose tiles the sweep varies, in order
ALIGN_SWEEP_CASES = [
    ("deepseek", "int4-g128", "align", 1),
    ("deepseek", "int4-g128", "align", 8),
    ("deepseek", "nvfp4", "align", 1),
    ("deepseek", "nvfp4", "align", 8),
    ("qwen3", "bf16", "inline", 1),
    ("qwen3", "bf16", "align", 16),
    ("deepseek", "bf16", "inline", 1),
]
# (BN1, BN2, BK, warps, stages, swap_ab); block_m 16, group_m 1. pick_configs' decode tiles are (64, 64, 128, 4,
# 3) for int4 and wide I, (32, 64, 128, 4, 3) for bf16 at I <= 1024, (32, 64, 64, 4, 3) for NVFP4, with 4 stages
# for fp8; swapped for int4, NVFP4 and fp8 at I > 1024 (fused_moe.swapped_tiles); SGLang
# 0.5.23's tuned H200 tiles for the Qwen3-like layer are (64, 64, 64, 4, 5) at M=1 and (64, 64, 256, 4, 2) at M=16
ALIGN_SWEEP_TILES = [
    (64, 64, 128, 4, 3, False),
    (64, 64, 128, 4, 3, True),
    (32, 64, 64, 4, 3, True),
    (32, 64, 64, 4, 4, True),
    (32, 64, 128, 4, 3, True),
    (128, 128, 128, 4, 3, True),
    (64, 64, 64, 4, 3, True),
    (64, 64, 128, 4, 4, True),
    (128, 64, 128, 8, 3, True),
]


def sweep_align(g, hbm: float, t_start: float, budget: float, cases=ALIGN_SWEEP_CASES) -> list[str]:
    """Decode tiles per case (its variant and M; resident) until `budget` seconds from the start."""
    from pooled_runner.kernels.moe_gemm import GemmConfig

    out = [
        "",
        "align-path tile sweep (resident; µs per layer, % of HBM read):",
        "",
        "| shape | format | M | variant | BN1 | BN2 | BK | warps | stages | swap | µs | % HBM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(out), flush=True)
    for shape, name, variant, M in cases:
        if time.perf_counter() - t_start > budget:
            out.append(f"| {shape} | {name} | {M} | (budget of {budget:.0f} s reached) | | | | | | | | |")
            break
        layer = resident_layer(shape, name, M, g)
        for bn1, bn2, bk, warps, stages, swap in ALIGN_SWEEP_TILES:
            if time.perf_counter() - t_start > budget:
                out.append(f"| {shape} | {name} | {M} | (budget of {budget:.0f} s reached) | | | | | | | | |")
                break
            cfgs = (
                GemmConfig(16, bn1, bk, 1, warps, stages, swap_ab=swap),
                GemmConfig(16, bn2, bk, 1, warps, stages, swap_ab=swap),
            )
            fn = functools.partial(pooled_fused_moe, *layer.args, cfgs, variant=variant)
            us, _, err = _time_variant(fn)
            res = f"{us:.1f} | {layer.pct_hbm(us, hbm):.0f}%" if us else f"error: {err} |"
            cells = f"{bn1} | {bn2} | {bk} | {warps} | {stages} | {'yes' if swap else 'no'}"
            out.append(f"| {shape} | {name} | {M} | {variant} | {cells} | {res} |")
            print(out[-1], flush=True)
        del layer
        torch.cuda.empty_cache()
    return out


def sweep_gemv(g, hbm: float, cases, t_start: float, budget: float) -> list[str]:
    """GEMV tiles at M = 1 per case (in case order) until `budget` seconds from the start."""
    out = [
        "",
        "GEMV tile sweep (M = 1, resident; µs per layer, % of HBM read):",
        "",
        "| shape | format | BN1 | BK1 | BN2 | BK2 | warps | prefetch (stages) | launches | max regs | µs | % HBM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(out), flush=True)
    for shape, name in cases:
        if time.perf_counter() - t_start > budget:
            break
        H, I, _, K = SHAPES[shape]
        layer = resident_layer(shape, name, 1, g)
        for cfg in sweep_configs(gemv_configs(H, I, layer.args[-1].fmt, K, layer.args[-1].group)):
            if time.perf_counter() - t_start > budget:
                out.append(f"| {shape} | {name} | (budget of {budget:.0f} s reached) | | | | | | | | | |")
                break
            fn = functools.partial(pooled_fused_moe, *layer.args, variant="gemv", gemv_config=cfg)
            us, _, err = _time_variant(fn)
            res = f"{us:.1f} | {layer.pct_hbm(us, hbm):.0f}%" if us else f"error: {err} |"
            out.append(
                f"| {shape} | {name} | {cfg.block_n1} | {cfg.block_k1} | {cfg.block_n2} | {cfg.block_k2} | "
                f"{cfg.num_warps} | {cfg.stages if cfg.stages >= 2 else cfg.prefetch} | {1 if cfg.one_launch else 2} | "
                f"{cfg.max_registers or '-'} | {res} |"
            )
            print(out[-1], flush=True)
        del layer
        torch.cuda.empty_cache()
    return out
