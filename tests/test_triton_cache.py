"""scripts/triton_cache.py, which carries Triton's compile cache between device machines (scripts/gpu_check.sh):
entries written by Triton's own cache manager, packed in parts and unpacked into another folder, are found there
by Triton's own group lookup, byte for byte, without the IR text stages; a damaged archive gives no cache rather
than a broken one; an oversized cache keeps its most recently used entries, across machines."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from triton.runtime.cache import FileCacheManager

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "triton_cache.py"
_spec = importlib.util.spec_from_file_location("triton_cache", SCRIPT)
assert _spec is not None and _spec.loader is not None
triton_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_cache)

KERNEL_FILES = ("k.cubin", "k.ptx", "k.ttir", "k.ttgir", "k.llir", "k.json")


def _fill(cache_dir: Path, monkeypatch, num_entries: int, seed: int) -> dict[str, dict[str, bytes]]:
    """`num_entries` kernels' files as Triton writes them (random bytes, a group file per kernel)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    g = torch.Generator().manual_seed(seed)
    written = {}
    for i in range(num_entries):
        key = f"{seed:04d}{i:060d}"
        manager = FileCacheManager(key)
        files = {}
        group = {}
        for name in KERNEL_FILES:
            data = bytes(
                torch.randint(0, 256, (int(torch.randint(1, 3000, (1,), generator=g)),), generator=g).tolist()
            )
            group[name] = manager.put(data, name, binary=True)
            files[name] = data
        manager.put_group("k.json", group)
        written[key] = files
    return written


def test_round_trip_into_another_folder(tmp_path, monkeypatch):
    src, out, dst = tmp_path / "src", tmp_path / "out", tmp_path / "elsewhere" / "cache"
    out.mkdir()
    written = _fill(src, monkeypatch, 7, seed=1)
    (out / "triton_cache.tgz.09").write_bytes(b"stale")  # an old part: removed
    num_parts = triton_cache.pack(src, out, part_bytes=4096)
    parts = sorted(out.glob("triton_cache.tgz.*"))
    assert num_parts == len(parts) > 1 and parts[-1].name != "triton_cache.tgz.09"
    assert triton_cache.unpack(out, dst) == 7
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dst))
    for key, files in written.items():
        group = FileCacheManager(key).get_group("k.json")
        assert group is not None, key
        want = {n for n in KERNEL_FILES if not n.endswith(triton_cache.SKIPPED_SUFFIXES)}
        assert set(group) == want, f"{key}: {sorted(group)}"
        for name, path in group.items():
            assert Path(path).parent == dst / key, path
            assert Path(path).read_bytes() == files[name], f"{key}/{name}"
    assert not [p for p in dst.iterdir() if p.name.startswith(".unpack-")], "staging folder left behind"


def test_damaged_archive_unpacks_nothing(tmp_path, monkeypatch):
    src, out, dst = tmp_path / "src", tmp_path / "out", tmp_path / "dst"
    out.mkdir()
    _fill(src, monkeypatch, 5, seed=2)
    assert triton_cache.pack(src, out, part_bytes=2048) >= 2
    last = sorted(out.glob("triton_cache.tgz.*"))[-1]
    last.write_bytes(last.read_bytes()[: len(last.read_bytes()) // 2])  # a truncated transfer
    assert triton_cache.unpack(out, dst) == 0
    assert list(dst.iterdir()) == [], "a damaged archive left entries"


def test_oversized_cache_not_written_and_no_parts_nothing_unpacked(tmp_path, monkeypatch):
    src, out, dst = tmp_path / "src", tmp_path / "out", tmp_path / "dst"
    out.mkdir()
    _fill(src, monkeypatch, 3, seed=3)
    (out / "triton_cache.tgz.00").write_bytes(b"old")
    assert triton_cache.pack(src, out, max_bytes=1000) == 0
    assert list(out.iterdir()) == [], "old or oversized parts left"
    assert triton_cache.unpack(out, dst) == 0 and not dst.exists()


def test_oversized_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    """Over the limit, the entries used longest ago (newest access or modification time of their files) are left
    out, and what is packed still unpacks whole."""
    src, out, dst = tmp_path / "src", tmp_path / "out", tmp_path / "dst"
    out.mkdir()
    written = _fill(src, monkeypatch, 11, seed=5)
    keys = list(written)
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(5)).tolist()
    for rank, i in enumerate(order):  # keys[order[0]] used last, keys[order[-1]] first
        entry_time = 1_700_000_000 - 1000 * rank
        for p in (src / keys[i]).iterdir():
            # one entry only read recently (a carried-in hit: its mtime is old, its atime new)
            atime = entry_time if rank != 1 else entry_time + 10
            os.utime(p, (atime, entry_time - 5000 if rank == 1 else entry_time))
    assert triton_cache.pack(src, out) >= 1
    limit = sum(p.stat().st_size for p in out.iterdir()) // 2
    assert triton_cache.pack(src, out, max_bytes=limit) >= 1
    assert sum(p.stat().st_size for p in out.iterdir()) <= limit
    num_kept = triton_cache.unpack(out, dst)
    assert 2 <= num_kept < len(keys), num_kept
    kept = {p.name for p in dst.iterdir()}
    assert kept == {keys[i] for i in order[:num_kept]}, (sorted(kept), order)
    # the next machine: the unpacked entries keep their order (the rank-1 entry's access time included), though
    # unpack rewrote each group file
    out2, dst2 = tmp_path / "out2", tmp_path / "dst2"
    out2.mkdir()
    assert triton_cache.pack(dst, out2) >= 1
    limit2 = sum(p.stat().st_size for p in out2.iterdir()) * 4 // 5
    assert triton_cache.pack(dst, out2, max_bytes=limit2) >= 1
    num_kept2 = triton_cache.unpack(out2, dst2)
    assert 2 <= num_kept2 < num_kept, (num_kept2, num_kept)  # rank 1 (its order from its atime) decides
    assert {p.name for p in dst2.iterdir()} == {keys[i] for i in order[:num_kept2]}, order
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dst2))
    for key in {p.name for p in dst2.iterdir()}:  # what is packed unpacks whole (a read: after the ranking)
        group = FileCacheManager(key).get_group("k.json")
        assert group is not None and {n: Path(p).read_bytes() for n, p in group.items()} == {
            n: written[key][n] for n in group
        }, key
    (out / "triton_cache.tgz.07").write_bytes(b"stale")
    assert triton_cache.pack(src, out, max_bytes=100) == 0, "not even the newest entry fits: nothing written"
    assert list(out.iterdir()) == []


def test_command_line(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    _fill(src, monkeypatch, 2, seed=4)
    assert triton_cache.main(["pack", str(src), str(out)]) == 0
    assert "2 kernels" in capsys.readouterr().out
    assert triton_cache.main(["unpack", str(out), str(tmp_path / "dst")]) == 0
    assert "2 entries unpacked" in capsys.readouterr().out
    assert triton_cache.main(["pack", str(tmp_path / "missing"), str(out)]) == 0
    assert triton_cache.main(["bogus"]) == 2
    assert os.environ["TRITON_CACHE_DIR"] == str(src)
