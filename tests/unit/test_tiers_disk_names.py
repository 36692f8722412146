"""DiskTier with what real directories hold: keys of any length, entries that are not block
files, and writes that fail halfway through a batch. Nothing hangs, no batch fails for one
block, and nothing lands on disk outside the index and the budget."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import DiskTier

BLOCK = 4096
FP = "0123456789abcdef"


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def long_key(i: int, length: int = 130) -> OffloadKey:
    return OffloadKey(i.to_bytes(4, "big") * (length // 4) + b"\0" * (length % 4))


def short_key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


@pytest.mark.parametrize("length", [96, 97, 119, 132, 500, 4000])
async def test_keys_of_any_length_are_written_read_and_found_after_a_restart(
    tmp_path: Path, length: int
) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    ks = [long_key(i, length) for i in range(3)]
    await tier.put([(k, block(i)) for i, k in enumerate(ks)])
    assert await tier.get(ks) == [block(i) for i in range(3)]
    await tier.aclose()

    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert await again.contains(ks) == [True] * 3
    assert await again.get(ks) == [block(i) for i in range(3)]
    assert again.stats().corrupt_blocks == 0


async def test_a_long_key_file_holding_another_key_is_a_counted_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    a, b = long_key(1), long_key(2)
    await tier.put([(a, block(1)), (b, block(2))])
    os.replace(tier._file(b), tier._file(a))  # a's name now holds b's frame
    assert await tier.get([a]) == [None]
    assert tier.stats().corrupt_blocks == 1
    assert not tier._file(a).exists()


async def test_a_block_that_cannot_be_written_is_dropped_alone(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    bad = short_key(1)
    os.makedirs(tier._file(bad))  # a directory under the block's name: rename fails
    (tier._file(bad) / "keep").write_bytes(b"x")
    await tier.put([(bad, block(1)), (short_key(2), block(2)), (long_key(3), block(3))])
    assert await tier.contains([bad, short_key(2), long_key(3)]) == [False, True, True]
    assert tier.stats().writes_dropped == 1
    # No temporary file is left behind, and everything on disk is indexed.
    assert [p for p in entries(tier.root) if p.name.endswith(".part")] == []
    assert tier.stats().blocks == 2


async def test_a_device_error_lands_nothing_outside_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    from kvcache_offload.errors import TierError

    with pytest.raises(TierError):
        await tier.put([(short_key(i), block(i)) for i in range(5)])
    monkeypatch.setattr(os, "fsync", real_fsync)
    on_disk = [p for p in entries(tier.root)]
    assert [p for p in on_disk if p.name.endswith(".part")] == []
    assert len(on_disk) == tier.stats().blocks == 2  # the two that landed are indexed
    assert tier.stats().bytes == sum(p.stat().st_size for p in on_disk)


async def test_stray_temporary_files_are_removed_on_open(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(short_key(1), block(1))])
    stray = tier._file(short_key(1)).parent / ".0123abcd.part"
    stray.write_bytes(b"half a block")
    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert not stray.exists()
    assert await again.get([short_key(1)]) == [block(1)]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
async def test_a_non_regular_entry_under_a_block_name_is_a_counted_miss(
    tmp_path: Path, kind: str
) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    bad, good = short_key(1), short_key(2)
    await tier.put([(bad, block(1)), (good, block(2))])
    path = tier._file(bad)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tier._file(good))
    # One batch: the bad entry is a miss, the good block still arrives.
    assert await tier.get([bad, good]) == [None, block(2)]
    assert tier.stats().corrupt_blocks == 1
    assert await tier.contains([bad]) == [False]
    assert not path.exists() and not path.is_symlink()
    assert tier._file(good).exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
async def test_the_restart_scan_skips_non_regular_entries_without_hanging(
    tmp_path: Path, kind: str
) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    bad, good = short_key(1), short_key(2)
    await tier.put([(bad, block(1)), (good, block(2))])
    path = tier._file(bad)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tier._file(good))
    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert await again.contains([bad, good]) == [False, True]
    assert again.stats().corrupt_blocks == 1
