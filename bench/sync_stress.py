"""Stress of the one-launch plan + copy's wait (`kernels/plan_sync._wait_for_plan`): why a CTA barrier sits
between the wait loop and the arrival.

One launch of P programs (roles by program id, as the cooperative launch takes them): program 0 publishes a
word after a short nap; the others poll it, arrive (one thread's atomic), and the last arriver resets the word
to 0. In Triton every thread polls on its own, so without a barrier a program can arrive while another of its
warps still polls; if the last arriver's reset lands before that warp's next poll, it polls forever. (The last
arriver's own warps are safe: its reset follows the barrier of its arrival's broadcast.) Variants:
  - `racy`: the wait as it was before 2026-12-02 (no barrier); every warp but the first naps `--nap-ns` between
    polls (`nanosleep`, which sleeps up to about twice that), so the first warp arrives while the others lag;
  - `barrier`: the same with the barrier (as the wait is now);
  - `shipped`: `_wait_for_plan` itself, no nap.
(A plain grid's roles by ticket, `_draw_ticket`, had a barrier there already: Triton's shared-memory analysis
puts one before the arrival's broadcast, which reuses the ticket's. Roles by program id had none.)
Each variant runs in a child process under a time limit (a hung kernel cannot be interrupted from the host; the
child is killed, which ends its context). Graph replay of `--per-graph` launches until `--launches` or the
limit. Prints and writes (`--out`) a table: launches done, seconds, finished or hung.
On the H200 (2026-12-02) an earlier form, where every warp napped 500 ns, finished 300,000 launches in all three
variants: its window was too narrow to show the race. The lagging-warp nap above has not run on a GPU yet.

    python -m bench.sync_stress [--variants racy,barrier,shipped] [--launches 200000] [--limit 30]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl
from pooled_runner.kernels.plan_sync import _ARRIVAL, SYNC_WORDS, _wait_for_plan

from bench.common import commit_id, print_table, write

VARIANTS = ("racy", "barrier", "shipped")


# every thread but those of the first warp sleeps `ns` (so the first warp leaves the loop first)
_LAGGING_NAP = tl.constexpr("""{
    .reg .u32 %nap_tid;
    .reg .pred %nap_lag;
    mov.u32 %nap_tid, %tid.x;
    setp.ge.u32 %nap_lag, %nap_tid, 32;
    @%nap_lag nanosleep.u32 $1;
    mov.u32 $0, $1;
}""")


@triton.jit
def _nap(ns, NAP: tl.constexpr):
    if NAP:
        tl.inline_asm_elementwise(_LAGGING_NAP, "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stress_kernel(sync_ptr, out_ptr, nap_ns, VARIANT: tl.constexpr, NAP: tl.constexpr):
    num_programs = tl.num_programs(0)
    role = tl.program_id(0)  # P small enough to be resident at once
    if role == 0:
        _nap(nap_ns, NAP)  # let the others start polling
        tl.debug_barrier()
        tl.atomic_xchg(sync_ptr, 5, sem="release", scope="gpu")
        n = tl.full([], 4, tl.int32)
    elif VARIANT == 2:  # shipped
        n = _wait_for_plan(sync_ptr, num_programs)
    else:
        seen = tl.load(sync_ptr, volatile=True)
        while seen == 0:
            _nap(nap_ns, NAP)
            seen = tl.load(sync_ptr, volatile=True)
        if VARIANT == 1:
            tl.debug_barrier()
        word = tl.atomic_add(sync_ptr, _ARRIVAL, sem="acquire", scope="gpu")
        if word // _ARRIVAL == num_programs - 2:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        n = word % _ARRIVAL - 1
    tl.store(out_ptr + role, n)


def _child(variant: str, programs: int, warps: int, nap_ns: int, launches: int, per_graph: int) -> None:
    """Run `launches` launches of `variant`; print `done N` after each graph replay (flushed)."""
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device="cuda")
    out = torch.zeros(programs, dtype=torch.int32, device="cuda")
    code = VARIANTS.index(variant)

    def launch() -> None:
        _stress_kernel[(programs,)](sync, out, nap_ns, VARIANT=code, NAP=code < 2, num_warps=warps)

    launch()  # compile
    torch.cuda.synchronize()
    assert out.eq(4).all().item() and sync.eq(0).all().item(), (out.tolist(), sync.tolist())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            launch()
    done = 0
    while done < launches:
        graph.replay()
        torch.cuda.synchronize()
        done += per_graph
        print(f"done {min(done, launches)}", flush=True)  # whole graphs: the last may pass `launches`
    assert out.eq(4).all().item() and sync.eq(0).all().item(), (out.tolist(), sync.tolist())


def _run(variant: str, args: argparse.Namespace) -> list[object]:
    cmd = [sys.executable, "-m", "bench.sync_stress", "--child", variant, "--programs", str(args.programs)]
    cmd += ["--warps", str(args.warps), "--nap-ns", str(args.nap_ns), "--launches", str(args.launches)]
    cmd += ["--per-graph", str(args.per_graph)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
        stdout, outcome = (
            proc.stdout,
            "finished" if proc.returncode == 0 else f"failed (rc {proc.returncode})",
        )
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        stdout = out.decode() if isinstance(out, bytes) else out
        outcome = f"hung (killed after {args.limit:.0f} s)"
    seconds = time.perf_counter() - t0
    done = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("done ")]
    return [variant, done[-1] if done else 0, seconds, outcome]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--programs", type=int, default=4, help="P: programs per launch (3 spinners)")
    parser.add_argument("--warps", type=int, default=8, help="warps per program")
    parser.add_argument("--nap-ns", type=int, default=20_000, help="lagging warps' nap between polls")
    parser.add_argument("--launches", type=int, default=200_000)
    parser.add_argument("--per-graph", type=int, default=500, help="launches per captured graph")
    parser.add_argument(
        "--limit", type=float, default=30.0, help="seconds per variant before it counts as hung"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    if args.programs < 3:
        raise SystemExit(
            f"--programs {args.programs}: needs >= 3 (with one spinner it is its own last arriver)"
        )
    if args.warps < 2 or args.launches < 1 or args.per_graph < 1 or args.nap_ns < 0 or args.limit <= 0:
        raise SystemExit(
            f"--warps {args.warps} (>= 2: the lagging warps), --launches {args.launches}, --per-graph "
            f"{args.per_graph} (>= 1), --nap-ns {args.nap_ns} (>= 0), --limit {args.limit} (> 0)"
        )
    if args.child:
        _child(args.child, args.programs, args.warps, args.nap_ns, args.launches, args.per_graph)
        return
    if not torch.cuda.is_available():
        raise SystemExit("the sync stress needs CUDA")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {VARIANTS}")
    rows = [_run(v, args) for v in variants]
    lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, commit {args.commit or commit_id()}; "
        f"P={args.programs} programs of {args.warps} warps; racy and barrier: warps 1.. nap {args.nap_ns} ns "
        "between polls",
        "",
        print_table(
            "Spin wait + last-arriver reset under stress", ["variant", "launches done", "s", "outcome"], rows
        ),
        "",
        "racy: no CTA barrier between the wait loop and the arrival (the wait before 2026-12-02); barrier: with "
        "it; shipped: kernels/plan_sync._wait_for_plan as it is, no nap; roles by program id in all three; "
        "'hung': the child still ran at the time limit and was killed.",
    ]
    print(lines[0], flush=True)
    write(args.out, lines)


if __name__ == "__main__":
    main()
