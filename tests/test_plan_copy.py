"""The one-launch plan + admission copy (`kernels/plan_copy.py`) under the Triton interpreter, against the
two-launch path it replaces (`plan_lru` then `gather_rows_multi`, both kernels) and its plain reference:
random residency states at awkward sizes, several steps with misses and evictions, cycle protection, telemetry,
1-8 operands of different dtypes and row sizes (rows longer than a block, so several chunks), programs fewer
and more than the work. Every table, counter, telemetry word, admitted pair and pool row equal, exactly; the
sync words back to zero after every launch. Then the DevicePlanner with it against the two-launch planner on an
int4-like pool of six operands."""

from __future__ import annotations

import random

import pytest
import torch
from pooled_runner.kernels import plan_lru as plan_lru_module
from pooled_runner.kernels.plan_copy import (
    MAX_FUSED_OPERANDS,
    SYNC_WORDS,
    plan_lru_copy,
    plan_lru_copy_reference,
)
from pooled_runner.kernels.plan_lru import plan_lru
from pooled_runner.kernels.row_gather import MAX_MULTI_OPERANDS, gather_rows_multi

from pooled_runner.bank import ExpertBank
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.formats.base import OperandSpec
from pooled_runner.planner import DevicePlanner
from pooled_runner.policies import FreqDecayPolicy, LRUPolicy
from pooled_runner.pool import ExpertPool
from pooled_runner.telemetry import RouteTelemetry
from tests.test_plan_lru import random_state

DTYPES = (torch.bfloat16, torch.int32, torch.uint8, torch.float32, torch.float16, torch.int8)
NUMELS = (7, 4097, 3, 1, 8193, 5, 2, 9)  # 4097, 8193: more than one 4096-element copy block


def random_rows(num_ops: int, R: int, N: int, g: torch.Generator) -> tuple[list, list]:
    """Pool rows `[R, n_i]` and bank rows `[N, n_i]` of `num_ops` operands with fresh random values."""
    rows: list[torch.Tensor] = []
    hosts: list[torch.Tensor] = []
    for i in range(num_ops):
        dtype, n = DTYPES[i % len(DTYPES)], NUMELS[(i + num_ops) % len(NUMELS)]
        for out, count in ((rows, R), (hosts, N)):
            if dtype.is_floating_point:
                out.append((torch.randn(count, n, generator=g) * 30).to(dtype))
            else:
                out.append(
                    torch.randint(-100 if dtype != torch.uint8 else 0, 100, (count, n), generator=g).to(dtype)
                )
    return rows, hosts


def two_launches(
    plan_args: tuple, rows: list, hosts: list, offset: int, sync: torch.Tensor, P: int, C: int
) -> None:
    """The path being replaced: the plan kernel, then the multi-operand gather kernel per four operands."""
    plan_lru(*plan_args)
    victims, codes, valid, R = plan_args[7], plan_args[8], plan_args[9], plan_args[13]
    for i in range(0, len(rows), MAX_MULTI_OPERANDS):
        group = slice(i, i + MAX_MULTI_OPERANDS)
        gather_rows_multi(
            rows[group], hosts[group], victims, codes, valid, R, offset, force_triton=True, chunk_programs=C
        )


def one_launch(
    plan_args: tuple, rows: list, hosts: list, offset: int, sync: torch.Tensor, P: int, C: int
) -> None:
    plan_lru_copy(*plan_args, rows, hosts, offset, sync, num_programs=P, chunk_programs=C)


def one_launch_deferred(
    plan_args: tuple, rows: list, hosts: list, offset: int, sync: torch.Tensor, P: int, C: int
) -> None:
    """The one launch that lets the next kernel start beside it: the admitted codes are committed by the last
    program to finish its copies (`_commit_admitted`; the trigger itself is a no-op off the GPU)."""
    plan_lru_copy(*plan_args, rows, hosts, offset, sync, num_programs=P, chunk_programs=C, early_trigger=True)


def reference(
    plan_args: tuple, rows: list, hosts: list, offset: int, sync: torch.Tensor, P: int, C: int
) -> None:
    plan_lru_copy_reference(*plan_args, rows, hosts, offset, sync, num_programs=P, chunk_programs=C)


@pytest.mark.parametrize("trial", range(14))
def test_one_launch_equals_two_launches_and_reference(trial: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if trial % 4 == 3:  # token counts by atomics in global memory, not in registers (the path of wide steps)
        monkeypatch.setattr(plan_lru_module, "MAX_COUNT_MATRIX", 0)
    rnd = random.Random(1000 + trial)
    L, E = rnd.randint(1, 3), rnd.choice([1, 3, 7, 16, 33])
    EM, R = E + rnd.randint(0, 2), rnd.choice([1, 2, 5, 9, 33])
    T, K = rnd.choice([1, 2, 7]), rnd.randint(1, min(4, E))
    bm = rnd.choice([16, 2])
    num_ops = [1, 2, 3, 4, 5, 6, 8][trial % 7]
    P, C = rnd.choice([1, 2, 3, 32]), rnd.choice([1, 2, 3])
    g = torch.Generator().manual_seed(trial)
    state = random_state(L, EM, E, R, 1000 + trial)
    if trial % 2:  # cycle protection, the previous cycle begun mid-history
        clock = int(state["clock"][0])
        state["cycle"] = torch.tensor([L - 1, clock // 2 + 1, clock // 3], dtype=torch.int64)
    if trial % 3:  # route telemetry inside the plan, saturating at 9
        state["tel_counts"] = torch.randint(0, 9, (L * EM + 1,), generator=g)
        state["tel_routed"] = state["tel_counts"] > 4
        state["tel_flags"] = torch.zeros(2, dtype=torch.int32)
    rows, hosts = random_rows(num_ops, R, L * E, g)
    paths = {
        "one launch": one_launch,
        "one launch, deferred commit": one_launch_deferred,
        "two launches": two_launches,
        "reference": reference,
    }
    runs = {name: ({k: v.clone() for k, v in state.items()}, [r.clone() for r in rows]) for name in paths}
    syncs = {name: torch.zeros(SYNC_WORDS, dtype=torch.int32) for name in paths}
    for step in range(5):
        layer = rnd.randrange(L) if step % 2 else step % L
        ids = torch.randint(-2, E + 2, (T * K,), generator=g).to(rnd.choice([torch.int32, torch.int64]))
        num_pairs = min(E, R, T * K)
        outs = {}
        for name, fn in paths.items():
            st, pool_rows = runs[name]
            out = [torch.full((num_pairs,), 99, dtype=torch.int32) for _ in range(3)]  # victims, codes, valid
            counts = torch.full((EM,), 7, dtype=torch.int32)
            tel = (st["tel_counts"], st["tel_routed"], st["tel_flags"], 9) if "tel_counts" in st else None
            plan_args: tuple = (
                ids,
                st["l2p"],
                st["row_owner"],
                st["row_stamp"],
                st["clock"],
                st["counters"],
                counts,
            )
            plan_args += (*out, layer, E, EM, R, bm, 1 if bm == 16 else 2, st.get("cycle"), tel)
            fn(plan_args, pool_rows, hosts, layer * E, syncs[name], P, C)
            outs[name] = out
        where = f"trial {trial} step {step} (ops {num_ops}, P {P}, C {C})"
        want_state, want_rows = runs["reference"]
        for name in ("one launch", "one launch, deferred commit", "two launches"):
            st, pool_rows = runs[name]
            for key in want_state:
                bad = (st[key] != want_state[key]).nonzero().flatten().tolist()
                assert not bad, f"{where}: {name} {key} differs at {bad[:5]}: {st[key]} vs {want_state[key]}"
            valid = outs["reference"][2] != 0  # entries past the admissions are don't-care
            assert torch.equal(outs[name][2], outs["reference"][2]), f"{where}: {name} valid"
            for got, exp in zip(outs[name][:2], outs["reference"][:2]):
                assert torch.equal(got[valid], exp[valid]), f"{where}: {name} pairs {got} vs {exp}"
            for i, (got, exp) in enumerate(zip(pool_rows, want_rows)):
                bad = (got != exp).nonzero().tolist()
                assert not bad, f"{where}: {name} operand {i} rows differ at {bad[:5]}"
            assert syncs[name].tolist() == [0] * SYNC_WORDS, f"{where}: {name} sync {syncs[name]}"
        for row, flat in enumerate(want_state["row_owner"][:R].tolist()):  # admitted rows hold the bank's
            if flat >= 0 and flat // EM == layer and bool((outs["reference"][0][valid] == row).any()):
                for got, host in zip(runs["one launch"][1], hosts):
                    assert torch.equal(got[row], host[layer * E + flat % EM]), f"{where}: row {row}"


@pytest.mark.parametrize("deferred", [False, True])
def test_one_launch_admits_evicts_and_protects(deferred: bool) -> None:
    """A fixed scenario that cannot pass vacuously: admissions, evictions, a cycle-protected refusal, 6
    operands, P below and above the work (one program included), rows equal to the bank's afterwards and the
    location table naming exactly the rows' owners; `deferred`: the codes committed after the copies
    (`early_trigger`, by the last program to finish its copies)."""
    L, E, R = 3, 5, 4
    g = torch.Generator().manual_seed(5)
    rows, hosts = random_rows(6, R, L * E, g)
    before = [r.clone() for r in rows]
    l2p = (R + torch.arange(E, dtype=torch.int32)).repeat(L)
    owner, stamp = torch.full((R + 1,), -1), torch.full((R + 1,), -1)
    clock, counters = torch.zeros(1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    cycle = torch.tensor([L - 1, 0, 0])
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32)
    steps = [(0, [0, 1, 2]), (1, [0, 1]), (2, [3, 4]), (0, [0, 3]), (1, [2])]
    for P, (layer, experts) in zip([1, 2, 5, 32, 3], steps):
        out = [torch.zeros(len(experts), dtype=torch.int32) for _ in range(3)]
        args: tuple = (
            torch.tensor(experts),
            l2p,
            owner,
            stamp,
            clock,
            counters,
            torch.zeros(E, dtype=torch.int32),
        )
        args += (*out, layer, E, E, R, 16, 1, cycle, None)
        plan_lru_copy(
            *args, rows, hosts, layer * E, sync, num_programs=P, chunk_programs=2, early_trigger=deferred
        )
        assert sync.tolist() == [0] * SYNC_WORDS
    _, _, admissions, host_reads, evictions = counters.tolist()
    assert admissions >= 5 and evictions >= 1 and host_reads >= 1, counters.tolist()
    for row, flat in enumerate(owner[:R].tolist()):
        for got, old, host in zip(rows, before, hosts):
            assert torch.equal(got[row], host[flat // E * E + flat % E] if flat >= 0 else old[row]), row
        if flat >= 0:  # every owned row is named by its expert's code
            assert int(l2p[flat]) == row, f"l2p[{flat}] = {int(l2p[flat])}, its row is {row}"
    owned = {flat for flat in owner[:R].tolist() if flat >= 0}
    for flat in range(L * E):
        if flat not in owned:
            assert int(l2p[flat]) == R + flat % E, f"l2p[{flat}] = {int(l2p[flat])}: not resident"


def test_plan_lru_copy_rejects_bad_arguments() -> None:
    state = random_state(1, 4, 4, 3, 0)
    out = [torch.zeros(2, dtype=torch.int32) for _ in range(3)]
    args: tuple = (torch.tensor([0, 1]), state["l2p"], state["row_owner"], state["row_stamp"], state["clock"])
    args += (state["counters"], torch.zeros(4, dtype=torch.int32), *out, 0, 4, 4, 3, 16, 1, None, None)
    rows, hosts = random_rows(2, 3, 4, torch.Generator().manual_seed(0))
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32)
    with pytest.raises(ValueError, match="row operands"):
        plan_lru_copy(*args, rows * 5, hosts * 5, 0, sync)
    assert len(rows * 5) > MAX_FUSED_OPERANDS
    with pytest.raises(ValueError, match="row operands"):
        plan_lru_copy(*args, rows, hosts[:1], 0, sync)
    with pytest.raises(ValueError, match="src_host"):
        plan_lru_copy(*args, rows, hosts[::-1], 0, sync)
    with pytest.raises(ValueError, match="sync"):
        plan_lru_copy(*args, rows, hosts, 0, sync.long())
    with pytest.raises(ValueError, match="num_programs"):
        plan_lru_copy(*args, rows, hosts, 0, sync, num_programs=0)
    with pytest.raises(ValueError, match="num_warps"):
        plan_lru_copy(*args, rows, hosts, 0, sync, num_warps=3)
    with pytest.raises(ValueError, match="num_experts"):
        plan_lru_copy(*args[:11], 5, *args[12:], rows, hosts, 0, sync)
    assert state["clock"].tolist() == [random_state(1, 4, 4, 3, 0)["clock"].item()]  # nothing ran


# ---- the DevicePlanner with the one-launch path against the two-launch planner ----------------------------------
INT4_LIKE = tuple(
    OperandSpec(f"{p}_{part}", shape, dtype)
    for p in ("w13", "w2")
    for part, shape, dtype in (
        ("q", (6, 2), torch.int32),
        ("s", (6, 1), torch.bfloat16),
        ("z", (6, 1), torch.uint8),
    )
)


def int4_like_pool(layers: list[int], rows: int) -> ExpertPool:
    g = torch.Generator().manual_seed(11)
    bank = ExpertBank(INT4_LIKE, layers, pin=False)
    for t in bank.tensors_host.values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 120, t.shape, generator=g))
    return ExpertPool(INT4_LIKE, layers, rows, torch.device("cpu"), bank)


@pytest.mark.parametrize("policy", [LRUPolicy, CycleLRUPolicy])
@pytest.mark.parametrize("overlap", [False, True])
def test_planner_one_launch_equals_two_launches(policy, overlap: bool) -> None:
    layers, rows, K = [9, 6, 11], 7, 3
    planners, tels = [], []
    for one in (True, False):
        pool = int4_like_pool(layers, rows)
        pool.fill([(2, 0), (0, 8)])
        planner = DevicePlanner(
            pool,
            policy(),
            max_routed=4 * K,
            debug_checks=True,
            fused=True,
            one_launch=one,
            overlap=overlap and one,
        )
        assert planner.one_launch is one and planner.overlap is (overlap and one)
        assert not planner.long_plan, "an LRU plan is short: the MoE keeps its default path"
        planners.append(planner)
        tels.append(RouteTelemetry(layers, torch.device("cpu"), fused=True))
    g = torch.Generator().manual_seed(3)
    for step in range(36):
        layer = step % len(layers)
        T = int(torch.randint(0, 5, (1,), generator=g))
        ids = torch.randint(-1, layers[layer] + 1, (T, K), generator=g)
        for planner, tel in zip(planners, tels):
            planner.plan(layer, ids, tel)
        a, b = planners[0].state(), planners[1].state()
        for key in a:
            assert torch.equal(a[key], b[key]), f"step {step}: {key} {a[key]} vs {b[key]}"
        used = planners[0].row_owner[:rows] >= 0  # rows never filled hold whatever memory held
        for name, t in planners[0].pool.rows_gpu.items():
            assert torch.equal(t[used], planners[1].pool.rows_gpu[name][used]), f"step {step}: rows of {name}"
    c = planners[0].counter_values()
    assert c == planners[1].counter_values() and c["admissions"] > 0 and c["evictions"] > 0, c
    sa, sb = tels[0].snapshot(), tels[1].snapshot()
    assert (
        torch.equal(sa.counts, sb.counts)
        and torch.equal(sa.routed, sb.routed)
        and sa.poisoned
        and sb.poisoned
    )
    EM, bank = planners[0].max_experts, planners[0].pool.bank
    assert bank is not None
    for row, flat in enumerate(planners[0].row_owner[:rows].tolist()):  # rows hold their owners' bank rows
        for name, t in planners[0].pool.rows_gpu.items():
            assert torch.equal(t[row], bank.row(flat // EM, flat % EM)[name]), row
    assert planners[0]._sync32.tolist() == [0] * SYNC_WORDS


def test_planner_one_launch_needs_the_fused_planner() -> None:
    pool = int4_like_pool([4], 2)
    with pytest.raises(ValueError, match="one_launch needs the fused planner"):
        DevicePlanner(pool, LRUPolicy(), fused=False, one_launch=True)
    assert DevicePlanner(pool, LRUPolicy(), fused=False).one_launch is False


def test_overlap_needs_the_one_launch() -> None:
    """Only the one launch defers the admitted codes to after their copy: overlap without it is refused."""
    pool = int4_like_pool([5, 4], 3)
    with pytest.raises(ValueError, match="one-launch"):
        DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=True, one_launch=False, overlap=True)
    with pytest.raises(ValueError, match="one-launch"):
        DevicePlanner(pool, FreqDecayPolicy(), max_routed=8, overlap=True)
    # the default where PDL is (not on the CPU: nothing could run beside the plan there)
    assert not DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=True, one_launch=True).overlap


@pytest.mark.parametrize("pdl_here", [False, True])
def test_overlap_and_launch_defaults_follow_the_environment(
    monkeypatch: pytest.MonkeyPatch, pdl_here: bool
) -> None:
    """POOLED_RUNNER_PLAN_OVERLAP / _PDL / _COOPERATIVE set the planner's defaults (on / on / off unset; overlap
    only where the device has PDL, faked here); explicit arguments win."""
    import pooled_runner.planner as planner_module

    monkeypatch.setattr(planner_module, "pdl_available", lambda t: pdl_here)
    pool = int4_like_pool([5, 4], 3)
    for name in ("PLAN_OVERLAP", "PLAN_PDL", "PLAN_COOPERATIVE", "PLAN_SPLIT_COPY"):
        monkeypatch.delenv(f"POOLED_RUNNER_{name}", raising=False)
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=True)
    assert (planner.overlap, planner._pdl, planner._cooperative) == (pdl_here, True, False)
    monkeypatch.setenv("POOLED_RUNNER_PLAN_OVERLAP", "0")
    monkeypatch.setenv("POOLED_RUNNER_PLAN_PDL", "0")
    monkeypatch.setenv("POOLED_RUNNER_PLAN_COOPERATIVE", "1")
    planner = DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=True)
    assert (planner.overlap, planner._pdl, planner._cooperative) == (False, False, True)
    assert DevicePlanner(pool, LRUPolicy(), max_routed=8, fused=True, overlap=True).overlap  # explicit wins


class _Recorder:
    """Stands in for the jitted kernel: `kernel[grid](*args, **kwargs)` records the grid and keywords."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


@pytest.mark.parametrize("cooperative", [None, True])
@pytest.mark.parametrize("num_programs", [1, 2, 7])
def test_plain_grid_takes_roles_by_ticket(
    monkeypatch: pytest.MonkeyPatch, num_programs: int, cooperative: bool | None
) -> None:
    """A plain grid of P > 1 programs is compiled to take its roles by ticket (`plan_sync._draw_ticket`); one
    program needs none. Off CUDA a cooperative launch is never asked for, even with cooperative=True: the grid
    is plain and takes tickets. (The ticket path itself runs in every interpreter test above, where P > 1, and
    leaves every sync word zero; the cooperative path, roles by program id, runs on the GPU only.)"""
    from pooled_runner.kernels import admit_copy, plan_copy

    g = torch.Generator().manual_seed(5)
    state = random_state(2, 6, 6, 4, 0)
    out = [torch.zeros(6, dtype=torch.int32) for _ in range(3)]
    args: tuple = (
        torch.tensor([0, 3, 5]),
        state["l2p"],
        state["row_owner"],
        state["row_stamp"],
        state["clock"],
    )
    args += (state["counters"], torch.zeros(6, dtype=torch.int32), *out, 0, 6, 6, 4, 16, 1, None, None)
    rows, hosts = random_rows(2, 4, 6, g)
    k = _Recorder()
    monkeypatch.setattr(plan_copy, "_plan_copy_kernel", k)
    monkeypatch.setattr(admit_copy, "cooperative_launch_supported", lambda: True)  # as on a recent Triton
    sync = torch.zeros(plan_copy.SYNC_WORDS, dtype=torch.int32)
    plan_copy.plan_lru_copy(
        *args, rows, hosts, 0, sync, num_programs=num_programs, chunk_programs=4, cooperative=cooperative
    )
    ((grid, kwargs),) = k.calls
    assert grid == (num_programs,), grid
    assert kwargs["TICKET"] is (num_programs > 1), kwargs["TICKET"]
    assert "launch_cooperative_grid" not in kwargs, kwargs
