"""`--moe-expert-pool-spec-governor-state`: the path checks, the default directory under POOLED_RUNNER_CACHE_DIR
(one file per serving configuration, `spec_state.state_file`), the CLI flag and the launcher's hand-over."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

from pooled_runner.config import PoolConfig, add_cli_arguments, config_from_cli
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_state import load_family, save_family, state_file, state_path_problem
from tests.test_spec_state import FINGERPRINT, learned_family

FLAG = "--moe-expert-pool-spec-governor-state"


def test_a_path_the_server_cannot_write_is_named(tmp_path: Path) -> None:
    assert state_path_problem(str(tmp_path / "state.json")) is None
    assert state_path_problem(str(tmp_path)) is None  # a directory holds a file per serving configuration
    missing = tmp_path / "nowhere"
    assert state_path_problem(str(missing / "state.json")) == f"its directory {missing} does not exist"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert state_path_problem(str(locked / "s.json")) == f"its directory {locked} is not writable"
        assert state_path_problem(str(locked)) == f"its directory {locked} is not writable"


# -- configuration ----------------------------------------------------------------------------------------
def test_the_flag_needs_the_cost_governor_and_a_writable_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        ValueError, match=f"{FLAG} .* it needs --moe-expert-pool-spec-governor cost \\(got 'off'\\)"
    ):
        PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor_state=str(tmp_path / "s.json"))
    with pytest.raises(ValueError, match=f"{FLAG} .*nowhere/s.json: its directory .* does not exist"):
        PoolConfig.resolve(
            pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="/nowhere/s.json"
        )
    with pytest.raises(ValueError, match="spec_governor_state=3 must be a path"):
        PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state=3)
    monkeypatch.chdir(tmp_path)
    config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="s.json")
    assert config.spec_governor_state == str(tmp_path / "s.json")  # the children may run elsewhere
    assert PoolConfig.resolve(pool_rows=4, device="cpu").spec_governor_state == ""  # no governor: off
    # only `resolve` asks the file system: a config rebuilt in a scheduler where the directory is gone still is
    rebuilt = PoolConfig(
        pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="/nowhere/s.json"
    )
    assert rebuilt.replace(pool_rows=5).spec_governor_state == "/nowhere/s.json"


def test_the_cli_flag_derives_from_the_field(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    path = str(tmp_path / "s.json")
    args = parser.parse_args(
        ["--moe-expert-pool-rows", "4", "--moe-expert-pool-spec-governor", "cost", FLAG, path]
    )
    assert config_from_cli(args).spec_governor_state == path
    assert parser.parse_args(["--moe-expert-pool-rows", "4"]).spec_governor_state == "auto"
    off = parser.parse_args(
        ["--moe-expert-pool-rows", "4", "--moe-expert-pool-spec-governor", "cost", FLAG, "off"]
    )
    assert config_from_cli(off).spec_governor_state == ""


def test_the_launcher_refuses_a_bad_state_path_and_hands_a_good_one_to_the_children(tmp_path: Path) -> None:
    from pooled_runner.sglang.serve_config import ServeConfig
    from tests.test_launch_plan import QWEN3_MOE, plan, write_model

    model = write_model(tmp_path, QWEN3_MOE)
    base = ["--model-path", str(model), "--moe-expert-pool-rows", "8", "--speculative-algorithm", "EAGLE"]
    cost = [*base, "--speculative-adaptive", "--moe-expert-pool-spec-governor", "cost"]
    with pytest.raises(ValueError, match=f"(?s)cannot launch:.*{FLAG} .*: its directory .* does not exist"):
        plan([*cost, FLAG, str(tmp_path / "missing" / "s.json")])
    with pytest.raises(ValueError, match=f"{FLAG} .* needs --moe-expert-pool-spec-governor cost"):
        plan([*base, FLAG, str(tmp_path / "s.json")])
    p = plan([*cost, FLAG, str(tmp_path / "s.json")])
    assert p.serve.pool is not None and p.serve.pool.spec_governor_state == str(tmp_path / "s.json")
    assert ServeConfig.from_json(p.serve.to_json()) == p.serve


def test_the_cost_governor_keeps_its_state_in_the_cache_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto (the default) with the cost governor: `spec_governor` under POOLED_RUNNER_CACHE_DIR, made at
    resolution; off (or "") and no governor: ""; a config built without `resolve` cannot decide auto."""
    monkeypatch.setenv("POOLED_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert config.spec_governor_state == str(tmp_path / "cache" / "spec_governor")
    assert os.path.isdir(config.spec_governor_state)
    assert config.replace(pool_rows=5).spec_governor_state == config.spec_governor_state
    for off in ("off", ""):
        resolved = PoolConfig.resolve(
            pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state=off
        )
        assert resolved.spec_governor_state == ""
    assert PoolConfig(pool_rows=4, device="cpu", spec_governor="off").spec_governor_state == ""
    assert PoolConfig(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="off").spec_governor_state == ""  # fmt: skip
    with pytest.raises(ValueError, match=r"spec_governor_state is 'auto': call PoolConfig.resolve\(\)"):
        PoolConfig(pool_rows=4, device="cpu", spec_governor="cost")
    # a named directory is taken as it is
    mine = tmp_path / "mine"
    mine.mkdir()
    named = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state=str(mine))
    assert named.spec_governor_state == str(mine)


def test_a_default_directory_that_cannot_be_made_turns_the_state_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The user named no file: a cache directory that cannot be made (here a file is in the way) must not stop
    the server; a warning names the directory and the two ways out."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POOLED_RUNNER_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert config.spec_governor_state == ""
    assert f"{blocker / 'spec_governor'} cannot be made" in caplog.text, caplog.text
    assert "POOLED_RUNNER_CACHE_DIR" in caplog.text and FLAG in caplog.text, caplog.text


def test_a_directory_keeps_one_file_per_serving_configuration(tmp_path: Path) -> None:
    """`state_file`: a file path is itself; in a directory each fingerprint has its own file (the same one for
    the same fingerprint however its keys are ordered or its tuples spelt), so two configurations sharing the
    default directory never read or overwrite each other's state."""
    assert state_file(str(tmp_path / "s.json"), FINGERPRINT) == str(tmp_path / "s.json")
    same = {k: FINGERPRINT[k] for k in reversed(list(FINGERPRINT))} | {"candidates": {"1": [0, 1, 3]}}
    other = {**FINGERPRINT, "pool_rows": 25}
    mine, theirs = state_file(str(tmp_path), FINGERPRINT), state_file(str(tmp_path), other)
    assert mine == state_file(str(tmp_path), same)
    assert mine != theirs and os.path.dirname(mine) == os.path.dirname(theirs) == str(tmp_path)
    assert os.path.basename(mine).startswith("spec-governor-") and mine.endswith(".json"), mine
    save_family(learned_family(), mine, FINGERPRINT)
    save_family(GovernorFamily(), theirs, other)
    learned = learned_family()
    restored = load_family(state_file(str(tmp_path), same), same)
    assert restored is not None and sorted(restored.governors) == sorted(learned.governors) != []
    fresh = load_family(theirs, other)
    assert fresh is not None and fresh.governors == {}
    assert load_family(theirs, FINGERPRINT) is None  # another configuration's file is foreign
