"""Tensor parallelism without SGLang: shards, per-rank sizes and refusals, the deterministic plan, the agreement
check (two fake ranks, and two real gloo processes running the model-shaped stack)."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pooled_runner.formats.base import OperandSpec
from pooled_runner.pool import ExpertPool
from pooled_runner.torch_path import expert_mlp
from pooled_runner.tp import (
    TablesDisagree,
    check_agreement,
    rank_intermediate,
    rank_memory,
    shard_expert,
    shard_size,
    table_digests,
    tp_problems,
)
from tests.tp_stack import StackSpec, launch


def make_pool(layers: list[int], rows: int, fill: bool = True) -> ExpertPool:
    from pooled_runner.bank import ExpertBank

    operands = (OperandSpec("w13", (2, 3), torch.float32), OperandSpec("w2", (3, 1), torch.float32))
    bank = ExpertBank(operands, layers, pin=False)
    g = torch.Generator().manual_seed(1)
    for t in bank.tensors_host.values():
        t.copy_(torch.randn(t.shape, generator=g))
    pool = ExpertPool(operands, layers, rows, torch.device("cpu"), bank)
    if fill:
        pool.fill()
    return pool


# ------------------------------------------------------------------------------------------------------
# Shards and sizes
@pytest.mark.parametrize(("H", "I", "N"), [(5, 6, 2), (7, 9, 3), (4, 8, 4), (3, 1, 1)])
def test_shard_outputs_sum_to_the_full_expert(H: int, I: int, N: int) -> None:
    g = torch.Generator().manual_seed(H * 100 + I)
    w13, w2 = torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g)
    x = torch.randn(5, H, generator=g)
    full = expert_mlp(x, w13, w2)
    shards = [shard_expert(w13, w2, r, N) for r in range(N)]
    assert all(a.shape == (2 * I // N, H) and b.shape == (H, I // N) for a, b in shards)
    assert all(a.is_contiguous() and b.is_contiguous() for a, b in shards)
    total = sum(expert_mlp(x, a, b) for a, b in shards)
    assert torch.allclose(total, full, atol=1e-5), (total - full).abs().max()
    # Rank r's gate rows are rows [r*I/N, (r+1)*I/N) of the gate half, its up rows the same of the up half.
    s = I // N
    assert torch.equal(shards[-1][0][:s], w13[I - s : I]) and torch.equal(shards[-1][0][s:], w13[2 * I - s :])


def test_unsplittable_and_small_configurations_are_refused_with_per_rank_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"intermediate size 30 cannot be split evenly over 4 TP ranks \(30 % 4 = 2\)"
    ):
        shard_size(30, 4)
    problems = tp_problems(pool_rows=3, top_k=4, intermediate_size=30, tp_size=4)
    assert len(problems) == 2
    assert "30 / 4 = 7.5 per rank" in problems[0]
    assert "each of the 4 ranks would hold 3 rows, below top-k 4" in problems[1]
    assert tp_problems(pool_rows=4, top_k=4, intermediate_size=32, tp_size=4) == []
    # On the CPU SGLang pads the intermediate size to a multiple of tp * 32 instead of refusing.
    assert tp_problems(pool_rows=4, top_k=4, intermediate_size=30, tp_size=4, cpu=True) == []
    assert rank_intermediate(30, 4, cpu=True) == 32 and rank_intermediate(32, 2, cpu=True) == 32
    assert rank_intermediate(128, 2, cpu=True) == 64 and rank_intermediate(768, 4, cpu=False) == 192
    with pytest.raises(ValueError, match="not \\[2I, H\\] and \\[H, I\\]"):
        shard_expert(torch.zeros(6, 4), torch.zeros(4, 2), 0, 2)


def test_rank_memory_is_sized_from_the_shard() -> None:
    m = rank_memory(
        "bf16",
        torch.bfloat16,
        hidden_size=64,
        intermediate_size=32,
        tp_size=2,
        pool_rows=12,
        num_total_experts=64,
    )
    assert m.intermediate_per_rank == 16
    assert m.row_bytes == 3 * 64 * 16 * 2  # w13 [32, 64] + w2 [64, 16], bf16
    assert m.pool_bytes == 12 * m.row_bytes and m.bank_bytes == 64 * m.row_bytes
    assert "per rank (TP=2, I/rank=16): 12 rows" in m.describe()
    resident = rank_memory("bf16", torch.bfloat16, 64, 32, 2, pool_rows=100, num_total_experts=64)
    assert resident.pool_rows == 64 and resident.bank_bytes == 0


# ------------------------------------------------------------------------------------------------------
# The plan is deterministic: order-free in its input, LRU with ties broken by row index
def reference_policy(layers: list[int], rows: int, steps: list[tuple[int, list[int]]]) -> list[list[int]]:
    """An independent model of the policy: last-use tick per row, lowest free row first, victim = the row
    with the smallest (tick, row) outside this step; returns the final location tables."""
    resident: dict[tuple[int, int], int] = {}
    owner: dict[int, tuple[int, int]] = {}
    tick = {r: 0 for r in range(rows)}
    pairs = [(l_, e) for l_, n in enumerate(layers) for e in range(n)]
    for r, pair in enumerate(pairs[:rows]):  # fill(): layer-major, lowest rows first, all at tick 0
        resident[pair], owner[r] = r, pair
    for t, (layer, experts) in enumerate(steps, start=1):
        step_rows = {resident[(layer, e)] for e in experts if (layer, e) in resident}
        for e in sorted(experts):
            if (layer, e) in resident:
                continue
            free = [r for r in range(rows) if r not in owner]
            candidates = [r for r in owner if r not in step_rows]
            if free:
                row = min(free)
            elif candidates:
                row = min(candidates, key=lambda r: (tick[r], r))
                del resident[owner.pop(row)]
            else:
                continue  # host view
            resident[(layer, e)], owner[row] = row, (layer, e)
            step_rows.add(row)
        for r in step_rows:
            tick[r] = t
    return [[resident.get((l_, e), rows + e) for e in range(n)] for l_, n in enumerate(layers)]


STEPS = st.lists(
    st.tuples(st.integers(0, 7), st.lists(st.integers(0, 31), min_size=1, max_size=6)), max_size=40
)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    rows_frac=st.floats(0.05, 0.9),
    steps=STEPS,
    seed=st.integers(0, 99),
)
def test_plan_matches_independent_policy_and_ignores_input_order(layers, rows_frac, steps, seed) -> None:  # type: ignore[no-untyped-def]
    rows = max(1, int(sum(layers) * rows_frac))
    plan = [(a % len(layers), sorted({e % layers[a % len(layers)] for e in es})) for a, es in steps]
    one, two = make_pool(layers, rows), make_pool(layers, rows)
    shuffle = random.Random(seed)
    for layer, experts in plan:
        permuted = list(experts)
        shuffle.shuffle(permuted)
        codes_one = one.plan_step(layer, experts)
        codes_two = two.plan_step(layer, permuted)
        assert dict(zip(experts, codes_one)) == dict(zip(permuted, codes_two))
    assert torch.equal(one.l2p_host, two.l2p_host)
    assert one.lru_rows() == two.lru_rows() and one.stats() == two.stats()
    names, digests = table_digests(one)
    assert torch.equal(digests, table_digests(two)[1])
    check_agreement(torch.stack([digests, table_digests(two)[1]]), names, step=len(plan))
    expected = reference_policy(layers, rows, plan)
    for layer, n in enumerate(layers):
        assert one.l2p_host[layer, :n].tolist() == expected[layer], f"layer {layer}"
    one.check_invariants()


def test_ties_in_one_step_are_broken_by_row_index() -> None:
    pool = make_pool([6], rows=3, fill=False)
    pool.plan_step(0, [5, 1, 3])  # rows 0, 1, 2 to experts 1, 3, 5 (ascending expert id, lowest row)
    assert [pool.lookup(0, e) for e in (1, 3, 5)] == [0, 1, 2]
    pool.plan_step(0, [5, 3])  # rows 2 and 1 used at this step; row 0 is now least recent
    assert pool.lru_rows() == [0, 1, 2]  # this step's rows last, in row order
    pool.plan_step(0, [0, 2])  # two misses evict the two least recent rows: 0 (expert 1), then 1 (expert 3)
    assert [pool.lookup(0, e) for e in (0, 2)] == [0, 1] and not pool.is_resident(0, 1)
    with pytest.raises(ValueError, match="repeat an id"):
        pool.plan_step(0, [4, 4])


# ------------------------------------------------------------------------------------------------------
# The agreement check
def test_forced_disagreement_is_detected_naming_layer_and_step() -> None:
    ranks = [make_pool([5, 6, 4], rows=5) for _ in range(2)]
    names = [f"model.layers.{i}.mlp.experts" for i in range(3)]
    for step in range(12):
        for pool in ranks:
            pool.plan_step(step % 3, [step % 4, (step * 3 + 1) % 4])
    gathered = torch.stack([table_digests(p, names)[1] for p in ranks])
    check_agreement(gathered, table_digests(ranks[0], names)[0], step=12)  # agree
    ranks[1].plan_step(1, [5])  # rank 1 alone admits expert 5 of layer 1
    entry_names, d1 = table_digests(ranks[1], names)
    gathered = torch.stack([table_digests(ranks[0], names)[1], d1])
    changed = [i for i in range(3) if not torch.equal(ranks[0].l2p_host[i], ranks[1].l2p_host[i])]
    assert 1 in changed  # layer 1 admitted; the evicted row may have belonged to another layer
    first = names[changed[0]]
    with pytest.raises(TablesDisagree) as info:
        check_agreement(gathered, entry_names, step=13)
    message = str(info.value)
    assert message.startswith(
        f"TP ranks disagree at step 13: location table of {first} (pooled layer {changed[0]})"
    )
    assert re.search(r"\(rank 0: 0x[0-9a-f]{16}, rank 1: 0x[0-9a-f]{16}\)", message), message
    assert "LRU order" in message and "plan counters" in message  # listed as also differing
    # Telemetry windows are compared too.
    tele = {"route_counts": torch.arange(6, dtype=torch.int64)}
    bumped = {"route_counts": torch.arange(6, dtype=torch.int64) + (torch.arange(6) == 2)}
    n0, t0 = table_digests(ranks[0], names, tele)
    _, t1 = table_digests(ranks[0], names, bumped)
    with pytest.raises(TablesDisagree, match="telemetry route_counts"):
        check_agreement(torch.stack([t0, t1]), n0, step=13)


def test_byte_counters_do_not_enter_the_digest() -> None:
    a, b = make_pool([4], rows=2), make_pool([4], rows=2)
    b.stats_counters.bytes_read_host_view += 123  # shards of different ranks read different byte counts
    assert torch.equal(table_digests(a)[1], table_digests(b)[1])


# ------------------------------------------------------------------------------------------------------
# Two real ranks (gloo): the model-shaped stack
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_gloo_ranks_agree_and_match_the_unsharded_model(tmp_path: Path) -> None:
    spec = StackSpec(
        num_layers=3, num_experts=8, hidden=16, intermediate=12, top_k=2, pool_rows=4, steps=40, tokens=3
    )
    results = launch(spec, world=2, out_dir=tmp_path, port=_free_port())
    r0, r1 = results
    assert r0["intermediate_per_rank"] == r1["intermediate_per_rank"] == 6
    assert r0["row_bytes"] == 3 * 16 * 6 * 4  # the shard: w13 [12, 16] + w2 [16, 6], fp32
    assert r0["l2p"] == r1["l2p"] is not None  # the same tables at the end, with
    assert r0["misses"] == r1["misses"] > 0 and r0["evictions"] == r1["evictions"] > 0  # real misses
    assert r0["num_checks"] == 9  # every 5 steps + once at the end, all agreeing
    assert r0["max_rel_err"] < 1e-5, r0["max_rel_err"]  # all-reduced shards == unsharded experts (fp32)
    for r in results:  # rank 1 planned one step alone: both ranks stop with the layer and the step
        assert "TP ranks disagree at step 41: location table of pooled layer" in str(r["disagreement"])


def test_forced_divergence_changes_layer_1_through_the_boundary_paths() -> None:
    from tests.tp_stack import _diverge, build_rank_moe

    spec = StackSpec(num_layers=3, num_experts=8, hidden=16, intermediate=12, top_k=2, pool_rows=4)
    moe = build_rank_moe(spec, rank=1, world=2, device=torch.device("cpu"))
    pool = moe.sync_tables()

    def layer_1_rows() -> int:
        return sum(1 for o in pool.row_owner if o is not None and o[0] == 1)

    assert layer_1_rows() == 0  # the layer-major fill gave every row to layer 0
    for expected_rows in (
        1,
        0,
    ):  # no row of layer 1: a step of layer 1 alone admits one; then it is given back
        before = pool.l2p_host[1].clone()
        _diverge(moe, spec, torch.device("cpu"))
        assert not torch.equal(before, pool.l2p_host[1]) and layer_1_rows() == expected_rows
        pool.check_invariants()


def test_guard_and_staging_are_sized_from_the_rank_shard() -> None:
    from pooled_runner.formats import make_format
    from pooled_runner.guard import KernelBackend, check_tensors, max_pool_rows
    from pooled_runner.staging import LayerStager

    fmt = make_format("bf16", torch.bfloat16)
    full, shard = fmt.operands(64, 32), fmt.operands(64, 16)  # TP=1 rows, and a TP=2 rank's rows
    backend = KernelBackend("test", 10 * 2 * 32 * 64 * 2, "a 10-row limit for full-width w13 rows")
    assert max_pool_rows(backend, full) == 10 and max_pool_rows(backend, shard) == 20
    check_tensors(backend, shard, 16, [16])  # 16 rows of shards fit on each rank
    with pytest.raises(ValueError, match="largest --moe-expert-pool-rows that fits is 10"):
        check_tensors(backend, full, 16, [16])
    assert LayerStager.buffer_bytes(shard, 16) * 2 == LayerStager.buffer_bytes(full, 16)


# ------------------------------------------------------------------------------------------------------
# The launcher: per-rank refusals before any weight is read, per-rank memory, CPU thread binding
def _tp_model(tmp_path: Path, intermediate: int) -> Path:
    import json

    model = tmp_path / "model"
    model.mkdir()
    config = {
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "hidden_size": 64,
        "moe_intermediate_size": intermediate,
        "torch_dtype": "bfloat16",
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def _plan(argv: list[str], cuda: bool):  # type: ignore[no-untyped-def]
    from pooled_runner.launch import build_parser, resolve_launch

    ours, rest = build_parser().parse_known_args(argv)
    return resolve_launch(ours, rest, cuda_available=cuda)


def test_launcher_refuses_unsplittable_or_too_small_tp_with_per_rank_numbers(tmp_path: Path) -> None:
    model = str(_tp_model(tmp_path, intermediate=96))
    with pytest.raises(ValueError) as info:
        _plan(["--model-path", model, "--tp-size", "5", "--moe-expert-pool-rows", "3"], cuda=True)
    message = str(info.value)
    assert "96 / 5 = 19.2 per rank" in message
    assert "each of the 5 ranks would hold 3 rows, below top-k 4" in message
    with pytest.raises(ValueError, match="--tp-size 'two' is not an integer"):
        _plan(["--model-path", model, "--tp=two", "--moe-expert-pool-rows", "8"], cuda=True)
    for bad in ("0", "-2"):  # refused without the model's config.json too (a hub id not on this machine)
        for path in (model, "nobody/not-on-this-machine"):
            with pytest.raises(ValueError, match=f"--tp-size {bad}: must be a positive number of ranks"):
                _plan(["--model-path", path, "--tp-size", bad, "--moe-expert-pool-rows", "8"], cuda=True)
    ok = _plan(["--model-path", model, "--tp-size", "2", "--moe-expert-pool-rows", "8"], cuda=True)
    assert ok.tp_size == 2 and ok.rank_memory is not None
    assert ok.rank_memory.intermediate_per_rank == 48
    assert (
        ok.rank_memory.row_bytes == 3 * 64 * 48 * 2
        and ok.rank_memory.bank_bytes == 64 * ok.rank_memory.row_bytes
    )
    # On the CPU SGLang pads instead (96 -> 160 for TP=5: 32 per rank), so the same TP size is accepted.
    cpu = _plan(
        ["--model-path", model, "--tensor-parallel-size", "5", "--moe-expert-pool-rows", "8"], cuda=False
    )
    assert cpu.rank_memory is not None and cpu.rank_memory.intermediate_per_rank == 32


def test_cpu_threads_bind_gives_each_rank_its_cores() -> None:
    from pooled_runner.launch import cpu_threads_bind

    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [3, 0, 1, 2]) == "0,1|2,3"
    assert cpu_threads_bind(3, [0, 1]) == "0|1|0"  # fewer cores than ranks: shared round-robin
    with pytest.raises(ValueError, match="no CPU cores"):
        cpu_threads_bind(2, [])
