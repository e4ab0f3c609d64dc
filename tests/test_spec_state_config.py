"""`--moe-expert-pool-spec-governor-state`: the path checks, the default directory under POOLED_RUNNER_CACHE_DIR
(one file per serving configuration, `spec_state_paths.state_file`), the CLI flag and the launcher's hand-over."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pooled_runner.config import PoolConfig, add_cli_arguments, config_from_cli
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_state import load_family, save_family
from pooled_runner.spec_state_paths import (
    MAX_STATE_AGE_DAYS,
    code_digest,
    prune_states,
    state_file,
    state_path_problem,
)
from tests.test_spec_state import FINGERPRINT, learned_family

FLAG = "--moe-expert-pool-spec-governor-state"


def test_a_path_the_server_cannot_write_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path ending in a separator is a directory (a file per configuration in it), any other a file."""
    assert state_path_problem(str(tmp_path / "state.json")) is None
    assert state_path_problem(str(tmp_path) + os.sep) is None
    assert state_path_problem(str(tmp_path)).startswith("is a directory (end it with a separator")  # type: ignore[union-attr]
    missing = tmp_path / "nowhere"
    assert state_path_problem(str(missing / "state.json")) == f"its directory {missing} does not exist"
    assert state_path_problem(str(missing) + os.sep) == "the directory does not exist"
    # not writable (os.access stood in for: root writes anywhere, and CI may run as root)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert state_path_problem(str(tmp_path / "s.json")) == f"its directory {tmp_path} is not writable"
    assert state_path_problem(str(tmp_path) + os.sep) == "the directory is not writable"


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
    """auto (the default) with the cost governor: `spec_governor` under POOLED_RUNNER_CACHE_DIR (or
    POOLED_RUNNER_SPEC_STATE_DIR), made at resolution and ending in a separator; off (any case, or "") and no
    governor: ""; a config built without `resolve` cannot decide auto; an invalid request makes no directory."""
    monkeypatch.delenv("POOLED_RUNNER_SPEC_STATE_DIR")  # tests/conftest.py's
    monkeypatch.setenv("POOLED_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="pool_rows=0"):
        PoolConfig.resolve(pool_rows=0, device="cpu", spec_governor="cost")
    assert not (tmp_path / "cache").exists()
    config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert config.spec_governor_state == str(tmp_path / "cache" / "spec_governor") + os.sep
    assert os.path.isdir(config.spec_governor_state)
    assert config.replace(pool_rows=5).spec_governor_state == config.spec_governor_state
    assert (
        PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="AUTO")
        == config
    )
    for off in ("off", "", "OFF", " Off "):
        resolved = PoolConfig.resolve(
            pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state=off
        )
        assert resolved.spec_governor_state == "", off
    assert PoolConfig(pool_rows=4, device="cpu", spec_governor="off").spec_governor_state == ""
    assert PoolConfig(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="off").spec_governor_state == ""  # fmt: skip
    with pytest.raises(ValueError, match=r"spec_governor_state is 'auto': call PoolConfig.resolve\(\)"):
        PoolConfig(pool_rows=4, device="cpu", spec_governor="cost")
    monkeypatch.setenv("POOLED_RUNNER_SPEC_STATE_DIR", str(tmp_path / "elsewhere"))
    moved = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert moved.spec_governor_state == str(tmp_path / "elsewhere") + os.sep and os.path.isdir(
        moved.spec_governor_state
    )


def test_a_named_directory_is_decided_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path naming an existing directory, or ending in a separator, resolves to an absolute directory path
    ending in one (so `state_file` never takes it for a file later, even once the directory is gone); a new
    directory must exist, as a file's directory must."""
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.chdir(tmp_path)
    for named in ("mine", "mine/", str(mine)):
        config = PoolConfig.resolve(
            pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state=named
        )
        assert config.spec_governor_state == str(mine) + os.sep, named
    mine.rmdir()
    assert state_file(config.spec_governor_state, FINGERPRINT).startswith(str(mine) + os.sep)
    with pytest.raises(ValueError, match=f"{FLAG} .*new/: the directory does not exist"):
        PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost", spec_governor_state="new/")


def test_a_default_directory_that_cannot_be_made_turns_the_state_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The user named no file: a default directory that cannot be made (here a file is in the way) or written
    must not stop the server; a warning names the directory, why, and the ways out."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POOLED_RUNNER_SPEC_STATE_DIR", str(blocker / "spec_governor"))
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert config.spec_governor_state == ""
    assert f"directory {blocker / 'spec_governor'}{os.sep}: it cannot be made" in caplog.text, caplog.text
    assert "POOLED_RUNNER_SPEC_STATE_DIR" in caplog.text and f"{FLAG} off" in caplog.text, caplog.text
    caplog.clear()
    monkeypatch.setenv("POOLED_RUNNER_SPEC_STATE_DIR", str(tmp_path / "locked"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # not writable (root writes anywhere)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        config = PoolConfig.resolve(pool_rows=4, device="cpu", spec_governor="cost")
    assert config.spec_governor_state == ""
    assert f"directory {tmp_path / 'locked'}{os.sep}: the directory is not writable" in caplog.text, (
        caplog.text
    )


def test_a_directory_keeps_one_file_per_serving_configuration(tmp_path: Path) -> None:
    """`state_file`: a file path is itself; in a directory each fingerprint has its own file (the same one for
    the same fingerprint however its keys are ordered or its tuples spelt), so two configurations sharing the
    default directory never read or overwrite each other's state."""
    assert state_file(str(tmp_path / "s.json"), FINGERPRINT) == str(tmp_path / "s.json")
    same = {k: FINGERPRINT[k] for k in reversed(list(FINGERPRINT))} | {"candidates": {"1": [0, 1, 3]}}
    other = {**FINGERPRINT, "pool_rows": 25}
    directory = str(tmp_path) + os.sep
    mine, theirs = state_file(directory, FINGERPRINT), state_file(directory, other)
    assert mine == state_file(directory, same)
    assert mine != theirs and os.path.dirname(mine) == os.path.dirname(theirs) == str(tmp_path)
    assert os.path.basename(mine).startswith("spec-governor-") and mine.endswith(".json"), mine
    save_family(learned_family(), mine, FINGERPRINT)
    save_family(GovernorFamily(), theirs, other)
    learned = learned_family()
    restored = load_family(state_file(directory, same), same)
    assert restored is not None and sorted(restored.governors) == sorted(learned.governors) != []
    fresh = load_family(theirs, other)
    assert fresh is not None and fresh.governors == {}
    assert load_family(theirs, FINGERPRINT) is None  # another configuration's file is foreign


def test_a_fingerprint_json_cannot_hold_turns_the_state_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server must not fail to start over its calibration: a fingerprint that names no file is logged, off."""
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        assert state_file(str(tmp_path) + os.sep, {**FINGERPRINT, "odd": object()}) == ""
        assert state_file(str(tmp_path) + os.sep, {1: "a", "b": 2}) == ""
    assert caplog.text.count("spec governor state: off, the fingerprint") == 2, caplog.text


def test_the_code_digest_changes_with_the_code(tmp_path: Path) -> None:
    """`code_digest` (the fingerprint's `pooled_runner_code`): the same sources give the same digest wherever
    they lie; a changed, added or renamed module, in a subpackage too, gives another; other files do not count."""

    def package(root: Path, files: dict[str, str]) -> str:
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return str(root / "__init__.py")

    base = {"__init__.py": "", "a.py": "x = 1\n", "sub/b.py": "y = 2\n"}
    first = code_digest([package(tmp_path / "one", base)])
    assert len(first) == 16 and int(first, 16) >= 0
    assert code_digest([package(tmp_path / "two", base)]) == first
    (tmp_path / "two" / "notes.txt").write_text("not code")
    assert code_digest([str(tmp_path / "two" / "__init__.py")]) == first
    variants = [
        {**base, "sub/b.py": "y = 3\n"},
        {**base, "c.py": ""},
        {"__init__.py": "", "a2.py": "x = 1\n", "sub/b.py": "y = 2\n"},
    ]
    digests = {code_digest([package(tmp_path / f"v{i}", files)]) for i, files in enumerate(variants)}
    assert len(digests) == 3 and first not in digests


def test_prune_states_removes_only_old_state_files_of_other_configurations(tmp_path: Path) -> None:
    """`prune_states`: in a directory, the state files (`state_file`'s names) last written more than the age
    ago go, except the one kept; younger ones, files of other names and other directories' files stay."""
    directory = str(tmp_path) + os.sep
    mine = state_file(directory, FINGERPRINT)
    theirs = state_file(directory, {**FINGERPRINT, "pool_rows": 7})
    young = state_file(directory, {**FINGERPRINT, "pool_rows": 5})
    others = [
        tmp_path / n
        for n in ("notes.json", "spec-governor-0123.json", "spec-governor-0123456789abcdef.json.bak")
    ]
    nested = tmp_path / "sub" / Path(theirs).name
    nested.parent.mkdir()
    paths = [Path(mine), Path(theirs), Path(young), *others, nested]
    for path in paths:
        path.write_text("{}")
    old = time.time() - (MAX_STATE_AGE_DAYS + 0.5) * 86400
    for path in paths:
        if path != Path(young):
            os.utime(path, (old, old))
    # a link named as a state file, to an old file elsewhere, itself old: not ours to remove
    pinned = tmp_path / "sub" / "pinned.json"
    pinned.write_text("{}")
    link = tmp_path / "spec-governor-00000000000000aa.json"
    link.symlink_to(pinned)
    for path in (pinned, link):
        os.utime(path, (old, old), follow_symlinks=False)
    assert prune_states(directory, keep=mine) == [theirs]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(mine).name, Path(young).name, "sub", link.name, *(p.name for p in others)]
    )
    assert nested.exists()
    # a shorter age takes the younger one too (written 0 days ago: not yet); the kept one never
    os.utime(young, (old, old))
    assert prune_states(directory, keep=mine, max_age_days=1.0) == [young]
    assert prune_states(directory, keep=mine) == [] and Path(mine).exists()
    with pytest.raises(ValueError, match="max_age_days=0"):
        prune_states(directory, keep=mine, max_age_days=0)


@pytest.mark.parametrize("hard_links", [True, False])
@pytest.mark.parametrize("newer_meanwhile", [False, True])
def test_prune_states_keeps_a_file_replaced_while_it_prunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, newer_meanwhile: bool, hard_links: bool
) -> None:
    """A server that replaces its old state file (a save: write beside, `os.replace`) just after the pruner saw
    it old keeps the fresh file: the pruner reads the age again on the file it took aside and puts a young one
    back. Where a still newer save took the name while the pruner held the file aside, that one stays. On a
    filesystem without hard links too. No aside file is left over."""
    directory = str(tmp_path) + os.sep
    theirs = state_file(directory, {**FINGERPRINT, "pool_rows": 7})
    Path(theirs).write_text('{"old": true}')
    old = time.time() - (MAX_STATE_AGE_DAYS + 0.5) * 86400
    os.utime(theirs, (old, old))
    real_replace, real_unlink, real_rename, real_lstat = os.replace, os.unlink, os.rename, os.lstat
    saves: list[str] = []

    def owner_saves(text: str) -> None:
        fresh = tmp_path / f"fresh-{len(saves)}"
        fresh.write_text(text)
        real_replace(fresh, theirs)
        saves.append(text)

    def first_touch(real: Any) -> Any:
        def wrapped(src: Any, *args: Any, **kwargs: Any) -> Any:
            if os.fspath(src) == theirs and not saves:  # the pruner acts on the file it saw old
                owner_saves('{"fresh": 1}')
            return real(src, *args, **kwargs)

        return wrapped

    def lstat(path: Any, *args: Any, **kwargs: Any) -> Any:
        aside = os.path.basename(os.fspath(path)).startswith("." + Path(theirs).name)
        if aside and newer_meanwhile and len(saves) == 1:  # the pruner holds the fresh file aside
            owner_saves('{"newer": 22}')
        return real_lstat(path, *args, **kwargs)

    def no_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(os, "unlink", first_touch(real_unlink))
    monkeypatch.setattr(os, "rename", first_touch(real_rename))
    monkeypatch.setattr(os, "lstat", lstat)
    if not hard_links:
        monkeypatch.setattr(os, "link", no_link)
    assert prune_states(directory, keep=state_file(directory, FINGERPRINT)) == []
    assert saves == ['{"fresh": 1}', '{"newer": 22}'] if newer_meanwhile else ['{"fresh": 1}']
    assert Path(theirs).read_text() == saves[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(theirs).name]


def test_prune_states_removes_old_temporaries_of_state_files(tmp_path: Path) -> None:
    """The temporary files of state files (a save or a pruning killed midway, `.NAME.*.tmp`) go when as old as a
    state file that goes, whatever their state file's fate: an abandoned configuration's are never cleared by a
    save. Young ones (a save in flight) and other temporaries stay."""
    directory = str(tmp_path) + os.sep
    name = Path(state_file(directory, {**FINGERPRINT, "pool_rows": 7})).name
    old_ones = [f".{name}.k3j_x9.tmp", f".{name}.prune12-0a1b2c3d.tmp"]
    kept = [f".{name}.young.tmp", f".{name}.tmp", ".notes.json.k3j_x9.tmp", f"{name}.k3j_x9.tmp"]
    old = time.time() - (MAX_STATE_AGE_DAYS + 0.5) * 86400
    for n in old_ones + kept:
        (tmp_path / n).write_text("{")
        if n != f".{name}.young.tmp":
            os.utime(tmp_path / n, (old, old))
    removed = prune_states(directory, keep=state_file(directory, FINGERPRINT))
    assert sorted(removed) == sorted(str(tmp_path / n) for n in old_ones)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
