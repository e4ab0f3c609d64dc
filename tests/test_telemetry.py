"""Route telemetry: counts and bitmap against an independent count, sticky bits, epochs, boundary rules."""

from __future__ import annotations

import pytest
import torch

from pooled_runner.telemetry import RouteTelemetry


def python_counts(steps: list[tuple[int, torch.Tensor]], layers: list[int]) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for layer, ids in steps:
        for e in ids.flatten().tolist():
            if 0 <= e < layers[layer]:
                out[(layer, e)] = out.get((layer, e), 0) + 1
    return out


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])  # kernel: Triton interpreter


@FUSED
@pytest.mark.parametrize("layers", [[1], [7, 3], [16, 5, 9]])
def test_counts_and_bitmap_match_an_independent_count(layers, fused):
    tel = RouteTelemetry(layers, torch.device("cpu"), fused=fused)
    g = torch.Generator().manual_seed(len(layers))
    steps = []
    for step in range(30):
        layer = step % len(layers)
        T = step % 5  # includes T = 0
        ids = torch.randint(-1, layers[layer], (T, 3), generator=g)
        tel.record(layer, ids)
        steps.append((layer, ids))
    snap = tel.snapshot()
    expected = python_counts(steps, layers)
    for layer in range(len(layers)):
        for e in range(max(layers)):
            want = expected.get((layer, e), 0)
            assert int(snap.counts[layer, e]) == want, f"layer {layer} expert {e}"
            assert bool(snap.routed[layer, e]) == (want > 0)
    assert snap.valid and snap.epoch == 0


@FUSED
def test_out_of_range_ids_set_poison_and_count_nothing(fused):
    tel = RouteTelemetry([4, 6], torch.device("cpu"), fused=fused)
    tel.record(1, torch.tensor([[5, 2], [6, -1]]))  # 6 is out of range for E = 6
    tel.record(0, torch.tensor([[-7, 3]]))  # -7 is neither padding nor an expert
    snap = tel.snapshot()
    assert snap.poisoned and not snap.overflowed and not snap.valid
    assert snap.counts.tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 1]]
    assert "poison" in snap.problems()[0]
    tel.record(0, torch.tensor([[1]]))
    assert tel.snapshot().poisoned  # sticky until reset
    tel.reset()
    assert tel.snapshot().valid and tel.epoch == 1


@FUSED
def test_counters_saturate_with_a_sticky_overflow_bit(fused):
    tel = RouteTelemetry([3], torch.device("cpu"), max_count=5, fused=fused)
    for _ in range(3):
        tel.record(0, torch.tensor([[0, 1], [0, 2]]))
    snap = tel.snapshot()
    assert snap.counts.tolist() == [[5, 3, 3]]
    assert snap.overflowed and not snap.valid
    tel.reset()
    tel.record(0, torch.tensor([[1, 2]]))
    snap = tel.snapshot()
    assert snap.valid and snap.counts.tolist() == [[0, 1, 1]] and snap.epoch == 1


def test_reset_and_snapshot_refused_inside_a_graph_region_and_change_nothing():
    tel = RouteTelemetry([4], torch.device("cpu"))
    tel.record(0, torch.tensor([[1, 2]]))
    with tel.graph_region():
        tel.record(0, torch.tensor([[1, 3]]))  # accumulating is what graphs do
        with pytest.raises(RuntimeError, match="reset\\(\\) during graph capture or replay is refused"):
            tel.reset()
        with pytest.raises(RuntimeError, match="snapshot\\(\\) during graph"):
            tel.snapshot()
    snap = tel.snapshot()
    assert snap.counts.tolist() == [[0, 2, 1, 1]] and snap.epoch == 0


def test_disabled_records_nothing():
    tel = RouteTelemetry([4], torch.device("cpu"), enabled=False)
    tel.record(0, torch.tensor([[1, 9]]))  # not even validated: off costs nothing
    snap = tel.snapshot()
    assert snap.counts.sum() == 0 and not snap.routed.any() and snap.valid


def test_bad_arguments():
    with pytest.raises(ValueError, match="must be non-empty and positive"):
        RouteTelemetry([], torch.device("cpu"))
    with pytest.raises(ValueError, match="max_count=0"):
        RouteTelemetry([2], torch.device("cpu"), max_count=0)
    tel = RouteTelemetry([2], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"layer 1 out of range \[0, 1\)"):
        tel.record(1, torch.tensor([[0]]))


def test_snapshot_survives_reset_on_a_cpu_device():
    tel = RouteTelemetry([4, 3], torch.device("cpu"))
    tel.record(1, torch.tensor([[2, 0], [2, -1]]))
    snap = tel.snapshot()
    tel.reset()
    assert snap.counts.tolist() == [[0, 0, 0, 0], [1, 0, 2, 0]]  # not aliased to the zeroed counters
