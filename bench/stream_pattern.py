"""`python -m bench.stream_pattern`: the read bandwidth of the GEMV decode path's access pattern alone (GPU).

A program per block of `BN` rows walks K in tiles of `KW` int32 words (the GEMV's grid and tile walk, through
Triton's software pipeline) and only adds the words up: no dequantization, no x. Reported as GB/s and % of the
HBM read bandwidth measured in the same run, so the GEMV's µs can be split into what its loads allow and what
its arithmetic costs. Rows are `K_WORDS` words apart, as one projection of a pool row.

Usage: python -m bench.stream_pattern [--rows 32768] [--k-words 896]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.common import write
from bench.kernels import measured_header, time_graph


@triton.jit
def _stream_kernel(w_ptr, out_ptr, K_WORDS, BN: tl.constexpr, KW: tl.constexpr, STAGES: tl.constexpr,
                   SPLIT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = (pid // SPLIT) * BN + tl.arange(0, BN)
    per_split = tl.cdiv(tl.cdiv(K_WORDS, KW), SPLIT) * KW
    lo = (pid % SPLIT) * per_split
    hi = tl.minimum(lo + per_split, K_WORDS)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K_WORDS + tl.arange(0, KW)[None, :]
    acc = tl.zeros((BN, KW), dtype=tl.int32)
    for k0 in tl.range(lo, hi, KW, num_stages=STAGES):
        acc += tl.load(ptrs + k0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def stream_us(w: torch.Tensor, bn: int, kw: int, stages: int, warps: int, split: int) -> float:
    rows, k_words = w.shape
    assert rows % bn == 0 and k_words % kw == 0, (rows, bn, k_words, kw)
    out = torch.empty(rows // bn * split, dtype=torch.int32, device=w.device)
    grid = (rows // bn * split,)

    def run():
        _stream_kernel[grid](w, out, k_words, BN=bn, KW=kw, STAGES=stages, SPLIT=split, num_warps=warps)

    return time_graph(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768, help="8 experts of DeepSeek-like gate_up: 8 x 4096")
    ap.add_argument("--k-words", type=int, default=896, help="7168 int4 values: 896 words")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hbm, _, lines = measured_header(args.commit)
    print("\n".join(lines), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(
        -(2**31), 2**31 - 1, (args.rows, args.k_words), generator=g, device="cuda", dtype=torch.int32
    )
    nbytes = w.numel() * 4
    lines += [
        "| BN rows | KW words (bytes per row) | stages | warps | split K | programs | µs | GB/s | % HBM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines[-2:]), flush=True)
    cases = [
        (64, 16, 4, 4, 1),  # int4 default gate_up tile (64 B per row and tile)
        (64, 16, 4, 4, 4),
        (128, 16, 4, 8, 1),
        (64, 32, 4, 4, 1),  # 128 B per row and tile
        (64, 32, 3, 4, 2),
        (32, 64, 3, 4, 1),  # 256 B
        (32, 64, 3, 4, 4),
        (16, 128, 3, 4, 4),  # 512 B
        (64, 16, 2, 4, 1),
        (64, 16, 8, 4, 1),
    ]
    for bn, kw, stages, warps, split in cases:
        us = stream_us(w, bn, kw, stages, warps, split)
        gbs = nbytes / (us * 1e3)
        lines.append(
            f"| {bn} | {kw} ({4 * kw}) | {stages} | {warps} | {split} | {args.rows // bn * split} | {us:.1f} "
            f"| {gbs:.0f} | {100 * gbs / hbm:.0f}% |"
        )
        print(lines[-1], flush=True)
    write(args.out, lines)


if __name__ == "__main__":
    main()
