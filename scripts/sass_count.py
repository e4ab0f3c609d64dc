"""Compile a GEMV decode kernel for sm_90 on any machine (no GPU needed) and count its SASS: registers per
thread and the instructions of its K loop by opcode. A cheap check of a kernel change before device time.

    python scripts/sass_count.py --fmt nvfp4 --kernel gate_up --block-n 32 --block-k 256 --warps 4

The GPU image runs Triton 3.6, and another Triton compiles the same kernel differently: for the GPU's SASS,
install triton==3.6.0 into a side venv and put its site-packages first on PYTHONPATH (docs/kernels.md). The
loop counted is the longest backward branch (the K loop of `_rows_dot`); `--dump FILE` writes the whole SASS.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from pooled_runner.kernels import gemv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FORMATS = {
    "bf16": (0, 2, 128),
    "int4": (1, 8, 128),
    "nvfp4": (4, 8, 16),
}  # name: (FMT, values per word, group)
_PTR_TYPES = {"x_ptr": "*bf16", "act_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
              "cnt_ptr": "*i32", "xp_ptr": "*i32", "ids_ptr": "*i64", "l2p_ptr": "*i32", "tw_ptr": "*fp32", "wp": "*i32",
              "wb": "*i32", "zp": "*fp32", "zb": "*fp32", "gp": "*fp32", "gb": "*fp32"}  # fmt: skip
# arguments the launchers pass as multiples of 16 (pointers too): Triton specializes on it, so must this
_DIVISIBLE = {
    "w_se",
    "s_se",
    "w_sn",
    "stride_x",
    "stride_act",
    "stride_y",
    "stride_out",
    "stride_xp",
    "H",
    "I",
}
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def compile_gemv(
    kernel: str,
    fmt: str,
    block_n: int,
    block_k: int,
    warps: int,
    prefetch: int = 0,
    max_registers: int = 0,
    split: int = 1,
    half_x: int = 0,
    x_pack: bool = False,
    peel: bool = False,
    host_wide: bool = False,
    host_tall: bool = False,
):
    """The compiled `_gate_up_kernel` / `_down_kernel` for sm_90 at the given tile (top-8, 64-pair schedule,
    bf16 activations, K a multiple of the tile, symmetric int4); `max_registers` > 0: ptxas' `maxnreg`, as
    `GemvConfig.max_registers` launches it; `split`: K split over programs (`split_k1` / `split_k2`); `half_x` > 0: NVFP4's packed half word dot
    (`GemvConfig.half_dot`), x's row scale loaded that many values at a time; `x_pack`: x' packed once per
    program, loaded by the K loop (`GemvConfig.half_x_pack`); `peel`: down's first tile loaded ahead of its
    wait (`GemvConfig.down_peel`); `host_wide`: host rows in tiles of half the rows and twice the K as well
    (`GemvConfig.host_wide`); `host_tall`: down's host rows in tiles of twice the rows (`GemvConfig.host_tall`)."""
    fmt_code, vpw, group = FORMATS[fmt]
    fn = gemv._gate_up_kernel if kernel == "gate_up" else gemv._down_kernel
    consts = dict(TOP_K=8, P_POW2=64, BLOCK_N=block_n, BLOCK_K=block_k, FMT=fmt_code, GROUP=group,
                  HAS_ZERO=False, NATIVE_FP8=True, COMPUTE=tl.bfloat16, VPW=vpw, PREFETCH=prefetch,
                  EVEN_K=True, PDL=False, OVERLAP=False)  # fmt: skip
    consts |= {"SPLIT": split, "HALF_X": half_x, "X_PACK": x_pack, "HOST_WIDE": host_wide}
    consts |= {} if kernel == "gate_up" else {"FUSE_COMBINE": True, "PEEL": peel, "HOST_TALL": host_tall}
    scale = "*fp8e4nv" if fmt == "nvfp4" else "*fp32"
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = scale if name in ("sp", "sb") else _PTR_TYPES.get(name, "i32")
        if signature[name].startswith("*") or name in _DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, consts, attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={
            "num_warps": warps,
            "num_stages": 1,
            **({"maxnreg": max_registers} if max_registers else {}),
        },
    )


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def resources(compiled) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from `cuobjdump -res-usage`; a stack without calls is
    where ptxas spills registers."""
    match = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(compiled, "-res-usage"))
    assert match, "cuobjdump -res-usage printed no REG / STACK counts"
    return int(match.group(1)), int(match.group(2))


def loop_profile(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the longest loop: the span from a backward branch's target to it."""
    instructions = [
        (int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTRUCTION.match, sass.splitlines()) if m
    ]
    best = (0, 0, -1)
    for address, text in instructions:
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            count = (address - start) // 16 + 1
            if count > best[0]:
                best = (count, start, address)
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
        for address, text in instructions
        if best[1] <= address <= best[2]
    )
    return best[0], ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", choices=sorted(FORMATS), default="int4")
    ap.add_argument("--kernel", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--block-n", type=int, default=32, help="rows (gate_up: of gate, as many of up)")
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument(
        "--prefetch", type=int, default=0, help="0 none, 1 register prefetch, >= 2 pipeline stages"
    )
    ap.add_argument("--max-registers", type=int, default=0, help="ptxas maxnreg (0: none), as GemvConfig's")
    ap.add_argument("--split", type=int, default=1, help="K split over programs (split_k1 / split_k2)")
    ap.add_argument(
        "--half-x", type=int, default=0, help="half dot (NVFP4, int4): x values of the row scale at once"
    )
    ap.add_argument(
        "--x-pack", action="store_true", help="with --half-x: x' packed once, loaded by the K loop"
    )
    ap.add_argument("--peel", action="store_true", help="down: the first tile ahead (GemvConfig.down_peel)")
    ap.add_argument(
        "--host-wide", action="store_true", help="host rows' own tiles too (GemvConfig.host_wide)"
    )
    ap.add_argument(
        "--host-tall",
        action="store_true",
        help="down: host rows in tiles of twice the rows (GemvConfig.host_tall)",
    )
    ap.add_argument("--dump", default=None, help="write the whole SASS here")
    args = ap.parse_args()
    compiled = compile_gemv(
        args.kernel,
        args.fmt,
        args.block_n,
        args.block_k,
        args.warps,
        args.prefetch,
        args.max_registers,
        args.split,
        args.half_x,
        args.x_pack,
        args.peel,
        args.host_wide,
        args.host_tall,
    )
    sass = _cuobjdump(compiled, "-sass")
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    count, ops = loop_profile(sass)
    rows = 2 * args.block_n if args.kernel == "gate_up" else args.block_n
    words = rows * args.block_k // FORMATS[args.fmt][1] // (32 * args.warps)
    regs, stack = resources(compiled)
    print(f"triton {triton.__version__}, {args.kernel} {args.fmt} BN {args.block_n} BK {args.block_k} warps "
          f"{args.warps} prefetch {args.prefetch} split {args.split}{' x-pack' if args.x_pack else ''}: {regs} registers, {stack} stack bytes, K loop {count} instructions "
          f"for {words} words per thread")  # fmt: skip
    print(" ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
