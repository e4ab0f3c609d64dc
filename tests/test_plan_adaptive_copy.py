"""The adaptive policies' one-launch plan + admission copy (`kernels/plan_adaptive_copy.py`) under the Triton
interpreter, against its reference (`plan_adaptive_reference` then the row gather's reference) and the two-launch
path it replaces (`plan_adaptive` then `gather_rows_multi`, both kernels): random residency and policy states at
awkward sizes (empty steps, K > E, one expert, rows longer than a copy block), both modes, with and without the
router (one order or the duel's two), 1-8 operands, programs fewer and more than the work, with and without the
deferred commit. Every table, policy word, pair, counter and pool row equal, exactly; the sync words back to zero
after every launch."""

from __future__ import annotations

import random

import pytest
import torch
from pooled_runner.kernels.plan_adaptive import AdaptiveRule, plan_adaptive
from pooled_runner.kernels.plan_adaptive_copy import plan_adaptive_copy, plan_adaptive_copy_reference
from pooled_runner.kernels.plan_sync import SYNC_WORDS
from pooled_runner.kernels.row_gather import MAX_MULTI_OPERANDS, gather_rows_multi

from pooled_runner.policy_adaptive import ONE, SCORE
from tests.test_plan_adaptive import _random_state, _random_tables, _state_dict, _state_from
from tests.test_plan_copy import random_rows


def _two_launches(
    plan_args: tuple, rows: list, hosts: list, offset: int, sync, P: int, C: int, R: int
) -> None:
    plan_adaptive(*plan_args)
    victims, codes, valid = plan_args[7:10]
    for i in range(0, len(rows), MAX_MULTI_OPERANDS):
        group = slice(i, i + MAX_MULTI_OPERANDS)
        gather_rows_multi(
            rows[group], hosts[group], victims, codes, valid, R, offset, force_triton=True, chunk_programs=C
        )


def _one_launch(deferred: bool):
    def run(plan_args: tuple, rows: list, hosts: list, offset: int, sync, P: int, C: int, R: int) -> None:
        plan_adaptive_copy(*plan_args, None, rows, hosts, offset, sync, num_programs=P, chunk_programs=C,
                           early_trigger=deferred)  # fmt: skip

    return run


def _reference(plan_args: tuple, rows: list, hosts: list, offset: int, sync, P: int, C: int, R: int) -> None:
    plan_adaptive_copy_reference(
        *plan_args, None, rows, hosts, offset, sync, num_programs=P, chunk_programs=C
    )


PATHS = {
    "one launch": _one_launch(False),
    "one launch, deferred commit": _one_launch(True),
    "two launches": _two_launches,
    "reference": _reference,
}


@pytest.mark.parametrize("trial", range(14))
def test_one_launch_equals_reference_and_two_launches(trial: int) -> None:
    """Trials 10-13 ("hot"): frequency mode, every row owned, two in three of the owners far hotter than any candidate:
    steps admit into the cold rows, then reject the rest (checked), so the copy and the commit meet pairs with
    `valid = 0` at several geometries."""
    rnd = random.Random(500 + trial)
    L, E = rnd.randint(1, 3), rnd.choice([1, 3, 7, 16, 33])
    EM, R = E + rnd.randint(0, 2), rnd.choice([1, 2, 5, 9, 33])
    R = min(R, L * EM)  # the random tables give each owned row a distinct expert
    T, K = rnd.choice([0, 1, 2, 7]), rnd.randint(1, E + 1)  # K > E: duplicates in a token's ids
    # the duel (two router orders): trial 5 in frequency mode with the fast order chosen, 7 on the order's edge
    router: bool | str = {5: "duel-fast", 7: "duel"}.get(trial, trial % 2 == 1)
    freq_mode = trial % 4 < 2
    num_ops = [1, 2, 3, 5, 6, 8][trial % 6]
    P, C = rnd.choice([1, 2, 3, 32]), rnd.choice([1, 2, 3])
    bm = rnd.choice([16, 2])
    hot = trial >= 10
    if hot:
        h = trial - 10
        L, E, EM, R, T, K, bm, freq_mode = 2, 16, 16, 9, 3, 4, 16, True
        num_ops, P, C = [3, 6, 2, 8][h], [1, 3, 32, 2][h], 2
    g = torch.Generator().manual_seed(trial)
    start = {**_random_tables(L, EM, R, g), **_state_dict(_random_state(L, EM, router, freq_mode, g))}
    if hot:
        _own_every_row_half_hot(start, L, EM, R, router, g)
    empty = trial % 3 == 0  # every row free: each routed miss is admitted (a free victim takes any candidate)
    if empty:
        start["row_owner"][:R] = -1
        start["row_stamp"][:R] = -1
        start["l2p"] = (R + torch.arange(L * EM) % EM).to(torch.int32)
    rule = AdaptiveRule(L, decay_shift=3, duel_shift=2, margin_shift=2, floor=SCORE, bonus=2 * ONE, score=SCORE,
                        one=ONE, member_decay_shift=2, fast_decay_shift=1, order_floor=0)  # fmt: skip
    rows, hosts = random_rows(num_ops, R, L * EM, g)
    runs = {name: ({k: v.clone() for k, v in start.items()}, [r.clone() for r in rows]) for name in PATHS}
    syncs = {name: torch.zeros(SYNC_WORDS, dtype=torch.int32) for name in PATHS}
    num_admitted = num_routed = num_rejected = 0
    for step in range(5):
        layer = rnd.randrange(L) if step % 2 else step % L
        n = T * K if step != 2 else 0  # one empty step
        ids = torch.randint(-2, E + 2, (n,), generator=g).to(rnd.choice([torch.int32, torch.int64]))
        num_pairs = min(E, R, max(n, 1))
        num_routed += int(((ids >= 0) & (ids < E)).sum())
        outs = {}
        for name, fn in PATHS.items():
            st, pool_rows = runs[name]
            out = [torch.full((num_pairs,), 99, dtype=torch.int32) for _ in range(3)]  # victims, codes, valid
            counts = torch.full((EM,), 7, dtype=torch.int32)
            plan_args = (ids, st["l2p"], st["row_owner"], st["row_stamp"], st["clock"], st["counters"], counts,
                         *out, layer, E, EM, R, bm, 1 if bm == 16 else 2, _state_from(st, EM), rule)  # fmt: skip
            fn(plan_args, pool_rows, hosts, layer * EM, syncs[name], P, C, R)
            outs[name] = out
        where = f"trial {trial} step {step} (ops {num_ops}, P {P}, C {C}, router {router})"
        want_state, want_rows = runs["reference"]
        for name in ("one launch", "one launch, deferred commit", "two launches"):
            st, pool_rows = runs[name]
            for key in want_state:
                bad = (st[key] != want_state[key]).nonzero().flatten().tolist()
                assert not bad, f"{where}: {name} {key} differs at {bad[:5]}: {st[key]} vs {want_state[key]}"
            for label, got, exp in zip(("victims", "codes", "valid"), outs[name], outs["reference"]):
                assert torch.equal(got, exp), f"{where}: {name} {label} {got.tolist()} vs {exp.tolist()}"
            for i, (got, exp) in enumerate(zip(pool_rows, want_rows)):
                bad = (got != exp).nonzero().tolist()
                assert not bad, f"{where}: {name} operand {i} rows differ at {bad[:5]}"
            assert syncs[name].tolist() == [0] * SYNC_WORDS, f"{where}: {name} sync {syncs[name]}"
        admitted = outs["reference"][2] != 0
        num_admitted += int(admitted.sum())
        victims, codes = outs["reference"][:2]
        num_rejected += int((~admitted & ((codes != R) | (victims != 0))).sum())  # a pair found, not admitted
        for row, code in zip(
            outs["reference"][0][admitted].tolist(), outs["reference"][1][admitted].tolist()
        ):
            for got, host in zip(runs["one launch, deferred commit"][1], hosts):  # the bank's row, whole
                assert torch.equal(got[row], host[layer * EM + code - R]), f"{where}: row {row}"
    if hot:
        assert num_rejected > 0 and num_admitted > 0, (num_rejected, num_admitted)
    if empty and num_routed > 0 and bm == 16:  # (bm 2 asks 2 reads: a token per expert is no candidate)
        assert num_admitted > 0, "the trial admitted nothing: the copy went untested"


def _own_every_row_half_hot(start: dict, L: int, EM: int, R: int, router: bool, g: torch.Generator) -> None:
    """Every row owned by a distinct random expert; the owners of two rows in three valued far above any
    candidate (a candidate is valued 0 here, plus its chain start), the others 0."""
    owner = torch.randperm(L * EM, generator=g)[:R]
    start["row_owner"][:R] = owner
    start["row_stamp"][:R] = torch.randint(1, 40, (R,), generator=g)
    l2p = R + torch.arange(L * EM) % EM
    l2p[owner] = torch.arange(R)
    start["l2p"] = l2p.to(torch.int32)
    value = start["ranked"] if router else start["count"]
    value.zero_()
    value[owner] = 50 * ONE
    value[owner[0::3]] = 0
