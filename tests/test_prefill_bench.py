"""bench/prefill.py on the CPU at a tiny shape: every mode computes the resident stack's output (page-in waves to
a rounding: its waves add partial sums), the page-in baseline really pages in waves, and the table's columns."""

from __future__ import annotations

import pytest
import torch

from bench import plot, prefill
from tests.kernel_helpers import assert_close

DIMS = (16, 8, 12, 3, 3)  # H, I, E, top-k, layers
FRAC, MIN_TOKENS = 0.25, 8
CHUNK = 2  # stage's chunk buffers: a ring of 6 experts, so page-in gets (9 + 6) // 3 = 5 slots per layer


def test_page_in_slots_take_stages_vram():
    ring = 3 * 16  # three chunk buffers of 16 experts
    assert prefill.ring_experts(prefill.SHAPES["qwen3"]) == ring
    assert prefill.page_in_slots(prefill.SHAPES["qwen3"], 0.25) == (256 + ring) // 8
    assert prefill.page_in_slots(prefill.SHAPES["qwen3"], 0.5) == (512 + ring) // 8
    assert prefill.page_in_slots(prefill.SHAPES["deepseek"], 0.5) == (96 + ring) // 3
    # the same pool fraction of a 48-layer model: its rows and the one ring over 48 layers
    assert prefill.page_in_slots(prefill.SHAPES["qwen3"], 0.25, 16, 48) == (1536 + ring) // 48
    assert prefill.page_in_slots(prefill.SHAPES["qwen3"], 0.25, 8) == (256 + 24) // 8
    assert prefill.ring_experts(DIMS) == 3 * 12  # C cut to E
    assert prefill.page_in_slots(DIMS, FRAC) == 12  # (9 + 36) // 3 = 15, capped at E


@pytest.mark.parametrize("T", [1, 20])
def test_every_mode_computes_the_resident_output(T):
    g = torch.Generator().manual_seed(T)
    routes = prefill.make_routes(DIMS, T, g, "cpu")
    built = {  # one weight seed: every stack holds the same experts
        mode: prefill.build(
            DIMS, "bf16", FRAC, mode, torch.Generator().manual_seed(0), "cpu", MIN_TOKENS, CHUNK
        )
        for mode in prefill.MODES
        if mode != "page_in"
    }
    assert prefill.page_in_slots(DIMS, FRAC, CHUNK) == 5
    slots = prefill.build_page_in(built["host_view"], "bf16", prefill.page_in_slots(DIMS, FRAC, CHUNK))
    ref = prefill.run_stack(prefill.pooled_forward(built["resident"]), routes)
    for mode in ("host_view", "stage_sync", "stage"):
        out = prefill.run_stack(prefill.pooled_forward(built[mode]), routes)
        for layer, (a, b) in enumerate(zip(out, ref)):
            assert torch.equal(a, b), f"{mode} layer {layer} T={T}"
    for _ in range(2):  # the second step finds other experts resident: waves again
        before = slots.traffic()
        out = prefill.run_stack(slots.forward, routes)
        d = slots.traffic() - before
        for layer, (a, b) in enumerate(zip(out, ref)):
            if d.waves > d.layer_steps:
                assert_close(a, b, f"page_in layer {layer} T={T}")
            else:
                assert torch.equal(a, b), f"page_in layer {layer} T={T}"
    if T == 20:  # 60 routed pairs reach all 12 experts of a layer: three waves of at most 5, copies each step
        assert d.waves == 3 * DIMS[4] and d.misses > 0, d
        slots.check_invariants()
    for mode in ("stage", "stage_sync"):
        stager = built[mode].stager
        assert stager is not None and stager.stats.steps_staged == (1 if T >= MIN_TOKENS else 0), mode
        assert stager.chunk_experts == CHUNK and (stager.stats.chunks_staged > DIMS[4]) == (T >= MIN_TOKENS)


def test_measure_case_and_table():
    g = torch.Generator().manual_seed(3)
    pcie: dict[str, float] = {}
    t, miss_gb, waves = prefill.measure_case(
        DIMS, "bf16", FRAC, [4, 16], g, "cpu", MIN_TOKENS, CHUNK, pcie_gb=pcie
    )
    # 3 layers x 9 non-resident experts: stage copies the routed ones (all at 16 tokens; some at 4) once per step
    row_gb = 3 * 8 * 16 * 2 / 1e9
    assert 0 < pcie["stage"] <= 27 * row_gb + 1e-12 and pcie["page_in"] > 0, pcie
    assert set(t) == set(prefill.MODES) and all(set(v) == {4, 16} for v in t.values())
    assert all(ms > 0 for v in t.values() for ms in v.values())
    assert miss_gb > 0 and waves > 1
    rows = prefill.table_rows(("tiny", "bf16", FRAC), 11, t, miss_gb, waves, 50.0, 6, pcie)
    assert len(rows) == 2 and all(len(r) == len(prefill.HEADER) for r in rows)
    text = prefill.print_table("Prefill step, whole stack (ms)", prefill.HEADER, rows)
    parsed = plot.markdown_rows(text)
    col = parsed[1]["stage vs page-in waves"]
    assert col == f"{t['page_in'][16] / t['stage'][16]:.2f}x" and parsed[1]["slots/layer"] == "11"
    assert parsed[0]["ring experts"] == "6" and parsed[0]["PCIe GB/step stage"] == f"{pcie['stage']:.2f}"


def test_prefill_plot_with_and_without_the_page_in_column(tmp_path):
    pytest.importorskip("matplotlib")
    g = torch.Generator().manual_seed(4)
    t, miss_gb, waves = prefill.measure_case(DIMS, "bf16", FRAC, [4, 16], g, "cpu", MIN_TOKENS)
    rows = prefill.table_rows(("tiny", "bf16", FRAC), 11, t, miss_gb, waves, copy_bw=50.0)
    text = prefill.print_table("Prefill step, whole stack (ms)", prefill.HEADER, rows)
    new, old = tmp_path / "new.md", tmp_path / "old.md"
    new.write_text(text + "\n")
    old.write_text(  # a table from before the page-in mode
        "| shape | format | pool | tokens | resident | host view | stage sync | stage |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| qwen3 | bf16 | 25% | 512 | 1.0 | 9.0 | 5.0 | 4.0 |\n"
    )
    for src in (new, old):
        (png,) = plot.main(["--prefill", str(src), "--out-dir", str(tmp_path / src.stem)])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("fmt", ["bf16", "int4-g128"])
def test_page_in_waves_per_format_and_on_the_kernels(fmt):
    """The page-in baseline over a quantized bank (torch path), and its kernel path under Triton's interpreter
    at a prefill width (masked waves through pooled_fused_moe), against the resident stack."""
    from pooled_runner.kernels.moe_gemm import interpreting

    dims = (128, 128, 6, 2, 2)
    g = torch.Generator().manual_seed(7)
    routes = prefill.make_routes(dims, 12, g, "cpu")
    resident = prefill.build(dims, fmt, 0.25, "resident", torch.Generator().manual_seed(1), "cpu")
    host_view = prefill.build(dims, fmt, 0.25, "host_view", torch.Generator().manual_seed(1), "cpu")
    ref = prefill.run_stack(prefill.pooled_forward(resident), routes)
    num_slots = 4  # 12 tokens x top-2 reach all 6 experts: two waves per layer
    slots = prefill.build_page_in(host_view, fmt, num_slots)
    systems = [slots]
    if interpreting() and fmt == "bf16":
        assert host_view.bank is not None
        systems.append(
            prefill.PerLayerSlots(
                host_view.bank, fmt, torch.bfloat16, 128, 128, "cpu", num_slots, 2, use_kernels=True
            )
        )
    assert len(systems) == (2 if interpreting() and fmt == "bf16" else 1)
    for system in systems:
        out = prefill.run_stack(system.forward, routes)
        for layer, (a, b) in enumerate(zip(out, ref)):
            assert_close(a, b, f"{fmt} kernels={system.compute.use_kernels} layer {layer}")
        assert system.traffic().waves == 2 * dims[4], system.traffic()
        system.check_invariants()
