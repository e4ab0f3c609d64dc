"""`CostAwareSpecParams` with `--moe-expert-pool-spec-governor-state`: the governors' calibration saved inside
SGLang's own `AdaptiveController` (no server, no model) and loaded back by the next params, as across a restart.

Harness (fake worker, fake clock, cost models) from test_spec_governor_sglang.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from pooled_runner.spec_state import governor_state
from tests.engine.test_spec_governor_sglang import DRAFTING_LOSES, FakeClock, serve

FINGERPRINT = {"model": "m", "gpu": "cpu", "pool_rows": 12}


def params_at(path: Path | str, fingerprint: dict | None = None, **kwargs):  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(
        initial_steps=3, clock=clock, state_path=str(path), fingerprint=fingerprint or FINGERPRINT, **kwargs
    )
    return params, clock


def test_saves_come_at_64_128_256_512_then_every_1024_completions() -> None:
    from pooled_runner.sglang.spec_governor import FIRST_SAVE, SAVE_EVERY, save_due

    assert (FIRST_SAVE, SAVE_EVERY) == (64, 1024)
    assert [n for n in range(5000) if save_due(n)] == [64, 128, 256, 512, 1024, 2048, 3072, 4096]


def test_state_is_saved_as_it_learns_and_a_restart_continues(tmp_path: Path) -> None:
    """Where drafting loses at bs 1, a cold governor probes depth 1 within its first steps; restarted from the
    state of one that ran 400 steps, the governor runs depth 0 from its first step and probes depth 1 only when
    its interval is up."""
    path = tmp_path / "state.json"
    first, clock = params_at(path)
    assert first.saves_state and first.family.governors == {}
    serve(first, clock, DRAFTING_LOSES, 63, batch_size=1, seed=1)
    assert not path.exists()
    serve(first, clock, DRAFTING_LOSES, 1, batch_size=1, seed=2)
    saved = json.loads(path.read_text())
    assert saved["fingerprint"] == FINGERPRINT and saved["family"]["governors"][0]["batch_size"] == 1
    serve(first, clock, DRAFTING_LOSES, 64, batch_size=1, seed=3)
    assert json.loads(path.read_text())["family"] == first.family.state_dict()  # saved again at 128
    serve(first, clock, DRAFTING_LOSES, 272, batch_size=1, seed=5)
    first.close()  # as at exit: the steps since the save at 256 saved too
    learned = first.governor(1)
    assert learned.current == 0 and learned._arms[1].num_lost >= 2, learned._arms
    assert json.loads(path.read_text())["family"] == first.family.state_dict()

    second, clock = params_at(path)
    restored = second.governor(1)
    assert restored.current == 0 and governor_state(restored) == governor_state(learned)
    due = learned._arms[1].due - learned.num_steps
    _, _, worker = serve(second, clock, DRAFTING_LOSES, max(due, 0) + 8, batch_size=1, seed=4)
    assert worker.ran[: max(due, 0)] == [0] * max(due, 0), worker.ran  # no probe before its interval is up
    second.close()
    fresh, clock = params_at(tmp_path / "other.json")
    _, _, cold = serve(fresh, clock, DRAFTING_LOSES, 40, batch_size=1, seed=4)
    assert 1 in cold.ran[:40], cold.ran  # a cold start probes at once


def test_another_fingerprint_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    first, clock = params_at(path)
    serve(first, clock, DRAFTING_LOSES, 200, batch_size=1, seed=1)
    first.close()
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        second, _ = params_at(path, {**FINGERPRINT, "pool_rows": 24})
    assert second.family.governors == {} and "pool_rows (saved 12, now 24)" in caplog.text
    second.close()


def publish_ranks(monkeypatch: pytest.MonkeyPatch, tp_rank: int, dp_rank: int | None) -> None:
    """Ranks as SGLang publishes them (`runtime_context.get_parallel`; stood in for here: SGLang's own override
    validates a whole topology, and what earlier tests in the process left there decides what it accepts)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    monkeypatch.setattr(
        runtime_context, "get_parallel", lambda: SimpleNamespace(tp_rank=tp_rank, dp_rank=dp_rank)
    )


def test_only_the_writing_rank_saves_and_every_rank_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pooled_runner.sglang.spec_governor import writes_state

    def ranks(tp_rank: int, dp_rank: int | None) -> None:
        publish_ranks(monkeypatch, tp_rank, dp_rank)

    ranks(0, None)
    assert writes_state()  # TP rank 0, no data parallelism
    ranks(0, 1)
    assert not writes_state()
    ranks(0, 0)
    path = tmp_path / "state.json"
    first, clock = params_at(path)
    serve(first, clock, DRAFTING_LOSES, 100, batch_size=1, seed=1)
    first.close()
    before = path.read_bytes()
    ranks(1, None)
    other, clock = params_at(path)
    assert not other.saves_state and governor_state(other.governor(1)) == governor_state(first.governor(1))
    serve(other, clock, DRAFTING_LOSES, 50, batch_size=1, seed=2)
    assert not other.save_state()
    other.close()
    assert path.read_bytes() == before


def test_the_path_comes_from_the_launcher_and_saves_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `state_path`, the scheduler's params read the launcher's `ServeConfig` (the flag); the fingerprint
    names this server (SGLang's version, the pool, the slots' candidates); a save at exit is registered."""
    import pooled_runner.sglang.spec_governor as adapter
    from pooled_runner.config import PoolConfig
    from pooled_runner.sglang.serve_config import ServeConfig

    path = tmp_path / "state.json"
    pool = PoolConfig.resolve(pool_rows=8, device="cpu", spec_governor="cost", spec_governor_state=str(path))
    monkeypatch.setenv(
        "POOLED_RUNNER_SERVE_CONFIG", ServeConfig(pool=pool, cpu=True, speculative=True).to_json()
    )
    registered: list[object] = []
    monkeypatch.setattr(adapter.atexit, "register", registered.append)
    monkeypatch.setattr(adapter.atexit, "unregister", registered.remove)
    params = adapter.CostAwareSpecParams(initial_steps=3, clock=FakeClock())
    assert params.state_path == str(path) and registered == [params.save_state]
    fingerprint = params.fingerprint
    assert fingerprint["sglang"] == "0.5.23" and fingerprint["pool_rows"] == 8 and fingerprint["gpu"]
    assert fingerprint["candidates"] == {"1": [0, 1, 3, 5, 7], "8": [0, 1, 3], "32": [0, 1], "64": [0]}
    assert "model_path" in fingerprint  # None outside a server
    assert len(fingerprint["pooled_runner_code"]) == 16  # this checkout's code (spec_state_paths.code_digest)
    params.get_steps_for_batch(1)
    params.on_verify_complete([0], 1)
    registered[0]()  # what atexit runs
    assert json.loads(path.read_text())["fingerprint"] == json.loads(json.dumps(fingerprint))
    params.close()
    assert registered == []
    monkeypatch.delenv("POOLED_RUNNER_SERVE_CONFIG")
    assert adapter.CostAwareSpecParams(initial_steps=3).state_path == ""  # off


def test_the_default_directory_keeps_a_file_per_configuration_across_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the cost governor and no state flag (auto), the scheduler's params keep their state in a file of
    this configuration under POOLED_RUNNER_CACHE_DIR/spec_governor; a restart of the same configuration reads
    it back, one of another pool size gets a file of its own and starts fresh."""
    import pooled_runner.sglang.spec_governor as adapter
    from pooled_runner.config import PoolConfig
    from pooled_runner.sglang.serve_config import ServeConfig

    # not tests/conftest.py's directory: the default one, under the cache
    monkeypatch.delenv("POOLED_RUNNER_SPEC_STATE_DIR")
    monkeypatch.setenv("POOLED_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(adapter.atexit, "register", lambda fn: None)
    monkeypatch.setattr(adapter.atexit, "unregister", lambda fn: None)
    publish_ranks(monkeypatch, 0, None)

    def started(pool_rows: int, cleaned: bool = False) -> tuple[adapter.CostAwareSpecParams, FakeClock]:
        pool = PoolConfig.resolve(pool_rows=pool_rows, device="cpu", spec_governor="cost")
        serve_config = ServeConfig(pool=pool, cpu=True, speculative=True)
        monkeypatch.setenv("POOLED_RUNNER_SERVE_CONFIG", serve_config.to_json())
        if cleaned:  # the directory removed between the launcher's resolution and the scheduler's start
            shutil.rmtree(pool.spec_governor_state)
        clock = FakeClock()
        return adapter.CostAwareSpecParams(initial_steps=3, clock=clock), clock

    first, clock = started(8)
    directory = tmp_path / "cache" / "spec_governor"
    assert Path(first.state_path).parent == directory and first.saves_state, first.state_path
    serve(first, clock, DRAFTING_LOSES, 100, batch_size=1, seed=1)
    first.close()
    assert os.listdir(directory) == [Path(first.state_path).name]
    again, _ = started(8)
    assert again.state_path == first.state_path
    assert governor_state(again.governor(1)) == governor_state(first.governor(1))
    again.close()
    other, clock = started(9)
    assert other.state_path != first.state_path and Path(other.state_path).parent == directory
    assert other.saves_state and other.family.governors == {}
    serve(other, clock, DRAFTING_LOSES, 70, batch_size=1, seed=2)
    other.close()
    assert sorted(os.listdir(directory)) == sorted([Path(first.state_path).name, Path(other.state_path).name])
    # the directory removed after launch (a cache cleanup): still a directory, made again, the state saved in it
    again, clock = started(8, cleaned=True)
    assert again.state_path == first.state_path and again.family.governors == {}
    serve(again, clock, DRAFTING_LOSES, 70, batch_size=1, seed=3)
    again.close()
    assert os.listdir(directory) == [Path(first.state_path).name]


def test_a_failed_save_is_logged_once_and_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    params, clock = params_at(gone / "state.json")
    gone.rmdir()
    serve(params, clock, DRAFTING_LOSES, 10, batch_size=1, seed=1)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert not params.save_state()
        serve(params, clock, DRAFTING_LOSES, 1, batch_size=1, seed=2)
        assert not params.save_state()
    assert caplog.text.count("cannot save the state") == 1
    params.close()


def test_a_start_removes_other_state_files_not_written_for_a_month(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a state directory the writing rank's params remove other configurations' state files last written
    more than `MAX_STATE_AGE_DAYS` ago (`spec_state_paths.prune_states`) and keep their own however old (and
    mark it used at the load), the younger ones and files of other names; a reading rank removes nothing."""
    import time

    import pooled_runner.sglang.spec_governor as adapter
    from pooled_runner.spec_state_paths import MAX_STATE_AGE_DAYS

    monkeypatch.setattr(adapter.atexit, "register", lambda fn: None)
    monkeypatch.setattr(adapter.atexit, "unregister", lambda fn: None)
    directory = tmp_path / "states"
    directory.mkdir()
    publish_ranks(monkeypatch, 0, None)
    first, clock = params_at(str(directory) + os.sep)
    serve(first, clock, DRAFTING_LOSES, 70, batch_size=1, seed=1)
    first.close()
    mine = Path(first.state_path)
    assert mine.parent == directory and mine.exists(), mine
    old, young, notes = (directory / n for n in ("spec-governor-0123456789abcdef.json", "spec-governor-fedcba9876543210.json", "notes.json"))  # fmt: skip
    for path in (old, young, notes):
        path.write_text("{}")
    past = time.time() - (MAX_STATE_AGE_DAYS + 1) * 86400
    for path in (old, notes, mine):
        os.utime(path, (past, past))
    publish_ranks(monkeypatch, 1, None)  # a reading rank: nothing removed
    reader, _ = params_at(str(directory) + os.sep)
    reader.close()
    assert sorted(os.listdir(directory)) == sorted(p.name for p in (mine, old, young, notes))
    publish_ranks(monkeypatch, 0, None)
    again, _ = params_at(str(directory) + os.sep)
    assert governor_state(again.governor(1)) == governor_state(first.governor(1))  # its own old file, read
    assert mine.stat().st_mtime > past + 86400  # and marked used (`mark_used`): its time is its last use
    again.close()
    assert sorted(os.listdir(directory)) == sorted(p.name for p in (mine, young, notes))
