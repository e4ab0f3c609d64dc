"""`spec_state`: the spec governors' calibration saved and loaded back, as across a server restart.

The reference for a restored governor (or family) is the original continuing: driven by the same later
observations (the same noise and acceptance draws for the same chosen depths, the first step after the save
untimed, as a server's first verify step after start), both must choose the same depth at every step and end
in the same state. Cost models: `tests.spec_cost_models`'s and `bench.spec_governor_model`'s, with the
latter's noise (lognormal, 1% of steps 2.5x slow: outliers happen).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import stat
import time
from pathlib import Path

import pytest

from bench.spec_family_model import SCENARIOS, step_ms, wander
from bench.spec_governor_model import COST_MODELS as H200_MODELS
from pooled_runner import spec_state
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import SpecGovernor
from pooled_runner.spec_state import load_family, save_family
from tests.spec_cost_models import COST_MODELS, sample_accepted

FINGERPRINT = {"model": "m", "pool_rows": 24, "gpu": "NVIDIA H200", "candidates": {"1": (0, 1, 3)}}


def step(governor: SpecGovernor, costs_ms: dict[int, float], batch_size: int, rng: random.Random, timed: bool = True) -> int:  # fmt: skip
    """One step of `costs_ms` (lognormal noise, 1% of steps 2.5x slow, chain acceptance 0.6); its depth."""
    depth = governor.choose()
    noise = math.exp(rng.gauss(0.0, 0.12)) * (2.5 if rng.random() < 0.01 else 1.0)
    accepted = [sample_accepted(depth, rng) for _ in range(batch_size)]
    governor.observe(depth, accepted, costs_ms[depth] * 1e-3 * noise, timed=timed)
    return depth


def quiet(governor: SpecGovernor) -> bool:
    """No probe in flight, no outliers in a row: a state a restore keeps whole (`spec_state` docstring)."""
    return governor.probing is None and all(arm.outliers == 0 for arm in governor._arms.values())


def through_json(state: dict) -> dict:
    return json.loads(json.dumps(state, allow_nan=False))


COSTS = {**COST_MODELS, "wins 6-12%, bs 16": H200_MODELS["wins 6-12%, bs 16"][1]}


@pytest.mark.parametrize("name", sorted(COSTS))
@pytest.mark.parametrize("learned", [60, 700, 2500])
def test_a_restored_governor_chooses_as_the_original_continuing(name: str, learned: int) -> None:
    costs = COSTS[name]
    rng = random.Random(learned * 31 + len(name))
    original = SpecGovernor(sorted(costs))
    for _ in range(learned):
        step(original, costs, 4, rng)
    while not quiet(original):
        step(original, costs, 4, rng)
    state = through_json(spec_state.governor_state(original))
    restored = SpecGovernor(sorted(costs))
    spec_state.load_governor_state(restored, state)
    assert restored.num_steps == 0 and restored.current == original.current
    assert spec_state.governor_state(restored) == spec_state.governor_state(
        original
    )  # dues relative to the step count: equal
    later = random.Random(learned)
    twin = random.Random(learned)
    ran = [step(original, costs, 4, later, timed=False)]
    again = [step(restored, costs, 4, twin, timed=False)]
    for _ in range(2000):
        ran.append(step(original, costs, 4, later))
        again.append(step(restored, costs, 4, twin))
    assert ran == again
    assert spec_state.governor_state(restored) == spec_state.governor_state(original)
    assert restored.steps_at == original.steps_at and restored.num_switches == original.num_switches


def test_undecided_probe_steps_carried_over_are_kept() -> None:
    """Where drafting wins by a few percent, probes end undecided and carry their steps to the next one: those
    steps, and the depth they were measured against, are part of the state."""
    costs = COSTS["wins 6-12%, bs 16"]
    rng = random.Random(4)
    governor = SpecGovernor(sorted(costs))
    for _ in range(5000):
        step(governor, costs, 16, rng)
        if quiet(governor) and any(arm.carried for arm in governor._arms.values()):
            break
    carried = {d: (arm.carried, arm.carried_against) for d, arm in governor._arms.items() if arm.carried}
    assert carried, "no undecided probe carried its steps over"
    restored = SpecGovernor(sorted(costs))
    spec_state.load_governor_state(restored, through_json(spec_state.governor_state(governor)))
    assert {d: (restored._arms[d].carried, restored._arms[d].carried_against) for d in carried} == carried


def test_a_probe_in_flight_is_dropped_and_its_depth_probed_at_once() -> None:
    costs = COSTS["drafting-loses"]
    rng = random.Random(2)
    governor = SpecGovernor(sorted(costs))
    while governor.probing in (None, governor.current) or not governor._probe or not governor._probe.timed:
        step(governor, costs, 1, rng)
    probed = governor.probing
    assert probed is not None and probed != governor.current
    state = through_json(spec_state.governor_state(governor))
    assert next(a for a in state["arms"] if a["depth"] == probed)["due"] <= 0  # it was due when it started
    restored = SpecGovernor(sorted(costs))
    spec_state.load_governor_state(restored, state)
    assert restored.probing is None and restored.current == governor.current
    assert restored.choose() == probed  # the decision it was to make comes first, from fresh steps
    assert restored._probe is not None and restored._probe.timed == [] and restored._probe.seen == []


def test_the_initial_measurement_in_flight_starts_again() -> None:
    governor = SpecGovernor((0, 1, 3))
    governor.observe(0, [0], 1e-3)
    restored = SpecGovernor((0, 1, 3))
    spec_state.load_governor_state(restored, through_json(spec_state.governor_state(governor)))
    assert restored._arms[0].seconds is None and restored.probing == 0 and restored.choose() == 0
    for _ in range(restored.probe_steps):
        restored.observe(0, [0], 1e-3)
    assert restored._arms[0].seconds == pytest.approx(1e-3) and restored.choose() == 1


def drive_family(family: GovernorFamily, sizes: list[int], rng: random.Random, scenario: dict) -> list[int]:
    """The family over a batch-size trace (a step after another batch size untimed, as the adapter times
    them; the first step untimed); the depths run."""
    depths, last = [], None
    for batch_size in sizes:
        governor = family.governor(batch_size, (0, 1, 3))
        depths.append(
            step(governor, step_ms(scenario, batch_size), batch_size, rng, timed=batch_size == last)
        )
        last = batch_size
    return depths


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("scenario", ["loses everywhere", "wins at bs 16 only", "wins everywhere"])
def test_a_restored_family_chooses_as_the_original_continuing(
    tmp_path: Path, scenario: str, share: bool
) -> None:
    rng = random.Random(9)
    original = GovernorFamily(share=share)
    drive_family(original, wander(1500, 10.0, random.Random(1), 1, 12), rng, SCENARIOS[scenario])
    for _ in range(2000):  # on to a step where no governor is probing: each probing one finishes its probe
        busy = [b for b, g in original.governors.items() if not quiet(g)]
        if not busy:
            break
        drive_family(original, [busy[0]], rng, SCENARIOS[scenario])
    assert all(quiet(g) for g in original.governors.values())
    path = str(tmp_path / "state.json")
    save_family(original, path, FINGERPRINT)
    restored = load_family(path, FINGERPRINT, share=share)
    assert restored is not None and restored.governors.keys() == original.governors.keys()
    assert (restored.acceptance is None) is (not share)
    if share:
        assert restored.acceptance is not None and original.acceptance is not None
        assert restored.governor(1, (0, 1, 3)).acceptance_estimate is restored.acceptance
        assert restored.acceptance.value == original.acceptance.value
    later = wander(
        3000, 10.0, random.Random(2), 1, 16
    )  # batch sizes 13-16 are new: priors from restored ones
    ran = drive_family(original, later, random.Random(5), SCENARIOS[scenario])
    again = drive_family(restored, later, random.Random(5), SCENARIOS[scenario])
    assert ran == again
    assert restored.state_dict() == original.state_dict()


def test_state_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    governor = SpecGovernor((0, 1, 3))
    rng = random.Random(3)
    for _ in range(300):
        step(governor, COSTS["depth1-wins"], 1, rng)
    state = through_json(spec_state.governor_state(governor))
    other = SpecGovernor((0, 1, 3))
    before = spec_state.governor_state(other)
    with pytest.raises(ValueError, match=r"candidates \[0, 1, 3\], this governor's are \[0, 1\]"):
        spec_state.load_governor_state(SpecGovernor((0, 1)), state)
    with pytest.raises(ValueError, match="'margin': 0.05"):
        spec_state.load_governor_state(SpecGovernor((0, 1, 3), margin=0.05), state)
    broken = json.loads(json.dumps(state))
    broken["arms"][2]["interval"] = 5000
    with pytest.raises(ValueError, match="depth 3's interval=5000 outside 32..1024"):
        spec_state.load_governor_state(other, broken)
    broken = json.loads(json.dumps(state))
    broken["arms"][1]["seconds"] = -1.0
    with pytest.raises(ValueError, match="depth 1's seconds=-1.0 must be a finite number > 0"):
        spec_state.load_governor_state(other, broken)
    broken = json.loads(json.dumps(state))
    del broken["steps_at"]
    with pytest.raises(KeyError):
        spec_state.load_governor_state(other, broken)
    assert spec_state.governor_state(other) == before  # checked whole before anything changed
    with pytest.raises(ValueError, match="share=True"):
        GovernorFamily.from_state(GovernorFamily().state_dict(), share=False)


# -- the file ---------------------------------------------------------------------------------------------
def learned_family() -> GovernorFamily:
    family = GovernorFamily()
    drive_family(
        family, wander(400, 10.0, random.Random(3), 1, 6), random.Random(4), SCENARIOS["loses everywhere"]
    )
    return family


def test_a_missing_file_starts_fresh_with_an_info_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pooled_runner"):
        assert load_family(str(tmp_path / "none.json"), FINGERPRINT) is None
    assert [r.levelname for r in caplog.records] == ["INFO"] and "start fresh" in caplog.text


def test_another_fingerprint_starts_fresh_naming_the_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.json")
    save_family(learned_family(), path, FINGERPRINT)
    assert load_family(path, {**FINGERPRINT, "candidates": {"1": [0, 1, 3]}}) is not None  # as JSON reads it
    now = {**FINGERPRINT, "gpu": "NVIDIA H100 80GB HBM3", "tp_size": 1}
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert load_family(path, now) is None
    assert "gpu (saved 'NVIDIA H200', now 'NVIDIA H100 80GB HBM3')" in caplog.text
    assert "tp_size (saved None, now 1)" in caplog.text and "model" not in caplog.text.split("differs in")[1]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"version": 1, "fingerprint": {}, "fam', "cannot be read"),  # cut short
        ("", "cannot be read"),  # a rename without fsync, then a power loss
        ("\xff\xfe garbage", "cannot be read"),
        ("[1, 2]", "is of version 'list'"),
        ('{"version": 0, "fingerprint": {}, "family": {}}', "is of version 0, not 1"),
        (
            '{"version": 1, "fingerprint": FP, "family": {"share": true}}',
            "does not fit these governors (KeyError",
        ),
        ('{"version": 1, "fingerprint": [], "family": {}}', "differs in the whole fingerprint"),
        ("[" * 100_000 + "]" * 100_000, "cannot be read (RecursionError"),  # nested past the recursion limit
    ],
)
def test_a_corrupt_or_foreign_file_starts_fresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, match: str
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content.replace("FP", json.dumps(FINGERPRINT)).encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert load_family(str(path), FINGERPRINT) is None
    assert match in caplog.text and "start fresh" in caplog.text, caplog.text


def test_other_family_settings_start_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "state.json")
    save_family(learned_family(), path, FINGERPRINT)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert load_family(path, FINGERPRINT, min_probe_interval=16) is None
        assert load_family(path, FINGERPRINT, acceptance_decay=0.99) is None
    assert "'min_probe_interval': 32" in caplog.text and "acceptance decay 0.995" in caplog.text


def test_the_file_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.json"
    save_family(learned_family(), str(path), FINGERPRINT)
    before = path.read_bytes()
    assert json.loads(before)["version"] == spec_state.STATE_VERSION
    with pytest.raises(TypeError):  # fails while the text is built: nothing is written
        save_family(GovernorFamily(), str(path), {"gpu": object()})
    real_fdopen = os.fdopen

    def half_written(fd: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        f = real_fdopen(fd, *args, **kwargs)

        def write(text: str) -> int:
            f.__class__.write(f, text[: len(text) // 2])
            raise OSError(28, "No space left on device")

        f.write = write  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(spec_state.os, "fdopen", half_written)
    with pytest.raises(OSError, match="No space left"):
        save_family(GovernorFamily(), str(path), FINGERPRINT)
    monkeypatch.undo()

    def no_rename(src: str, dst: str) -> None:
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(spec_state.os, "replace", no_rename)
    with pytest.raises(OSError, match="Permission denied"):
        save_family(GovernorFamily(), str(path), FINGERPRINT)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["state.json"]  # no temporary file left behind


def test_an_infinite_depth_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Python's json reads Infinity, and int() of it raises OverflowError (not ValueError): still a warning."""
    state = {"version": 1, "fingerprint": FINGERPRINT, "family": learned_family().state_dict()}
    state["family"]["governors"][0]["arms"][0]["carried_against"] = math.inf
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert load_family(str(path), FINGERPRINT) is None
    assert "does not fit these governors (OverflowError" in caplog.text, caplog.text


def test_a_save_keeps_the_file_mode_and_clears_killed_saves(tmp_path: Path) -> None:
    """A new file is 0644 (not mkstemp's 0600), a saved one keeps its mode; a killed save's temporary file
    older than STALE_TEMPORARY_SECONDS is removed at the next save, a younger one (a save in flight) is not."""
    path = tmp_path / "state.json"
    save_family(learned_family(), str(path), FINGERPRINT)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o640)
    old, young = tmp_path / ".state.json.killed.tmp", tmp_path / ".state.json.inflight.tmp"
    for leftover in (old, young):
        leftover.write_text("{")
    past = time.time() - spec_state.STALE_TEMPORARY_SECONDS - 5
    os.utime(old, (past, past))
    save_family(learned_family(), str(path), FINGERPRINT)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not old.exists() and young.exists()
    assert load_family(str(path), FINGERPRINT) is not None
