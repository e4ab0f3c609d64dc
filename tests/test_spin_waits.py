"""The spin waits of the one-launch kernels, checked in the PTX that Triton emits for sm_90 (no GPU needed).

A wait in Triton is a loop on a volatile load that every thread runs on its own, so the warps of a program
leave it at different times; the arrival after it is one thread's atomic. Where the word (or counter) waited on
is reset by the last arriver, a warp of another program still in the loop then would spin forever (the plan +
copy's `_wait_for_plan`) or poll to its limit (the one-launch GEMV's `_wait_for_act`). So between the loop's
last load and the arrival there must be a CTA barrier: then a program arrives only once all its warps have left
the loop. Before 2026-12-02 the plan's wait had one only by accident, in the plain grid's roles by ticket, and
none with the cooperative launch (the hang was never observed: bench/sync_stress.py). The interpreter runs a
program's threads in lockstep and cannot show this; the PTX does. The kernels compiled here are small wrappers
around the two wait functions (the real kernels call the same functions), compiled in a fresh process
(`tests/spin_wait_ptx.py`: the interpreter the other CPU tests use patches `triton.language` meanwhile).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    """The PTX of every case of `tests/spin_wait_ptx.py`, compiled in a fresh process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.spin_wait_ptx"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"compiling the spin waits failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


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
def test_plan_wait_arrives_only_after_every_warp_saw_the_plan(ptx: dict[str, str], num_warps: int) -> None:
    _barrier_between_poll_and_arrival(
        _instructions(ptx[f"plan-{num_warps}"]), r"\batom\.global\.gpu\.acquire\.add\b"
    )


@pytest.mark.parametrize("num_warps", [1, 4])
def test_gemv_one_wait_counts_a_tile_only_after_every_warp_saw_its_act(
    ptx: dict[str, str], num_warps: int
) -> None:
    ins = _instructions(ptx[f"act-{num_warps}"])
    # poll, barrier, acquire of the act (Triton emits the unused atomic as an acquire load), barrier (every
    # warp's later act loads follow it), then the count past the wait that lets the last waiter reset `ready`
    _barrier_between_poll_and_arrival(ins, r"\b(ld|atom)\.global\.gpu\.acquire\b")
    acquire = next(i for i, line in enumerate(ins) if re.search(r"\b(ld|atom)\.global\.gpu\.acquire\b", line))
    passed = next(i for i, line in enumerate(ins) if re.search(r"\batom\.global\.gpu\.relaxed\.add\b", line))
    assert acquire < passed, (acquire, passed)
    assert any(BARRIER.match(line) for line in ins[acquire + 1 : passed]), ins[acquire : passed + 1]
