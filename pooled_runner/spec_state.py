"""The speculative-depth governors' calibration, kept across server restarts (issue #9): `save_family`, `load_family`.

A cold `SpecGovernor` probes every depth it can reach in its first steps, and where drafting loses those probes
cost tokens/s: over the first 150 steps of the CPU cost models of the H200's steps (`bench/spec_governor_model.py
--restore 2000`, 40 seeds), 0.953-0.973x of depth 0's where drafting loses, against 0.999-1.000x for a governor
restored from a previous run of 2000 steps. A server restarted with the same model, pool and GPU can start from
what its last run learned: the family's state (every batch size's governor, the shared acceptance estimate) is
written to a JSON file and read back at start.

What is kept of a governor (`governor_state`) is everything its later decisions depend on: the candidates and
the running depth, each depth's step time, variance, timed steps, probe interval, lost probes, undecided
probe steps carried over (and the depth they were measured against), its steps per depth (a family's prior
needs them), the settings it decided with (a state is refused by a governor of other settings), and, for a
governor of its own, the acceptance counts (a family keeps its shared estimate once). Changed on the way:

- the step count restarts at 0: each depth's next probe is kept relative to it (`due` - `num_steps`), which is
  all `choose` compares, so nothing else moves;
- a probe in flight is dropped, not saved: its few steps were timed on a working set the restart loses, and its
  depth's next probe is due at once (its stored due is the step the dropped probe started at, or earlier), so
  the decision it was to make is made first, from fresh steps, not put off by an interval. Where the running
  depth itself was never measured (the initial probe in flight), that measurement starts again;
- outliers in a row are forgotten (a row broken by a restart is no row), and the first step after a load is
  not timed (`SpecGovernor` times no step after a change of depth, and the last depth is not known): a server's
  first verify step after start is not timed anyway.
So a governor restored from the state of one that is not probing, whose running depth has no outliers in a
row, chooses exactly as the original continuing would, given the same later observations with the first one
untimed (tests/test_spec_state.py).

The file (`save_family`): JSON, {"version", "fingerprint", "family"}; the fingerprint is whatever makes step
times comparable (model, pool rows, weight format, GPU, TP size, candidate depths, SGLang version: the caller's
choice). It is written to a temporary file in the same directory and renamed over the old one (`os.replace`),
so a reader sees the old file or the new one, never half of one; not fsynced (a save every 1024 steps
must not stall a decode step on the disk; after a power loss the file may be empty or old, and an empty file is
refused as corrupt). `load_family` starts fresh (None) on a missing file (info), and on a corrupt or foreign
file (wrong version, another fingerprint: the differing keys are named) with a warning: a server must not
refuse to start over a stale calibration file. A path the server cannot write is refused earlier, at config
resolution (`spec_state_paths.state_path_problem`). Where the path is a directory (the default:
`PoolConfig.resolve` makes `envs.spec_state_dir()` for the cost governor), each serving configuration keeps its
own file in it (`spec_state_paths.state_file`), so a restart finds its state without a flag and two models never
overwrite each other's.

Host-side, plain Python.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from pooled_runner.spec_acceptance import AcceptanceEstimate
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import MIN_RELATIVE_VARIANCE, SpecGovernor, _Arm, _Probe

logger = logging.getLogger("pooled_runner")

STALE_TEMPORARY_SECONDS = 60.0  # a save's temporary file older than this was left by a killed save
STATE_VERSION = 1  # of the file and of `governor_state`'s layout; another version is refused (start fresh)
# the constructor settings a governor's state was learned with: a governor of other settings refuses it
SETTINGS = (
    "ema_alpha",
    "probe_steps",
    "max_probe_steps",
    "min_probe_interval",
    "max_probe_interval",
    "margin",
    "confidence",
    "outlier_factor",
)


# -- one governor -------------------------------------------------------------------------------------------
def governor_state(governor: SpecGovernor, *, acceptance: bool = True) -> dict[str, Any]:
    """`governor`'s state, JSON-ready (module docstring). `acceptance`: include its acceptance estimate's
    decayed counts (False for the governors of a family, which keeps its shared estimate once)."""
    arms = []
    for depth in governor.candidates:
        arm = governor._arms[depth]
        arms.append(
            {
                "depth": depth,
                "seconds": arm.seconds,
                "relative_variance": arm.relative_variance,
                "num_timed": arm.num_timed,
                "interval": arm.interval,
                "num_lost": arm.num_lost,
                "due": arm.due - governor.num_steps,  # relative: the step count restarts at 0
                "carried": list(arm.carried),
                "carried_against": arm.carried_against,
            }
        )
    state: dict[str, Any] = {
        "candidates": list(governor.candidates),
        "current": governor.current,
        "settings": {name: getattr(governor, name) for name in SETTINGS},
        "acceptance_decay": governor.acceptance_estimate.decay,
        "steps_at": [governor.steps_at[d] for d in governor.candidates],
        "num_switches": governor.num_switches,
        "arms": arms,
    }
    if acceptance:
        state["acceptance"] = _acceptance_state(governor.acceptance_estimate)
    return state


def load_governor_state(governor: SpecGovernor, state: Mapping[str, Any]) -> None:
    """Continue `governor` from `governor_state`'s `state` (module docstring: its step count restarts at 0, a
    probe in flight is dropped). `state` is checked whole before anything changes: ValueError (or
    KeyError/TypeError for a malformed one) naming what does not fit, the governor untouched."""
    candidates = [int(d) for d in state["candidates"]]
    if tuple(candidates) != governor.candidates:
        raise ValueError(f"state of candidates {candidates}, this governor's are {list(governor.candidates)}")
    settings = {name: getattr(governor, name) for name in SETTINGS}
    if dict(state["settings"]) != settings or state["acceptance_decay"] != governor.acceptance_estimate.decay:
        raise ValueError(
            f"state learned with settings {dict(state['settings'])}, acceptance decay "
            f"{state['acceptance_decay']}; this governor's are {settings}, "
            f"{governor.acceptance_estimate.decay}"
        )
    current = int(state["current"])
    if current not in governor.candidates:
        raise ValueError(f"state's running depth {current} is not one of the candidates {candidates}")
    arms = {d: _arm(governor, d, entry) for d, entry in zip(candidates, _exactly(state["arms"], candidates))}
    steps_at = [_count(n, "steps_at") for n in _exactly(state["steps_at"], candidates)]
    num_switches = _count(state["num_switches"], "num_switches")
    counts = _acceptance_counts(state["acceptance"]) if "acceptance" in state else None
    # checked: from here on nothing raises
    governor._arms = arms
    governor.current = current
    governor.steps_at = dict(zip(candidates, steps_at))
    governor.num_switches = num_switches
    governor.num_steps = 0
    governor._last_depth = None
    # the initial measurement of the running depth starts again if it was in flight; any other probe is dropped
    governor._probe = _Probe(current, None) if arms[current].seconds is None else None
    if counts is not None:
        governor.acceptance_estimate.accepted, governor.acceptance_estimate.rejected = counts


def _arm(governor: SpecGovernor, depth: int, entry: Mapping[str, Any]) -> _Arm:
    """One depth's `_Arm` from its saved entry, its values checked."""
    if int(entry["depth"]) != depth:
        raise ValueError(f"arms out of order: depth {entry['depth']} where {depth} belongs")
    seconds = entry["seconds"]
    if seconds is not None:
        seconds = _positive(seconds, f"depth {depth}'s seconds")
    variance = float(entry["relative_variance"])
    if not (math.isfinite(variance) and variance >= MIN_RELATIVE_VARIANCE):
        raise ValueError(f"depth {depth}'s relative_variance={variance!r}: need >= {MIN_RELATIVE_VARIANCE}")
    interval = _count(entry["interval"], f"depth {depth}'s interval")
    if not governor.min_probe_interval <= interval <= governor.max_probe_interval:
        raise ValueError(
            f"depth {depth}'s interval={interval} outside {governor.min_probe_interval}.."
            f"{governor.max_probe_interval}"
        )
    against = entry["carried_against"]
    if against is not None and int(against) not in governor.candidates:
        raise ValueError(f"depth {depth}'s carried_against={against!r} is not a candidate")
    carried = [_positive(s, f"depth {depth}'s carried step") for s in entry["carried"]]
    if bool(carried) != (against is not None):
        raise ValueError(
            f"depth {depth}: carried steps {carried} and carried_against={against!r} go together"
        )
    due = entry["due"]
    if type(due) is not int:
        raise ValueError(f"depth {depth}'s due={due!r} must be an integer")
    return _Arm(
        seconds=seconds,
        relative_variance=variance,
        num_timed=_count(entry["num_timed"], f"depth {depth}'s num_timed"),
        interval=interval,
        num_lost=_count(entry["num_lost"], f"depth {depth}'s num_lost"),
        due=due,
        carried=carried,
        carried_against=None if against is None else int(against),
    )


def _exactly(items: Any, candidates: list[int]) -> list[Any]:
    """`items` as a list of one entry per candidate."""
    if not isinstance(items, list) or len(items) != len(candidates):
        raise ValueError(f"{items!r}: need one entry per candidate depth {candidates}")
    return items


def _count(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    return value


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def _acceptance_state(estimate: AcceptanceEstimate) -> dict[str, float]:
    return {"accepted": estimate.accepted, "rejected": estimate.rejected}


def _acceptance_counts(state: Mapping[str, Any]) -> tuple[float, float]:
    counts = float(state["accepted"]), float(state["rejected"])
    if not all(math.isfinite(c) and c >= 0.0 for c in counts):
        raise ValueError(f"acceptance counts {counts} must be finite and >= 0")
    return counts


# -- a family ---------------------------------------------------------------------------------------------
def family_state(family: GovernorFamily) -> dict[str, Any]:
    """`family`'s state, JSON-ready: the shared acceptance counts once, each batch size's governor (in the
    order they were created)."""
    share = family.acceptance is not None
    return {
        "share": share,
        "acceptance_decay": family.acceptance_decay,
        "acceptance": _acceptance_state(family.acceptance) if family.acceptance is not None else None,
        "governors": [
            {"batch_size": bs, **governor_state(governor, acceptance=not share)}
            for bs, governor in family.governors.items()
        ],
    }


def family_from_state(state: Mapping[str, Any], **family_kwargs: Any) -> GovernorFamily:
    """A new `GovernorFamily(**family_kwargs)` continuing from `family_state`'s `state`, which must have been
    learned by a family of the same sharing, acceptance decay and governor settings. Each governor is
    restored, not derived from a neighbour (its state already holds what its neighbours passed on).
    ValueError (or KeyError/TypeError for a malformed state) naming what does not fit."""
    family = GovernorFamily(**family_kwargs)
    share = family.acceptance is not None
    if state["share"] is not share or state["acceptance_decay"] != family.acceptance_decay:
        raise ValueError(
            f"state of a family with share={state['share']!r}, acceptance decay {state['acceptance_decay']!r}; "
            f"this one has share={share}, {family.acceptance_decay}"
        )
    if family.acceptance is not None:
        family.acceptance.accepted, family.acceptance.rejected = _acceptance_counts(state["acceptance"])
    for entry in state["governors"]:
        batch_size = _count(entry["batch_size"], "batch_size")
        if batch_size in family.governors or batch_size == 0:
            raise ValueError(f"batch_size={batch_size}: twice, or not > 0")
        governor = family._new_governor(batch_size, entry["candidates"], initial=entry["current"])
        load_governor_state(governor, entry)
        family.governors[batch_size] = governor
    return family


# -- the file ---------------------------------------------------------------------------------------------
def save_family(family: GovernorFamily, path: str, fingerprint: Mapping[str, Any]) -> None:
    """Write `family`'s state with `fingerprint` to `path` atomically (module docstring): the JSON text is
    built first, then written to a temporary file beside `path` and renamed over it; on any error the
    temporary file is removed and `path` is left as it was (the error is raised)."""
    text = json.dumps(
        {"version": STATE_VERSION, "fingerprint": canonical(fingerprint), "family": family_state(family)},
        allow_nan=False,
        sort_keys=True,
    )
    directory, name = os.path.split(os.path.abspath(path))
    _remove_stale_temporaries(directory, name)
    # the file keeps its mode (mkstemp's is 0600); a new one is readable by all, as `open` would make it
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o644
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Remove the temporary files of saves that never finished (SGLang's shutdown kills its schedulers, a save
    among them now and then): those of `name` older than STALE_TEMPORARY_SECONDS (a save takes milliseconds; a
    younger one may be another process's save in flight)."""
    now = time.time()
    for temporary in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp")):
        with contextlib.suppress(OSError):
            if now - os.stat(temporary).st_mtime > STALE_TEMPORARY_SECONDS:
                os.unlink(temporary)


def load_family(path: str, fingerprint: Mapping[str, Any], **family_kwargs: Any) -> GovernorFamily | None:
    """The family saved at `path` (a `GovernorFamily(**family_kwargs)`, `family_from_state`), or None (start
    fresh) where there is none, it is unreadable or corrupt, of another version, of another `fingerprint`, or
    of another family's settings (module docstring). Logs why."""
    if not os.path.exists(path):
        logger.info("spec governor state: no %s yet, the governors start fresh", path)
        return None
    family, why = _restore(path, fingerprint, family_kwargs)
    if family is None:
        logger.warning(
            "spec governor state: %s %s; the governors start fresh (it is overwritten at the next save)",
            path,
            why,
        )
        return None
    logger.info(
        "spec governor state: restored from %s: batch sizes %s, running depths %s",
        path,
        sorted(family.governors),
        {bs: g.current for bs, g in sorted(family.governors.items())},
    )
    return family


def _restore(
    path: str, fingerprint: Mapping[str, Any], family_kwargs: dict[str, Any]
) -> tuple[GovernorFamily | None, str]:
    """The family saved at `path`, or None and why it cannot be (`load_family`)."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except Exception as exc:  # any: a file nested past the recursion limit too (a server must still start)
        return None, f"cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
        found = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        return None, f"is of version {found!r}, not {STATE_VERSION}"
    differ = fingerprint_differences(saved.get("fingerprint"), canonical(fingerprint))
    if differ:
        return None, "was learned elsewhere: its fingerprint differs in " + "; ".join(differ)
    try:
        return family_from_state(saved["family"], **family_kwargs), ""
    except Exception as exc:  # any: `int(inf)` raises OverflowError, and a server must still start
        return None, f"does not fit these governors ({type(exc).__name__}: {exc})"


def fingerprint_differences(saved: Any, now: Mapping[str, Any]) -> list[str]:
    """Each key whose value differs between a saved fingerprint and `now`, as "key (saved X, now Y)"."""
    if not isinstance(saved, dict):
        return [f"the whole fingerprint (saved {saved!r})"]
    keys = sorted(saved.keys() | now.keys())
    return [f"{k} (saved {saved.get(k)!r}, now {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k)]


def canonical(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """`fingerprint` as it reads back from JSON (tuples as lists, keys as strings), so a saved one compares
    equal to the one it was made from."""
    out: dict[str, Any] = json.loads(json.dumps(dict(fingerprint), sort_keys=True))
    return out
