"""bench/decode.py's whole pipeline on the CPU at a tiny shape (every system, the three trace families, plain and
MTP steps, traffic, bound, speedups, table, JSON), and bench/plot.py on its output and on a prefill table."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from bench import decode, plot
from bench.common import Bandwidths
from bench.decode_steps import make_bank, make_ours
from bench.decode_traces import FAMILIES, RECORDED, TraceKey, verify_steps
from bench.traces import synthetic_trace

SHAPE = decode.Shape(H=16, I=8, E=12, K=3, L=2)
BATCHES, POOLS = (1, 3), (0.25, 0.5)
MTP = decode.Mtp(num_spec=3, accept=0.6, families=FAMILIES, reference_max_bs=max(BATCHES))
SYSTEMS = ("per-layer slots", "pooled (ours)", "all resident", "all host view")
PRUNED = "pooled (ours), draft pruning"  # MTP rows only


@pytest.fixture(scope="module")
def results():
    bw = Bandwidths(hbm_read=4e12, host_zero_copy=5e10, host_to_device_copy=5.5e10)
    return decode.run(SHAPE, 5, 2, torch.device("cpu"), "test", bw, BATCHES, POOLS, FAMILIES, MTP)


def test_every_system_on_every_case(results):
    header, rows = results
    assert len(rows) == len(FAMILIES) * len(BATCHES) * len(POOLS) * (len(SYSTEMS) * 2 + 1)
    assert all(not r.error for r in rows), [r.error for r in rows if r.error]
    for r in rows:
        assert r.ms > 0 and math.isfinite(r.tok_s) and 0 <= r.hit_rate <= 1, r
        per_step = 1.0 if r.num_spec == 0 else 1 + 0.6 + 0.6**2 + 0.6**3
        if r.system == PRUNED:  # measured from the live lanes: between lane 0 alone and every draft live
            assert r.num_spec == 3 and 1.0 <= r.tokens_per_req <= per_step, r
            per_step = r.tokens_per_req
            assert "live drafts" in r.graph, r.graph
        assert r.tokens == r.bs * (1 + r.num_spec)
        assert math.isclose(r.tokens_per_req, per_step)
        assert math.isclose(r.tok_s_req, per_step / (r.ms * 1e-3))
        assert math.isclose(r.tok_s, r.bs * r.tok_s_req)
    pruned = [r for r in rows if r.system == PRUNED]
    assert any(r.tokens_per_req < MTP.tokens_per_step for r in pruned), "no draft was ever pruned"
    assert any(r.tokens_per_req > 1 for r in pruned), "every draft was pruned"
    by = {(r.trace, r.bs, r.pool, r.num_spec, r.system): r for r in rows}
    for trace in FAMILIES:
        for bs in BATCHES:
            for pool in POOLS:
                for spec in (0, 3):
                    ours = by[(trace, bs, pool, spec, "pooled (ours)")]
                    ours0 = by[(trace, bs, pool, 0, "pooled (ours)")]
                    assert ours.ours_speedup == 1.0
                    assert math.isclose(ours.vs_ours_spec0, ours.tok_s_req / ours0.tok_s_req)
                    if spec:
                        pr = by[(trace, bs, pool, spec, PRUNED)]
                        assert math.isclose(pr.vs_ours_spec0, pr.tok_s_req / ours0.tok_s_req)
                        assert math.isclose(pr.ours_speedup, pr.ms / ours.ms)
                    assert f"lanes {max(BATCHES) * (1 + spec)}" in ours.graph, ours.graph
                    res = by[(trace, bs, pool, spec, "all resident")]
                    host = by[(trace, bs, pool, spec, "all host view")]
                    assert (res.hit_rate, res.pcie_mb) == (1.0, 0.0)
                    assert host.hit_rate == 0.0 and host.pcie_mb > 0
                    slots = by[(trace, bs, pool, spec, "per-layer slots")]
                    cap = int(pool * SHAPE.L * SHAPE.E) // SHAPE.L // SHAPE.K
                    assert ("SGLang graph yes" in slots.graph) == (bs * (1 + spec) <= cap), slots.graph
                    assert math.isclose(slots.ours_speedup, slots.ms / ours.ms)
                    # host view reads every distinct expert: the most PCIe bytes of all
                    assert host.pcie_mb >= max(slots.pcie_mb, ours.pcie_mb)
                    assert res.bound_ms <= host.bound_ms
                # a verify step carries 4 tokens per request: at least the plain step's experts cross PCIe
                plain, verify = (
                    by[(trace, bs, pool, 0, "all host view")],
                    by[(trace, bs, pool, 3, "all host view")],
                )
                assert verify.pcie_mb >= plain.pcie_mb
    assert "CPU" in header[0]
    assert any(line.startswith(f"trace '{RECORDED}'") for line in header)
    assert any("2.176 tokens per request per verify step" in line for line in header)
    summary = decode.mtp_summary(rows).splitlines()
    assert len(summary) == 2 and all("below 1 in" in line for line in summary), summary
    assert summary[1].startswith(f"MTP: {PRUNED}'s")


def test_quick_mtp_rows_leave_out_the_slow_references():
    bw = Bandwidths(hbm_read=4e12, host_zero_copy=5e10, host_to_device_copy=5.5e10)
    mtp = decode.Mtp(families=(FAMILIES[1],), reference_max_bs=0)
    tiny = decode.Shape(H=8, I=4, E=8, K=2, L=2)
    _, rows = decode.run(tiny, 3, 1, torch.device("cpu"), "test", bw, (2,), (0.5,), FAMILIES[1:2], mtp)
    assert sorted((r.num_spec, r.system) for r in rows) == sorted(
        [(0, s) for s in SYSTEMS] + [(3, "pooled (ours)"), (3, "all resident"), (3, PRUNED)]
    )
    budgets = replace(mtp, draft_budgets=(0, 4))
    _, ours_only = decode.run(
        tiny, 3, 1, torch.device("cpu"), "test", bw, (2,), (0.5,), FAMILIES[1:2], budgets, references=False
    )
    assert sorted((r.num_spec, r.system) for r in ours_only) == [
        (0, "pooled (ours)"), (3, "pooled (ours)"), (3, PRUNED), (3, f"{PRUNED}, budget 4")
    ]  # fmt: skip
    assert all(not r.error for r in ours_only), [r.error for r in ours_only]
    summary = decode.mtp_summary(ours_only).splitlines()
    assert len(summary) == 3 and summary[2].startswith(f"MTP: {PRUNED}, budget 4's"), summary
    _, unpruned = decode.run(
        tiny,
        3,
        1,
        torch.device("cpu"),
        "test",
        bw,
        (2,),
        (0.5,),
        FAMILIES[1:2],
        replace(mtp, draft_budgets=()),
    )
    assert not [r for r in unpruned if r.system.startswith(PRUNED)]
    _, plain = decode.run(
        tiny, 3, 1, torch.device("cpu"), "test", bw, (2,), (0.5,), FAMILIES[:1], decode.NO_MTP
    )
    assert {r.num_spec for r in plain} == {0} and len(plain) == len(SYSTEMS)


def test_table_and_plots(results, tmp_path):
    header, rows = results
    text = decode.table(rows)
    parsed = plot.markdown_rows(text)
    assert len(parsed) == len(rows) and parsed[0]["system"] == rows[0].system
    assert {p["spec"] for p in parsed} == {"0", "3"}
    pytest.importorskip("matplotlib")
    data = tmp_path / "decode.json"
    data.write_text(json.dumps({"header": header, "results": [asdict(r) for r in rows]}))
    prefill = tmp_path / "prefill.md"
    prefill.write_text(
        "### Prefill step, whole stack (ms)\n\n"
        "| shape | format | pool | tokens | non-res GB | resident | host view | stage sync | stage | x | y | z |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| qwen3 | bf16 | 25% | 512 | 1.0 | 1.0 | 9.0 | 5.0 | 4.0 | 2x | 1x | 1x |\n"
        "| qwen3 | bf16 | 25% | 4096 | 1.0 | 4.0 | 60.0 | 20.0 | 18.0 | 3x | 1x | 1x |\n"
        "| qwen3 | bf16 | 50% | - | error: OOM |\n"
    )
    written = plot.main(
        ["--decode", str(data), "--prefill", str(prefill), "--out-dir", str(tmp_path / "png")]
    )
    assert [p.name for p in written] == ["decode.png", "prefill.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_plot_leaves_out_missing_inputs_and_refuses_malformed_ones(results, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    header, rows = results
    data = tmp_path / "decode.json"
    data.write_text(json.dumps({"header": header, "results": [asdict(r) for r in rows]}))
    missing = tmp_path / "bench_prefill.md"  # the prefill step was skipped
    written = plot.main(["--decode", str(data), "--prefill", str(missing), "--out-dir", str(tmp_path / "a")])
    assert [p.name for p in written] == ["decode.png"]
    assert f"--prefill {missing} does not exist" in capsys.readouterr().out
    assert plot.main(["--decode", str(tmp_path / "none.json"), "--out-dir", str(tmp_path / "b")]) == []
    errored = tmp_path / "errored.json"
    errored.write_text(json.dumps({"results": [{"error": "OOM"}]}))
    assert plot.main(["--decode", str(errored), "--out-dir", str(tmp_path / "b")]) == []
    assert "no successful case" in capsys.readouterr().out
    bad_json, no_table = tmp_path / "bad.json", tmp_path / "no_table.md"
    bad_json.write_text('{"results": [')
    no_table.write_text("### Prefill step\n\nerror: CUDA out of memory\n")
    for argv, match in (
        (["--decode", str(bad_json)], "bad.json: not bench/decode.py JSON results"),
        (["--decode", str(data), "--prefill", str(no_table)], "no_table.md: no bench/prefill.py table"),
    ):
        with pytest.raises(ValueError, match=match):
            plot.main([*argv, "--out-dir", str(tmp_path / "c")])
    assert not list((tmp_path / "b").iterdir()) and not list((tmp_path / "c").iterdir())


def test_verify_steps_wider_than_the_lanes_fail_their_row():
    """A verify step that would leave the decode path (lanes sized for plain decode) is an error row, not a
    quietly host-planned measurement; lanes of bs x (1 + num_spec) keep every step on the decode path."""
    bw = Bandwidths(hbm_read=4e12, host_zero_copy=5e10, host_to_device_copy=5.5e10)
    tiny, cpu = decode.Shape(H=8, I=4, E=8, K=2, L=2), torch.device("cpu")
    bank = make_bank(tiny, cpu, torch.Generator().manual_seed(0))
    key = TraceKey("t", 2, 3)
    ids = verify_steps(synthetic_trace(4 * 4, 2, 8, 2, 2, seed=1).ids.long(), 3)  # [4, L, 8, K]
    x = torch.randn(2, 8, 8).bfloat16()
    w = torch.softmax(torch.randn(2, 8, 2), -1)
    narrow = make_ours(bank, tiny, 6, 2, cpu)
    bad = decode.measure(narrow, key, 0.5, ids, x, w, 1, bw, 2.0)
    assert "left the decode path" in bad.error and math.isnan(bad.ms)
    wide = make_ours(bank, tiny, 6, 8, cpu)
    good = decode.measure(wide, key, 0.5, ids, x, w, 1, bw, 2.0)
    assert not good.error and good.tokens == 8 and "lanes 8" in good.graph
    assert dict(wide.moe.step_widths["decode"]) == {8: 4} and not wide.moe.step_widths["prefill"]


def test_draft_pruning_rows_measure_emitted_tokens_from_live_lanes():
    """Ours with draft pruning: every step is a verify step, live lanes recorded after each timed step only, and
    the row's tokens per request per step is their mean `1 + sum_{j<=m} a^j`."""
    from bench.decode_steps import OursDraftPruned, time_steps
    from pooled_runner.draft_prune import emitted_per_request

    tiny, cpu = decode.Shape(H=8, I=4, E=8, K=2, L=2), torch.device("cpu")
    bank = make_bank(tiny, cpu, torch.Generator().manual_seed(0))
    ids = verify_steps(synthetic_trace(5 * 4, 2, 8, 2, 2, seed=4, reuse=0.6).ids.long(), 3)  # [5, L, 8, K]
    x, w = torch.randn(2, 8, 8).bfloat16(), torch.softmax(torch.randn(2, 8, 2), -1)
    system = make_ours(bank, tiny, 4, 8, cpu, pruning=(3, 0.5))
    assert isinstance(system, OursDraftPruned) and system.name == PRUNED
    time_steps(system, ids, x, w, warm=2)
    recorded = [a.tolist() for a in system._alive]
    assert len(recorded) == 3 and all(len(a) == 8 for a in recorded)
    want = [e for a in recorded for e in emitted_per_request(a, 3, 0.5)]
    got, live = system.take_emitted()
    assert math.isclose(got, sum(want) / len(want)) and 0 <= live <= 3
    assert not system._alive
    with pytest.raises(RuntimeError, match="no timed verify step"):
        system.take_emitted()
