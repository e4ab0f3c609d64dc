"""Draft-lane pruning (`pooled_runner/draft_prune.py`, `kernels/draft_prune.py`): the one-launch kernel (Triton
interpreter on the CPU) and the torch-op reference against the plain-Python rule at awkward sizes, a
hand-checked case, bad arguments, the per-step state of `DraftPruner` (both forms), the config flags, and
expected tokens per request from live lanes."""

from __future__ import annotations

import argparse
import itertools
import logging
import math

import pytest
import torch
from pooled_runner.kernels.draft_prune import BLOCK_R, draft_prune, draft_prune_reference

from pooled_runner import PoolConfig
from pooled_runner.config import add_cli_arguments, config_from_cli
from pooled_runner.draft_prune import DraftPruner, emitted_per_request, prune_reference

IMPLS = {"kernel": draft_prune, "torch": draft_prune_reference}


def prune_lanes(ids, alive, l2p, R, E, num_spec, budget=0, impl="torch", misses=None):  # type: ignore[no-untyped-def]
    """Lanes alive after one layer by `impl`; also checks its routes: dead lanes padding, live ones unchanged.
    `misses` (int32 [T], the step's unpaid routes so far; default zeros) is updated in place."""
    alive = alive.clone()
    if misses is None:
        misses = torch.zeros(ids.shape[0], dtype=torch.int32)
    w = torch.rand(ids.shape, dtype=torch.float32) + 0.1
    out_ids, out_w = IMPLS[impl](ids, w, l2p, alive, misses, R, E, num_spec, budget)
    assert out_ids.dtype == ids.dtype and out_w.dtype == w.dtype
    keep = alive[:, None].expand_as(ids)
    assert torch.equal(out_ids, torch.where(keep, ids, -1)), (ids, out_ids, alive)
    assert torch.equal(out_w, torch.where(keep, w, 0.0)), (w, out_w, alive)
    return alive


def random_case(bs: int, num_spec: int, E: int, K: int, R: int, g: torch.Generator, budget: int = 0):
    """Routing with drafts that partly repeat their lane 0's experts, padding, some ids out of range, a layer
    with some experts resident, and a valid incoming state: a chain of live lanes (lane 0 live) whose unpaid
    routes so far are within `budget` (dead lanes: any)."""
    lanes = 1 + num_spec
    T = bs * lanes
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    for t in range(T):
        if t % lanes:
            reuse = torch.rand(K, generator=g) < 0.6
            ids[t] = torch.where(reuse, ids[t - t % lanes], ids[t])
    ids[torch.rand(T, K, generator=g) < 0.1] = -1
    ids[torch.rand(T, K, generator=g) < 0.03] = E + 2  # not an expert of this layer: never a miss
    l2p = R + torch.arange(E + 3, dtype=torch.int32)  # [E_max]; E_max > E: padding codes past E
    resident = torch.randperm(E, generator=g)[: min(R, E) // 2 + 1]
    l2p[resident] = torch.arange(resident.numel(), dtype=torch.int32)
    l2p[E:] = -1
    first_dead = torch.randint(1, lanes + 2, (bs,), generator=g)  # lanes >= first_dead are dead (maybe none)
    alive = torch.arange(lanes)[None, :] < first_dead[:, None]  # [bs, lanes]
    alive = alive.reshape(T)
    misses = torch.randint(
        0, budget + 3, (T,), generator=g, dtype=torch.int32
    )  # earlier layers' unpaid routes
    misses = torch.where(alive, misses.clamp(max=budget), misses)
    return ids, alive, l2p, misses


CASES = list(itertools.product((1, 3, BLOCK_R + 1), (1, 2, 3), (7, 13), (0, 2)))


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(("bs", "num_spec", "E", "budget"), CASES)
def test_rule_equals_plain_python(impl, bs, num_spec, E, budget):
    g = torch.Generator().manual_seed(bs * 100 + num_spec * 10 + E + budget)
    K, R, lanes = 3, 5, 1 + num_spec
    outcomes = set()
    for trial in range(6 if impl == "kernel" else 25):
        ids, alive, l2p, misses = random_case(bs, num_spec, E, K, R, g, budget)
        dtype = torch.int32 if trial % 2 else torch.int64
        want_misses = misses.tolist()
        got = prune_lanes(ids.to(dtype), alive, l2p, R, E, num_spec, budget, impl, misses)
        want = prune_reference(
            ids.tolist(), alive.tolist(), l2p.tolist(), R, E, num_spec, budget, want_misses
        )
        assert got.tolist() == want, f"trial {trial}: ids {ids.tolist()} alive {alive.tolist()}"
        assert misses.tolist() == want_misses, f"trial {trial}: unpaid routes per lane"
        per_request = got.view(bs, lanes)
        assert per_request[:, 0].all(), "lane 0 pruned"
        assert torch.equal(per_request, per_request.int().cummin(1).values.bool()), "chain broken"
        assert not (got & ~alive).any(), "a dead lane came back"
        outcomes.update(per_request[:, 1:].reshape(-1).tolist())
    assert outcomes == {True, False}, "the cases never both kept and pruned a draft lane"


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_hand_checked_case(impl):
    E, R, num_spec = 5, 2, 3
    l2p = torch.tensor([0, 1, R + 2, R + 3, R + 4], dtype=torch.int32)  # experts 0, 1 resident
    ids = torch.tensor([[2, 0], [2, 1], [3, 0], [0, 1]])  # lane 2 routes 3: neither resident nor lane 0's
    alive = torch.ones(4, dtype=torch.bool)
    assert prune_lanes(ids, alive, l2p, R, E, num_spec, 0, impl).tolist() == [True, True, False, False]
    misses = torch.zeros(4, dtype=torch.int32)
    assert prune_lanes(ids, alive, l2p, R, E, num_spec, 1, impl, misses).tolist() == [True] * 4
    assert misses.tolist() == [0, 0, 1, 0]  # lane 0 pays 2 and 0; 1 is resident; 3 is lane 2's miss
    # the budget is per step: a second layer with one more unpaid route kills lane 2 (and lane 3 with it)
    later = torch.tensor([[0, 1], [0, 1], [4, 0], [0, 1]])
    assert prune_lanes(later, alive, l2p, R, E, num_spec, 1, impl, misses).tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert misses.tolist() == [0, 0, 2, 0]
    # another request's lane 0 pays for expert 3
    two = torch.cat([ids, torch.tensor([[3, 4], [4, 0], [1, 2], [0, 0]])])
    got = prune_lanes(two, torch.ones(8, dtype=torch.bool), l2p, R, E, num_spec, 0, impl)
    assert got.tolist() == [True] * 8
    # K = 1 (top-k not a power of two is covered above), and T = 0
    one = prune_lanes(two[:, :1].contiguous(), torch.ones(8, dtype=torch.bool), l2p, R, E, num_spec, 0, impl)
    assert one.tolist() == [True] * 5 + [False] * 3  # request 1's first draft routes 4: unpaid
    empty = prune_lanes(two[:0], torch.ones(0, dtype=torch.bool), l2p, R, E, num_spec, 0, impl)
    assert empty.numel() == 0


def test_bad_arguments_are_refused():
    ids, w = torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    l2p, alive, misses = (
        torch.zeros(5, dtype=torch.int32),
        torch.ones(4, dtype=torch.bool),
        torch.zeros(4).int(),
    )
    for args, match in (
        ((ids.float(), w, l2p, alive, misses, 2, 5, 1, 0), "topk_ids"),
        ((ids, w[:, :1], l2p, alive, misses, 2, 5, 1, 0), "topk_weights"),
        ((ids, w, l2p.long(), alive, misses, 2, 5, 1, 0), "l2p"),
        ((ids, w, l2p, alive, misses, 2, 6, 1, 0), "l2p"),
        ((ids, w, l2p, alive.int(), misses, 2, 5, 1, 0), "alive"),
        ((ids, w, l2p, alive, misses.long(), 2, 5, 1, 0), "misses"),
        ((ids, w, l2p, alive, misses[:3], 2, 5, 1, 0), "misses"),
        ((ids, w, l2p, alive, misses, 2, 5, 2, 0), "requests of 1 \\+ num_spec 2"),
        ((ids, w, l2p, alive, misses, 2, 5, 1, -1), "max_misses=-1"),
    ):
        for impl in IMPLS.values():
            with pytest.raises(ValueError, match=match):
                impl(*args)


@pytest.mark.parametrize("fused", [False, True])
def test_pruner_state_per_step(fused):
    E, R, K, num_spec = 5, 2, 2, 1
    l2p = torch.tensor([0, 1, R + 2, R + 3, R + 4], dtype=torch.int32)
    pruner = DraftPruner(torch.device("cpu"), fused=fused)
    with pytest.raises(RuntimeError, match="no verify step"):
        pruner.lane_alive()
    ids = torch.tensor([[2, 0], [3, 1], [0, 1], [1, 2]])  # request 0's draft routes 3: dead
    w = torch.rand(4, K)
    # not armed: untouched
    got_ids, got_w = pruner.prune(0, ids, w, l2p, R, E)
    assert got_ids is ids and got_w is w
    pruner.arm(num_spec, max_tokens=6)
    pid, pw = pruner.prune(0, ids, w, l2p, R, E)
    assert pid.dtype == ids.dtype and pw.dtype == w.dtype
    assert pid.tolist() == [[2, 0], [-1, -1], [0, 1], [1, 2]]
    assert pw[1].tolist() == [0.0, 0.0] and torch.equal(pw[[0, 2, 3]], w[[0, 2, 3]])
    assert pruner.lane_alive().tolist() == [True, False, True, True]
    # a later layer: lane 1 stays dead even when it routes only paid experts now
    pid, _ = pruner.prune(1, torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]]), w, l2p, R, E)
    assert pid[1].tolist() == [-1, -1] and pruner.lane_alive().tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match="2 tokens in a verify step of 4"):
        pruner.prune(2, ids[:2], w[:2], l2p, R, E)
    # a new step that is not armed: not pruned, lane_alive keeps the last verify step
    assert pruner.prune(0, ids, w, l2p, R, E)[0] is ids
    pruner.arm(num_spec, max_tokens=6)  # armed again: all live until a layer says otherwise
    assert pruner.lane_alive_gpu is not None and pruner.lane_alive_gpu.all()
    with pytest.raises(ValueError, match="requests x"):
        pruner.prune(0, ids[:3], w[:3], l2p, R, E)
    pruner.arm(num_spec, max_tokens=2)
    with pytest.raises(ValueError, match="<= 6 tokens"):  # the buffer keeps its size; 8 tokens exceed it
        pruner.prune(0, torch.cat([ids, ids]), torch.cat([w, w]), l2p, R, E)
    for bad in ((0, 4), (3, 3)):
        with pytest.raises(ValueError):
            pruner.arm(*bad)
    with pytest.raises(ValueError, match="max_draft_misses"):
        DraftPruner(torch.device("cpu"), max_draft_misses=-1)


def test_config_flags(caplog):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    default = config_from_cli(
        parser.parse_args(["--moe-expert-pool-rows", "4", "--moe-expert-pool-device", "cpu"])
    )
    assert (default.draft_pruning, default.max_draft_misses) == (False, 0)
    on = config_from_cli(
        parser.parse_args(
            [
                "--moe-expert-pool-rows", "4", "--moe-expert-pool-device", "cpu",
                "--moe-expert-pool-draft-pruning", "--moe-expert-pool-max-draft-misses", "2",
            ]
        )
    )  # fmt: skip
    assert (on.draft_pruning, on.max_draft_misses) == (True, 2)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        PoolConfig(pool_rows=4, device="cpu", max_draft_misses=3)
    assert "max_draft_misses=3 has no effect without draft pruning" in caplog.text
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"max_draft_misses={bad!r} must be an integer >= 0"):
            PoolConfig(pool_rows=4, device="cpu", max_draft_misses=bad)


def test_emitted_per_request():
    a = 0.6
    lanes = [True, True, True, True, True, False, False, False, True, True, False, False]
    got = emitted_per_request(lanes, 3, a)
    want = [1 + a + a**2 + a**3, 1.0, 1 + a]
    assert all(math.isclose(x, y) for x, y in zip(got, want, strict=True)), got
