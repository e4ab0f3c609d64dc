"""Kernel benchmark (GPU): the pooled fused MoE per format, M and residency, against bandwidths measured here.

Per case: one layer, graph-captured `pooled_fused_moe` (align, gemm1, gemm2, combine), replayed; time per
call from CUDA events. Bytes = the distinct experts' rows touched (weights + scales), so GB/s is the weight
stream the step needs. Bound = hit_bytes / B_hbm + miss_bytes / B_zero_copy with both bandwidths measured in
the same run by a Triton streaming read. Prefill cases (M >= 512) also time torch's grouped bf16 GEMM
(`torch._grouped_mm`) on the same experts. Seeded; warmed up (compile before capture).

Usage: python bench/kernels.py [--out results.md] [--quick]
       python -m bench.kernels --variants [--out variants.md] [--budget 150]

`--variants` (bench/kernel_variants.py): the decode kernels side by side (the align path, its decode options,
the GEMV path), with ratios to the bandwidths measured in the same run, then align-path and GEMV tile sweeps for
as long as the time budget lasts.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time

import torch
import triton
from pooled_runner.kernels.decode import DECODE_MAX_PAIRS
from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
from pooled_runner.kernels.operands import kernel_format

from bench.common import commit_id, read_bandwidth, write
from pooled_runner.formats import make_format

SHAPES = {"deepseek": (7168, 2048, 256, 8), "qwen3": (2048, 768, 128, 8)}
STOCK_SGLANG_H200_US = {("qwen3", 1): 31.7, ("qwen3", 4): 76.0, ("qwen3", 16): 197.0, ("qwen3", 4096): 880.0}


def stock_us(shape: str, M: int, device_name: str) -> float | None:
    """DESIGN.md §4's stock SGLang time for (shape, M), measured on an H200: None on any other card, where a
    ratio to it would compare two GPUs (`bench.stock_compare` times stock on the same card)."""
    on_h200 = "H200" in device_name and "GH200" not in device_name  # (Grace Hopper: another card)
    return STOCK_SGLANG_H200_US.get((shape, M)) if on_h200 else None


def pinned_bank(pool: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pinned host copy of every operand of `pool` (the bank its host rows are read from)."""
    return {k: torch.empty_like(v, device="cpu", pin_memory=True).copy_(v) for k, v in pool.items()}


def random_rows(
    name: str, H: int, I: int, num: int, device: str, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """`num` rows of random operands of format `name` (valid codes; values do not matter for speed), made in
    their own dtype (no fp32 temporaries: DeepSeek-size bf16 pools are 22 GB)."""
    specs = make_format(name, torch.bfloat16).operands(H, I)
    rows = {}
    for s in specs:
        shape = (num, *s.row_shape)
        if s.dtype in (torch.bfloat16, torch.float16):
            t = torch.empty(shape, dtype=s.dtype, device=device).normal_(0.0, 0.02, generator=g)
        elif s.dtype == torch.float32:
            t = torch.rand(shape, generator=g, device=device) * 0.01 + 0.001
        elif s.dtype == torch.float8_e4m3fn:  # codes 0x30..0x3c: 0.5 .. 1.5 (no fp32 temporary)
            t = torch.randint(0x30, 0x3D, shape, generator=g, device=device, dtype=torch.uint8).view(s.dtype)
        elif s.dtype == torch.int32:
            t = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, device=device, dtype=torch.int32)
        else:  # bytes: int4 zero points are 4-bit codes (the half dot relies on |q - z| <= 15)
            high = 16 if s.name.endswith("_z") else 256
            t = torch.randint(0, high, shape, generator=g, device=device, dtype=s.dtype)
        rows[s.name] = t
    return rows


def time_graph(fn, min_ms: float = 30.0) -> float:
    """Mean µs per replay of a CUDA graph of `fn` (compiled first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, min(200, int(min_ms * 1e-3 / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def grouped_gemm_us(x, ids, w13, w2) -> float | None:
    """torch._grouped_mm MoE (gate/up, SiLU*mul, down; no combine) on the same routing, µs; None if absent."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    E = w13.shape[0]
    K = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=E)
    offs = counts.cumsum(0).int()
    xs = x[order // K]
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    I = w13.shape[1] // 2

    def run():
        gu = torch._grouped_mm(xs, w13t, offs=offs)
        act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        return torch._grouped_mm(act, w2t, offs=offs)

    try:
        return time_graph(run)
    except Exception as exc:  # an unsupported build: report, don't fail the bench
        print(f"  torch._grouped_mm unavailable: {exc!r}"[:200], file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer formats and M values")
    ap.add_argument("--commit", default="", help="commit to print (default: git rev-parse HEAD)")
    ap.add_argument("--variants", action="store_true", help="decode kernel variants side by side")
    ap.add_argument("--formats", default="", help="comma list: only these formats (default: all)")
    ap.add_argument("--shapes", default="", help=f"comma list of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--budget", type=float, default=150.0, help="--variants: seconds before the sweep stops")
    ap.add_argument(
        "--sweeps-only", action="store_true", help="--variants: only the tile sweeps (no side-by-side table)"
    )
    ap.add_argument(
        "--no-align-sweep", action="store_true", help="--variants: skip the align-path tile sweep"
    )
    args = ap.parse_args()
    if args.variants:
        from bench.kernel_variants import variants_main

        variants_main(args)
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    hbm, zero_copy, lines = measured_header(args.commit)
    device_name = torch.cuda.get_device_name()
    lines += [
        "| shape | format | M | host rows | µs | GB/s | % of bound | vs torch grouped | vs stock SGLang (H200, 2026-11-29, not this run)* |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    formats = ["bf16", "int4-g128", "fp8", "nvfp4"]
    ms = [1, 2, 4, 8, 16, 64, 512, 4096]
    if args.quick:  # the decode rows the kernel work targets, and a prefill row per format
        formats, ms = ["bf16", "int4-g128", "nvfp4", "fp8"], [1, 8, 16, 512]
    if args.formats:
        formats = [f for f in formats if f in args.formats.split(",")]
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes.split(",")}
    if not formats or not shapes:
        raise SystemExit(f"--formats {args.formats!r} / --shapes {args.shapes!r} select nothing")
    for shape, (H, I, E, K) in shapes.items():
        for name in formats:
            fmt_obj = make_format(name, torch.bfloat16)
            fmt = kernel_format(fmt_obj)
            pool = random_rows(name, H, I, E, "cuda", g)
            row_bytes = sum(t[0].numel() * t.element_size() for t in pool.values())
            # every format's rows in a pinned bank too: #4 asks for host rows (1/8, all) in each format
            bank = pinned_bank(pool)
            p13, p2 = make_projections(fmt, pool, bank, H, I)
            for M in ms:
                x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
                logits = torch.randn(M, E, generator=g, device="cuda")
                w, ids = torch.softmax(logits, -1).topk(K, -1)
                distinct = torch.unique(ids)
                fracs = ["0"] + (["1/8", "all"] if M <= (1 if args.quick else 64) else [])
                for frac in fracs:
                    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
                    if frac == "1/8":
                        host = distinct[::8]
                        l2p[host] = (E + host).int()
                    elif frac == "all":
                        l2p += E
                    num_host = int((l2p[distinct] >= E).sum())
                    hit, miss = (distinct.numel() - num_host) * row_bytes, num_host * row_bytes
                    if (
                        M * K <= DECODE_MAX_PAIRS and frac == "0"
                    ):  # the two-launch decode path too, for comparison
                        try:
                            fn = functools.partial(
                                pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt, decode=True
                            )
                            row = (
                                f"| {shape} | {name} (decode path) | {M} | 0 | {time_graph(fn):.1f} | | | | |"
                            )
                        except Exception as exc:
                            row = f"| {shape} | {name} (decode path) | {M} | 0 | error: {type(exc).__name__} | | | | |"
                        print(row, flush=True)
                        lines.append(row)
                    try:
                        us = time_graph(functools.partial(pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt))
                    except Exception as exc:  # report the case and go on with the others
                        row = f"| {shape} | {name} | {M} | {frac} | error: {type(exc).__name__} | | | | |"
                        print(row, f"{exc!r}"[:300], flush=True)
                        lines.append(row)
                        continue
                    bound_us = (hit / (hbm * 1e9) + miss / (zero_copy * 1e9)) * 1e6
                    gbs = (hit + miss) / (us * 1e-6) / 1e9
                    base = ""
                    if name == "bf16" and M >= 512 and frac == "0":
                        gg = grouped_gemm_us(x, ids, pool["w13"], pool["w2"])
                        base = f"{gg / us:.2f}x ({gg:.0f} µs)" if gg else "n/a"
                    stock = stock_us(shape, M, device_name) if name == "bf16" and frac == "0" else None
                    row = (
                        f"| {shape} | {name} | {M} | {frac} | {us:.1f} | {gbs:.0f} | {100 * bound_us / us:.0f}% | "
                        f"{base} | {f'{stock / us:.2f}x' if stock else ''} |"
                    )
                    print(row, flush=True)
                    lines.append(row)
                    write(args.out, lines)  # as we go: a capped run keeps what it measured
            # free before the next format (fn: the last decode-path call holds p13 / p2): two DeepSeek-size
            # pools do not fit an 80 GB card
            pool = bank = p13 = p2 = fn = None
            torch.cuda.empty_cache()
    lines += sweep_decode_path(g)
    write(args.out, lines)
    if not args.quick:
        lines += sweep_decode_tiles(g)
        write(args.out, lines)
    lines += [
        "",
        "% of bound: (hit bytes / HBM read + host bytes / zero-copy read) / measured time. 'vs torch grouped': "
        "torch._grouped_mm time / ours (> 1 = ours faster). *stock SGLang 0.5.23 fused MoE times are DESIGN.md §4 "
        "numbers (measured 2026-11-29 on an H200, not in this run; SGLang is not on the GPU image), shown on an H200 "
        "only: `bench.stock_compare` times stock on the same card.",
    ]
    write(args.out, lines)


def sweep_decode_tiles(g: torch.Generator) -> list[str]:
    """Qwen3-like bf16 decode (M = 1, 4) over a few tile shapes: data for tuning `pick_configs`."""
    from pooled_runner.kernels.moe_gemm import GemmConfig

    H, I, E, K = SHAPES["qwen3"]
    pool = random_rows("bf16", H, I, E, "cuda", g)
    fmt = kernel_format(make_format("bf16", torch.bfloat16))
    p13, p2 = make_projections(fmt, pool, None, H, I)
    l2p = torch.arange(E, dtype=torch.int32, device="cuda")
    out = [
        "",
        "decode tile sweep (qwen3 bf16, resident; µs per layer):",
        "",
        "| BN1 | BN2 | BK | warps | M=1 | M=4 |",
    ]
    out.append("|---|---|---|---|---|---|")
    for bn1, bn2, bk, warps in [
        (16, 32, 128, 4), (32, 64, 128, 4), (64, 64, 128, 4), (32, 32, 256, 4), (32, 64, 64, 4),
        (16, 64, 256, 4), (32, 128, 128, 8), (64, 128, 64, 4),
    ]:  # fmt: skip
        cfgs = (GemmConfig(16, bn1, bk, 1, warps, 4), GemmConfig(16, bn2, bk, 1, warps, 4))
        times = []
        for M in (1, 4):
            x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
            w, ids = torch.softmax(torch.randn(M, E, generator=g, device="cuda"), -1).topk(K, -1)
            try:
                fn = functools.partial(pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt, cfgs)
                times.append(f"{time_graph(fn):.1f}")
            except Exception as exc:
                times.append(f"error {type(exc).__name__}")
        out.append(f"| {bn1} | {bn2} | {bk} | {warps} | {times[0]} | {times[1]} |")
        print(out[-1], flush=True)
    return out


def sweep_decode_path(g: torch.Generator) -> list[str]:
    """The decode path's tiles (BN1, BN2, BK, stages) at M = 1, resident, per shape and format."""
    from pooled_runner.kernels.moe_gemm import GemmConfig

    out = ["", "decode path tile sweep (resident, M=1; µs per layer):", "",
           "| shape | format | BN1 | BN2 | BK | stages | µs |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape, name in (("qwen3", "bf16"), ("deepseek", "int4-g128")):
        H, I, E, K = SHAPES[shape]
        if True:
            pool = random_rows(name, H, I, E, "cuda", g)
            fmt = kernel_format(make_format(name, torch.bfloat16))
            p13, p2 = make_projections(fmt, pool, None, H, I)
            l2p = torch.arange(E, dtype=torch.int32, device="cuda")
            x = torch.randn(1, H, generator=g, device="cuda").bfloat16()
            w, ids = torch.softmax(torch.randn(1, E, generator=g, device="cuda"), -1).topk(K, -1)
            for bn1, bn2, bk, st in [(16, 16, 128, 4), (32, 32, 128, 4), (64, 32, 128, 4), (32, 16, 256, 3)]:
                cfgs = (GemmConfig(16, bn1, bk, 1, 4, st), GemmConfig(16, bn2, bk, 1, 4, st))
                try:
                    fn = functools.partial(pooled_fused_moe, x, ids, w, l2p, E, p13, p2, fmt, cfgs, True)
                    t = f"{time_graph(fn):.1f}"
                except Exception as exc:
                    t = f"error {type(exc).__name__}"
                out.append(f"| {shape} | {name} | {bn1} | {bn2} | {bk} | {st} | {t} |")
                print(out[-1], flush=True)
            del pool
            torch.cuda.empty_cache()
    return out


def measured_header(commit: str) -> tuple[float, float, list[str]]:
    """Seed torch, measure the HBM and pinned zero-copy read bandwidths here, and return them with the
    results' header lines (date, GPU, versions, commit, bandwidths, a blank line)."""
    torch.manual_seed(0)
    hbm = read_bandwidth(torch.empty(4 << 30, dtype=torch.uint8, device="cuda"))
    pinned = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    zero_copy = read_bandwidth(pinned, reps=2)
    del pinned
    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, commit {commit_id(commit)}",
        f"measured: HBM read {hbm:.0f} GB/s, pinned zero-copy read {zero_copy:.1f} GB/s",
        "",
    ]
    return hbm, zero_copy, lines


if __name__ == "__main__":
    main()
