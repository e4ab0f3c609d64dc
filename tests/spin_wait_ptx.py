"""Compile small wrappers of the one-launch kernels' spin waits to sm_90 PTX and print them as JSON (for
tests/test_spin_waits.py, which runs this in a fresh process: Triton's interpreter, which the CPU tests use,
patches `triton.language` while it runs kernels, and a compile in the same process can then see those patches).
Needs no GPU. Usage: python -m tests.spin_wait_ptx"""

from __future__ import annotations

import json
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile-only: run without TRITON_INTERPRET"

from pooled_runner.kernels import gemv  # noqa: E402,F401 (imports gemv_one at its end)
from pooled_runner.kernels.gemv_one import _wait_for_act  # noqa: E402
from pooled_runner.kernels.plan_sync import _wait_for_plan  # noqa: E402


@triton.jit
def _plan_wait_kernel(sync_ptr, out_ptr, num_programs):
    tl.store(out_ptr, _wait_for_plan(sync_ptr, num_programs))


@triton.jit
def _act_wait_kernel(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit):
    _wait_for_act(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit)


PLAN_SIGNATURE = {"sync_ptr": "*i32", "out_ptr": "*i32", "num_programs": "i32"}
ACT_SIGNATURE = {name: "*i32" for name in ("sync_ptr", "ready_ptr", "passed_ptr")} | {
    name: "i32" for name in ("pair", "nb1", "nb2", "spin_limit")
}
CASES = {f"plan-{w}": (_plan_wait_kernel, PLAN_SIGNATURE, w) for w in (1, 4, 8)} | {
    f"act-{w}": (_act_wait_kernel, ACT_SIGNATURE, w) for w in (1, 4)
}


def compile_all() -> dict[str, str]:
    """PTX of every case in CASES (wrapper, signature, num_warps), by case name."""
    target = GPUTarget("cuda", 90, 32)
    return {
        name: triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs={}),
            target=target,
            options={"num_warps": warps},
        ).asm["ptx"]
        for name, (kernel, signature, warps) in CASES.items()
    }


if __name__ == "__main__":
    print(json.dumps(compile_all()))
