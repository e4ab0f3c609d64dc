"""Triton's compile cache carried between device machines (scripts/gpu_check.sh). A fresh machine compiles every
kernel variant the GPU tests and benchmarks launch; the cache of an earlier machine (same Triton, same sm_90
target: Triton keys each entry by kernel source, options, its version and the target, so a changed kernel
compiles afresh) lets it skip that.

  pack CACHE_DIR OUT_DIR     write CACHE_DIR as OUT_DIR/triton_cache.tgz.NN parts of 15 MiB (a device run returns
                             files of at most 16 MiB), without the IR text stages a cache hit does not read;
                             at most 48 MiB (the working tree that travels is at most 64 MiB): over that, the
                             entries last used longest ago are left out (they compile afresh when next needed)
  unpack PARTS_DIR CACHE_DIR unpack the parts into CACHE_DIR, pointing each entry's group file at CACHE_DIR (Triton
                             records its files by absolute path); a damaged archive unpacks nothing

Each prints one line saying what it did and exits 0 unless its arguments are wrong: a cache is an optimization."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PART_PREFIX = "triton_cache.tgz."
PART_BYTES = 15 << 20
MAX_BYTES = 48 << 20
SKIPPED_SUFFIXES = (".ttir", ".ttgir", ".llir", ".source")  # a hit reads the cubin, its json and the PTX


def _tgz(cache_dir: Path, files: list[Path]) -> bytes:
    """`files` as a gzipped tar, named relative to `cache_dir`, each with its last use (newest access or
    modification time) as its mtime, so the next machine ranks the entries as this one did; each file's access time
    is put back after its read, so packing does not make every entry look used (`_entries_by_last_use`)."""
    buf = io.BytesIO()
    # gzip level 6, not tarfile's 9: 1092 kernels packed in 6.5 s against 21 s (CI's CPU), for 2% more bytes
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for p in files:
            st = p.stat()
            info = tar.gettarinfo(p, arcname=str(p.relative_to(cache_dir)))
            info.mtime = _last_use(st)  # a tar keeps no access time
            with p.open("rb") as f:
                tar.addfile(info, f)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    return buf.getvalue()


def _last_use(st: os.stat_result) -> float:
    return max(st.st_atime, st.st_mtime)


def _entry_name(cache_dir: Path, p: Path) -> str:
    """The cache entry (top-level folder: one kernel variant) holding file `p`."""
    return p.relative_to(cache_dir).parts[0]


def _entries_by_last_use(cache_dir: Path, files: list[Path]) -> list[list[Path]]:
    """The files grouped by cache entry (the top-level folder: one kernel variant), most recently used first: by
    the newest access or modification time of its files. A hit reads the entry's files, and a carried-in entry
    keeps its packed mtime (its last use on the machine that packed it), so under the default relatime mounts the
    access time tells an entry this machine used from one it only unpacked."""
    entries: dict[str, list[Path]] = {}
    for p in files:
        entries.setdefault(_entry_name(cache_dir, p), []).append(p)
    return sorted(entries.values(), key=lambda paths: max(_last_use(p.stat()) for p in paths), reverse=True)


def _prefix_within(entries: list[list[Path]], num_bytes: int) -> list[Path]:
    """The files of the most recently used entries whose raw sizes sum to at most `num_bytes`."""
    kept: list[Path] = []
    total = 0
    for paths in entries:
        total += sum(p.stat().st_size for p in paths)
        if total > num_bytes:
            break
        kept += paths
    return kept


def _recent_that_fit(
    cache_dir: Path, files: list[Path], whole: bytes, max_bytes: int
) -> tuple[list[Path], bytes]:
    """The files of the most recently used entries and their archive, at most `max_bytes` ([] and b"" where the
    estimate leaves no entry, the newest one's raw bytes alone over it). The raw bytes to keep come from the last archive's compression ratio, 5% short:
    one compression per try (an archive per entry would cost over a thousand on a full cache)."""
    entries = _entries_by_last_use(cache_dir, files)
    raw_bytes, packed_bytes = sum(p.stat().st_size for p in files), len(whole)
    while raw_bytes:
        kept = sorted(_prefix_within(entries, int(0.95 * raw_bytes * max_bytes / packed_bytes)))
        if not kept:
            break
        data = _tgz(cache_dir, kept)
        if len(data) <= max_bytes:
            return kept, data
        raw_bytes, packed_bytes = sum(p.stat().st_size for p in kept), len(data)
    return [], b""


def _write_parts(out_dir: Path, data: bytes, part_bytes: int) -> int:
    """`data` as numbered parts in `out_dir`, in place of the old ones (removed only now: a call killed while
    packing keeps the last parts written)."""
    for old in out_dir.glob(PART_PREFIX + "*"):
        old.unlink()
    parts = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)]
    for i, part in enumerate(parts):
        (out_dir / f"{PART_PREFIX}{i:02d}").write_bytes(part)
    return len(parts)


def pack(cache_dir: Path, out_dir: Path, max_bytes: int = MAX_BYTES, part_bytes: int = PART_BYTES) -> int:
    """Parts written in place of `out_dir`'s old ones (0: none, the old ones removed, with the reason printed).
    Over `max_bytes`, the entries last used longest ago are left out until the rest fits."""
    try:
        files = sorted(
            p for p in cache_dir.rglob("*") if p.is_file() and not p.name.endswith(SKIPPED_SUFFIXES)
        )
        files = [p for p in files if not p.name.endswith(".tmp") and p.name != "lock"]
        data = _tgz(cache_dir, files)
        left_out = ""
        if len(data) > max_bytes:
            kept, kept_data = _recent_that_fit(cache_dir, files, data, max_bytes)
            if not kept:
                print(
                    f"triton cache: {len(data)} bytes packed, over {max_bytes}, and no most recently used entries fit"
                )
                _write_parts(out_dir, b"", part_bytes)
                return 0
            num_entries = len({_entry_name(cache_dir, p) for p in files})
            num_kept = len({_entry_name(cache_dir, p) for p in kept})
            left_out = (
                f" ({num_entries - num_kept} of {num_entries} entries, the least recently used, left out)"
            )
            data, files = kept_data, kept
        num_parts = _write_parts(out_dir, data, part_bytes)
    except OSError as e:  # a file gone while packing, a full disk: no cache rather than a failed step
        print(f"triton cache: could not pack {cache_dir} ({type(e).__name__}: {e}): nothing written")
        return 0
    num_kernels = sum(p.suffix == ".cubin" for p in files)
    print(
        f"triton cache: {num_kernels} kernels, {len(data)} bytes in {num_parts} parts under {out_dir}{left_out}"
    )
    return num_parts


def unpack(parts_dir: Path, cache_dir: Path) -> int:
    """Entries added to `cache_dir` (0: none carried, or a damaged archive: nothing unpacked)."""
    parts = sorted(parts_dir.glob(PART_PREFIX + "*"))
    if not parts:
        print(f"triton cache: none in {parts_dir}")
        return 0
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir))
    try:
        # the whole stream first: gzip's length and CRC catch a truncated or damaged part, which tarfile's
        # streaming read can miss when only its end padding is lost
        data = gzip.decompress(b"".join(p.read_bytes() for p in parts))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(staging, filter="data")
        added = 0
        for entry in sorted(p for p in staging.iterdir() if p.is_dir()):
            for group in entry.glob("__grp__*.json"):
                # children by absolute path: name them where they go, and only those packed (Triton 3.6 skips
                # a missing child; later versions refuse the whole group)
                st = group.stat()  # its times back after the rewrite: `_entries_by_last_use` reads them
                children = json.loads(group.read_text())["child_paths"]
                moved = {
                    name: str(cache_dir / entry.name / Path(path).name)
                    for name, path in children.items()
                    if (entry / Path(path).name).is_file()
                }
                group.write_text(json.dumps({"child_paths": moved}))
                os.utime(group, ns=(st.st_atime_ns, st.st_mtime_ns))
            if not (cache_dir / entry.name).exists():
                entry.rename(cache_dir / entry.name)
                added += 1
    except (tarfile.TarError, OSError, EOFError, ValueError, KeyError, gzip.BadGzipFile) as e:
        print(f"triton cache: could not unpack {parts_dir} ({type(e).__name__}: {e}): compiling afresh")
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"triton cache: {added} entries unpacked into {cache_dir}")
    return added


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("pack", "unpack"):
        print(__doc__)
        return 2
    src, dst = Path(argv[1]), Path(argv[2])
    if argv[0] == "pack":
        if not src.is_dir():
            print(f"triton cache: {src} is not a folder: nothing packed")
            return 0
        dst.mkdir(parents=True, exist_ok=True)
        pack(src, dst)
    else:
        unpack(src, dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
