"""Where the speculative-depth governors' state lives (issue #9): the path checks at config resolution
(`state_path_problem`), a file per serving configuration in a directory (`state_file`), the code digest a
fingerprint carries (`code_digest`), and the removal of state files no server has written for a month
(`prune_states`), so that the default directory under the cache does not grow with every configuration and
every checkout a user ever served.

The file's contents, and saving and loading it, are `spec_state`'s. Host-side, plain Python.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from typing import Any

from pooled_runner.spec_state import canonical

logger = logging.getLogger("pooled_runner")

# a state file in a directory not written nor loaded for this long is removed at a server's start
# (`prune_states`): a serving server saves its own every 1024 verify steps and at exit, and a start that loads
# one marks it used (`mark_used`), so only configurations not served for a month go (another model, pool size or
# GPU; a checkout's older code, whose digest no server asks for again). Not removed: a link, a file of another
# name, nor a file a server replaced while the pruning looked at it (`_remove_if_old`). A server idle for a
# month whose file was removed writes it again at its next save. Old temporaries of those names go too.
MAX_STATE_AGE_DAYS = 30.0
STATE_NAME = "spec-governor-{}.json"  # `state_file`'s names: the fingerprint's digest in the braces
_STATE_NAME_RE = re.compile(re.escape(STATE_NAME).replace(r"\{\}", "[0-9a-f]{16}"))  # those names, no other
# their temporary files: a save's (`spec_state.save_family`: `.NAME.<random>.tmp`) or a pruning's aside name
_TEMPORARY_RE = re.compile(r"\." + _STATE_NAME_RE.pattern + r"\..+\.tmp")


def state_path_problem(path: str) -> str | None:
    """Why the governors' state cannot be kept at `path`, or None. A path ending in a separator is a directory
    (a file per serving configuration is made in it, `state_file`): it must exist and be writable; any other
    path is a file, whose directory must exist and be writable (a new file is made there at each save)."""
    if path.endswith(os.sep):
        if not os.path.isdir(path):
            return "the directory does not exist"
        return None if os.access(path, os.W_OK | os.X_OK) else "the directory is not writable"
    if os.path.isdir(path):
        return "is a directory (end it with a separator to keep a file per configuration in it)"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"its directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is not writable"
    return None


def state_file(path: str, fingerprint: Mapping[str, Any]) -> str:
    """The file that keeps the state of the serving configuration `fingerprint`: `path` itself, or where `path`
    ends in a separator (a directory: the default one, `envs.spec_state_dir`, or one the user named; resolved
    once, by `PoolConfig.resolve`, so a directory removed since does not turn into a file), a file in it named
    by a digest of the fingerprint, so that servers of different models, pools or GPUs sharing the directory
    keep one file each instead of overwriting one another's. "" (off, with a warning) for a fingerprint JSON
    cannot hold, since a server must not fail to start over its calibration."""
    if not path.endswith(os.sep):
        return path
    try:
        text = json.dumps(canonical(fingerprint), sort_keys=True)
    except (TypeError, ValueError) as exc:
        logger.warning("spec governor state: off, the fingerprint %r is not JSON (%s)", fingerprint, exc)
        return ""
    return os.path.join(path, STATE_NAME.format(hashlib.sha256(text.encode()).hexdigest()[:16]))


def code_digest(packages: list[str]) -> str:
    """16 hex digits of the SHA-256 of `packages`' sources (each an `__init__.py`: its directory's `*.py`,
    recursively, by relative path and content): a checkout whose kernels changed within one version then
    restores no step times measured on the old ones."""
    digest = hashlib.sha256()
    for package in packages:
        root = os.path.dirname(os.path.abspath(package))
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def prune_states(directory: str, keep: str, max_age_days: float = MAX_STATE_AGE_DAYS) -> list[str]:
    """Remove the state files of `directory` (`state_file`'s names only, regular files only: no link and no
    other file is touched) last modified more than `max_age_days` days ago, except `keep` (the caller's own), and
    the temporary files of those names (`.NAME.*.tmp`: a save or a pruning killed midway) as old; returns the
    removed paths.
    Best effort: a file that cannot be read or removed (another user's, one removed meanwhile) is left, and
    nothing is raised (a server must not fail to start over its cache)."""
    if max_age_days <= 0:
        raise ValueError(f"max_age_days={max_age_days}: the age past which a state file is removed, > 0")
    cutoff = time.time() - max_age_days * 86400.0
    removed = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if _TEMPORARY_RE.fullmatch(entry.name):  # nobody replaces a temporary: no aside needed
                    gone = _is_old_file(entry.path, cutoff)
                    if gone:
                        os.unlink(entry.path)
                else:
                    gone = (
                        _STATE_NAME_RE.fullmatch(entry.name) is not None
                        and os.path.abspath(entry.path) != os.path.abspath(keep)
                        and _remove_if_old(entry.path, cutoff)
                    )
                if gone:
                    removed.append(entry.path)
    if removed:
        logger.info(
            "spec governor state: removed %d state files not written for %g days", len(removed), max_age_days
        )
    return removed


def _is_old_file(path: str, cutoff: float) -> bool:
    """`path` is a regular file (a link is not ours to remove, whatever it points at) modified before `cutoff`."""
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff


def _remove_if_old(path: str, cutoff: float) -> bool:
    """Remove `path` if `_is_old_file`; whether it did. The file is renamed aside first and its age read again on
    the renamed file: a server that replaced it (a save's `os.replace`) after the first look would otherwise lose
    its fresh state to the unlink; such a file is put back (`_put_back`). The aside name is a temporary name of
    the file's own (`.NAME.*.tmp`, unique to this call: pruners in containers sharing the directory can have
    the same pid), so one left by a pruner killed in between goes with the saves' stale temporaries."""
    if not _is_old_file(path, cutoff):
        return False
    directory, name = os.path.split(path)
    aside = os.path.join(directory, f".{name}.prune{os.getpid()}-{secrets.token_hex(4)}.tmp")
    os.rename(path, aside)
    if _is_old_file(aside, cutoff):
        os.unlink(aside)
        return True
    _put_back(aside, path)
    return False


def _put_back(aside: str, path: str) -> None:
    """Give `path` back the file a server saved there just before the pruning took it `aside`, unless a still newer
    save took the name meanwhile: `os.link` never overwrites. On a filesystem without hard links, a rename where
    the name is still free (a save landing between the check and the rename is then replaced by this one, a
    moment older: better than removing both)."""
    try:
        os.link(aside, path, follow_symlinks=False)
    except FileExistsError:
        pass  # a newer save holds the name
    except OSError:
        if not os.path.lexists(path):
            os.rename(aside, path)
            return
    os.unlink(aside)


def mark_used(path: str) -> None:
    """Set `path`'s modification time to now (a state file just loaded: `prune_states` reads the time as its
    last use, so a copy that kept an old time, or a server idle since its last save, keeps its state). Best
    effort, like the pruning."""
    with contextlib.suppress(OSError):
        os.utime(path)
