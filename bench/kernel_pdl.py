"""`python -m bench.kernel_pdl`: one pooled layer's decode and prefill kernels with gemm2 (on the GEMV path, the
int4 / NVFP4 decode default: down) launched plainly and as a programmatic dependent of gemm1 (gate_up) (PDL,
`kernels/pdl.py`; every format, PDL_SKIP_FORMATS included). Seeded,
warmed up, graph replay; each setting is timed twice, in alternating order, and the faster kept; the eager
outputs compared bitwise to the plain launches (a weak check: tests/test_pdl_gpu.py is the correctness check).
Prints % of the HBM read bandwidth measured in the same run."""

from __future__ import annotations

import argparse
import functools
import time

import torch
from pooled_runner.kernels import pdl
from pooled_runner.kernels.fused_moe import pooled_fused_moe

from bench.common import write
from bench.kernel_variants import _time_variant, resident_layer
from bench.kernels import measured_header

# (shape, format, M): the decode widths the kernel targets name, and one prefill width
PDL_CASES = [
    ("qwen3", "bf16", 1),
    ("qwen3", "bf16", 4),
    ("qwen3", "bf16", 16),
    ("qwen3", "int4-g128", 1),
    ("qwen3", "int4-g128", 8),
    ("deepseek", "bf16", 1),
    ("deepseek", "bf16", 8),
    ("deepseek", "int4-g128", 1),
    ("deepseek", "int4-g128", 8),
    ("deepseek", "nvfp4", 1),
    ("deepseek", "nvfp4", 8),
    ("deepseek", "fp8", 8),
    ("qwen3", "bf16", 512),
]
# (column, PDL_GEMM2)
SETTINGS = [("plain", False), ("PDL", True)]


def _timed(fn, on: bool) -> tuple[float | None, torch.Tensor | None, str]:
    old = pdl.PDL_GEMM2, pdl.PDL_SKIP_FORMATS
    pdl.PDL_GEMM2, pdl.PDL_SKIP_FORMATS = on, ()
    try:
        return _time_variant(fn)
    finally:
        pdl.PDL_GEMM2, pdl.PDL_SKIP_FORMATS = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="", help="commit to print (default: git rev-parse HEAD)")
    ap.add_argument(
        "--budget", type=float, default=200.0, help="seconds before the remaining cases are skipped"
    )
    ap.add_argument(
        "--formats", default="", help="comma list: only the cases of these formats (e.g. int4-g128,nvfp4)"
    )
    args = ap.parse_args()
    formats = {f for f in args.formats.split(",") if f}
    unknown = formats - {name for _, name, _ in PDL_CASES}
    if unknown:
        ap.error(f"--formats: no case has {sorted(unknown)}")
    t_start = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    hbm, _, lines = measured_header(args.commit)
    cols = " | ".join(f"{name} µs (% HBM)" for name, _ in SETTINGS)
    lines += [f"| shape | format | M | MB | {cols} | best vs plain | bitwise = plain |"]
    lines += ["|---" * (6 + len(SETTINGS)) + "|"]
    print("\n".join(lines), flush=True)
    for shape, name, M in PDL_CASES:
        if formats and name not in formats:
            continue
        if time.perf_counter() - t_start > args.budget:
            lines.append(f"| {shape} | {name} | {M} | skipped: budget of {args.budget:.0f} s reached |")
            continue
        layer = resident_layer(shape, name, M, g)
        fn = functools.partial(pooled_fused_moe, *layer.args)
        best: dict[str, float] = {}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(2):
            for col, on in SETTINGS:
                us, out, err = _timed(fn, on)
                if us is None:
                    print(f"  {shape} {name} M={M} {col}: {err}", flush=True)
                    continue
                best[col] = min(best.get(col, us), us)
                outs[col] = out
        if "plain" not in best or len(best) < 2:
            lines.append(
                f"| {shape} | {name} | {M} | error: {sorted(set(dict(SETTINGS)) - set(best))} failed |"
            )
            print(lines[-1], flush=True)
            continue
        cells = " | ".join(
            f"{best[c]:.1f} ({layer.pct_hbm(best[c], hbm):.0f}%)" if c in best else "error"
            for c, _ in SETTINGS
        )
        fastest = min(best, key=lambda c: best[c])
        same = all(torch.equal(outs[c], outs["plain"]) for c in outs)
        lines.append(
            f"| {shape} | {name} | {M} | {layer.nbytes / 1e6:.1f} | {cells} | "
            f"{best['plain'] / best[fastest]:.3f}x ({fastest}) | {'yes' if same else 'NO'} |"
        )
        print(lines[-1], flush=True)
        del layer, fn, outs
        torch.cuda.empty_cache()
    lines += [
        "",
        "plain: gemm2 launched after gemm1 completes; PDL: gemm2 launched as gemm1's programmatic dependent "
        "(kernels/pdl.py); int4 and NVFP4 decode rows (up to 64 routed pairs) take the GEMV path, where the "
        "pair is gate_up and down. Best of two alternating timings each. bitwise = plain: the eager outputs compared (a "
        "weak check: the allocator may hand back an act buffer that already holds the values; "
        "tests/test_pdl_gpu.py is the correctness check).",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()
