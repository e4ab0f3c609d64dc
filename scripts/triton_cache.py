"""Triton's compile cache carried between device machines (scripts/gpu_check.sh). A fresh machine compiles every
kernel variant the GPU tests and benchmarks launch; the cache of an earlier machine (same Triton, same sm_90
target: Triton keys each entry by kernel source, options, its version and the target, so a changed kernel
compiles afresh) lets it skip that.

  pack CACHE_DIR OUT_DIR     write CACHE_DIR as OUT_DIR/triton_cache.tgz.NN parts of 15 MiB (a device run returns
                             files of at most 16 MiB), without the IR text stages a cache hit does not read;
                             nothing above 48 MiB (the working tree that travels is at most 64 MiB)
  unpack PARTS_DIR CACHE_DIR unpack the parts into CACHE_DIR, pointing each entry's group file at CACHE_DIR (Triton
                             records its files by absolute path); a damaged archive unpacks nothing

Each prints one line saying what it did and exits 0 unless its arguments are wrong: a cache is an optimization."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PART_PREFIX = "triton_cache.tgz."
PART_BYTES = 15 << 20
MAX_BYTES = 48 << 20
SKIPPED_SUFFIXES = (".ttir", ".ttgir", ".llir", ".source")  # a hit reads the cubin, its json and the PTX


def pack(cache_dir: Path, out_dir: Path, max_bytes: int = MAX_BYTES, part_bytes: int = PART_BYTES) -> int:
    """Parts written (0: none, with the reason printed). Old parts in `out_dir` are removed first."""
    for old in out_dir.glob(PART_PREFIX + "*"):
        old.unlink()
    files = sorted(p for p in cache_dir.rglob("*") if p.is_file() and not p.name.endswith(SKIPPED_SUFFIXES))
    files = [p for p in files if not p.name.endswith(".tmp") and p.name != "lock"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(cache_dir)))
    data = buf.getvalue()
    if len(data) > max_bytes:
        print(f"triton cache: {len(data)} bytes packed, over {max_bytes}: not written (empty .triton_cache/)")
        return 0
    parts = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)]
    for i, part in enumerate(parts):
        (out_dir / f"{PART_PREFIX}{i:02d}").write_bytes(part)
    num_kernels = sum(p.suffix == ".cubin" for p in files)
    print(f"triton cache: {num_kernels} kernels, {len(data)} bytes in {len(parts)} parts under {out_dir}")
    return len(parts)


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
                children = json.loads(group.read_text())["child_paths"]
                moved = {
                    name: str(cache_dir / entry.name / Path(path).name)
                    for name, path in children.items()
                    if (entry / Path(path).name).is_file()
                }
                group.write_text(json.dumps({"child_paths": moved}))
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
