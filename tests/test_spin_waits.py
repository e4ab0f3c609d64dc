"""The spin waits of the one-launch kernels, checked in the PTX that Triton emits for sm_90 (no GPU needed).

A wait in Triton is a loop on a volatile load that every thread runs on its own, so the warps of a program
leave it at different times; the arrival after it is one thread's atomic. Where the word (or counter) waited on
is reset by the last arriver, a warp of another program still in the loop then would spin forever (the plan +
copy's `_wait_for_plan`) or poll to its limit (the one-launch GEMV's `_wait_for_act`). So between the loop's
last load and the arrival there must be a CTA barrier: then a program arrives only once all its warps have left
the loop. Before 2026-12-02 the plan's wait had one only by accident, in the plain grid's roles by ticket, and
none with the cooperative launch (the hang was never observed: bench/sync_stress.py). The interpreter runs a
program's threads in lockstep and cannot show this; the PTX does. The kernels compiled here are small wrappers
around the two wait functions (the real kernels call the same functions).
"""

from __future__ import annotations

import re

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tests.interpreter import interpreter_imports

with interpreter_imports():
    from pooled_runner.kernels import gemv, plan_sync  # noqa: F401 (gemv first: it imports gemv_one at its end)
    from pooled_runner.kernels.gemv_one import _wait_for_act as _act_wait


def _compiled(fn) -> JITFunction:
    """`fn` as a compiled-mode JITFunction (under the interpreter, `triton.jit` gave an interpreted one)."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


_wait_for_plan = _compiled(plan_sync._wait_for_plan)
_wait_for_act = _compiled(_act_wait)


def _plan_wait_kernel(sync_ptr, out_ptr, num_programs):
    tl.store(out_ptr, _wait_for_plan(sync_ptr, num_programs))


def _act_wait_kernel(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit):
    _wait_for_act(sync_ptr, ready_ptr, passed_ptr, pair, nb1, nb2, spin_limit)


def _ptx(kernel, signature: dict[str, str], num_warps: int) -> str:
    src = ASTSource(fn=JITFunction(kernel), signature=signature, constexprs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def _instructions(ptx: str) -> list[str]:
    """The body's instruction lines, comments and debug directives dropped."""
    body = ptx[ptx.index(".entry") : ptx.index("$L__func_end0")]
    lines = [line.split("//")[0].strip() for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith((".loc", ".reg", ".param"))]


BARRIER = re.compile(r"^(bar|barrier)(\.cta)?\.sync\b")  # bar.sync 0, barrier.sync ...


def _barrier_between_poll_and_arrival(ins: list[str], arrival: str) -> None:
    """The last polling load comes before the first `arrival` atomic, with a `bar.sync` between them."""
    polls = [i for i, line in enumerate(ins) if re.search(r"\bld\.volatile\.global\b", line)]
    arrivals = [i for i, line in enumerate(ins) if re.search(arrival, line)]
    assert polls and arrivals, (
        f"no polling load ({len(polls)}) or arrival ({len(arrivals)}) in:\n" + "\n".join(ins)
    )
    last_poll, first_arrival = polls[-1], arrivals[0]
    assert last_poll < first_arrival, f"poll at {last_poll} after the arrival at {first_arrival}"
    between = ins[last_poll + 1 : first_arrival]
    assert any(BARRIER.match(line) for line in between), (
        "no CTA barrier between the last poll and the arrival:\n" + "\n".join(between)
    )


@pytest.mark.parametrize("num_warps", [1, 4, 8])
def test_plan_wait_arrives_only_after_every_warp_saw_the_plan(num_warps: int) -> None:
    ptx = _ptx(_plan_wait_kernel, {"sync_ptr": "*i32", "out_ptr": "*i32", "num_programs": "i32"}, num_warps)
    _barrier_between_poll_and_arrival(_instructions(ptx), r"\batom\.global\.gpu\.acquire\.add\b")


@pytest.mark.parametrize("num_warps", [1, 4])
def test_gemv_one_wait_counts_a_tile_only_after_every_warp_saw_its_act(num_warps: int) -> None:
    sig = {name: "*i32" for name in ("sync_ptr", "ready_ptr", "passed_ptr")}
    sig |= {name: "i32" for name in ("pair", "nb1", "nb2", "spin_limit")}
    ins = _instructions(_ptx(_act_wait_kernel, sig, num_warps))
    # poll, barrier, acquire of the act (Triton emits the unused atomic as an acquire load), barrier (every
    # warp's later act loads follow it), then the count past the wait that lets the last waiter reset `ready`
    _barrier_between_poll_and_arrival(ins, r"\b(ld|atom)\.global\.gpu\.acquire\b")
    acquire = next(i for i, line in enumerate(ins) if re.search(r"\b(ld|atom)\.global\.gpu\.acquire\b", line))
    passed = next(i for i, line in enumerate(ins) if re.search(r"\batom\.global\.gpu\.relaxed\.add\b", line))
    assert acquire < passed, (acquire, passed)
    assert any(BARRIER.match(line) for line in ins[acquire + 1 : passed]), ins[acquire : passed + 1]
