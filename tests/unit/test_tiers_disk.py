"""DiskTier: blocks survive a restart, bad files are misses (never wrong bytes), budget holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcache_offload.contracts.offload_key import (
    OffloadKey,
    make_offload_key,
)
from kvcache_offload.tiers import DiskTier
from kvcache_offload.tiers.frame import HEADER_PREFIX, encode_header, verify

BLOCK = 4096
FP = "0123456789abcdef"


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


async def test_blocks_are_found_again_after_a_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(key(i), block(i)) for i in range(5)])
    await tier.aclose()

    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert await again.contains([key(i) for i in range(6)]) == [True] * 5 + [False]
    assert await again.get([key(i) for i in range(5)]) == [block(i) for i in range(5)]
    assert again.stats().blocks == 5


async def test_a_truncated_file_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(key(1), block(1)), (key(2), block(2))])
    victim = tier._file(key(1))
    os.truncate(victim, victim.stat().st_size - 100)

    # Found while running: the read catches it.
    assert await tier.get([key(1), key(2)]) == [None, block(2)]
    assert not victim.exists()
    assert await tier.contains([key(1)]) == [False]
    assert tier.stats().corrupt_blocks == 1


async def test_a_file_truncated_while_down_is_not_reported_after_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(key(1), block(1)), (key(2), block(2))])
    victim = tier._file(key(1))
    os.truncate(victim, 10)

    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert await again.contains([key(1), key(2)]) == [False, True]
    assert not victim.exists()


async def test_flipped_bits_are_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(key(3), block(3))])
    path = tier._file(key(3))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await tier.get([key(3)]) == [None]
    assert not path.exists()


@pytest.mark.parametrize("check_thread", [True, False])
@pytest.mark.parametrize("where", ["alone", "mid-batch"])
async def test_any_changed_byte_or_an_extra_byte_is_a_miss_never_wrong_bytes(
    tmp_path: Path, where: str, check_thread: bool
) -> None:
    """The checks on the read path guard every byte of a file: header, key, length, payload.

    Read alone, the file is checked by the reading thread; in the middle of a batch, by the
    check thread while the next file is read: both must catch every byte.
    """
    payload = bytes(range(64))
    tier = DiskTier(tmp_path, 1 << 20, FP, check_thread=check_thread)
    await tier.open()
    await tier.put([(key(1), payload), (key(0), block(0)), (key(2), block(2))])
    batch = [key(1)] if where == "alone" else [key(0), key(1), key(2)]
    intact = [None] if where == "alone" else [block(0), None, block(2)]
    whole = [payload] if where == "alone" else [block(0), payload, block(2)]
    path = tier._file(key(1))
    good = path.read_bytes()
    damaged = [good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1 :] for i in range(len(good))]
    damaged.append(good + b"\0")
    for data in damaged:
        await tier.put([(key(1), payload)])  # again, after the last read removed it
        path.write_bytes(data)
        assert await tier.get(batch) == intact
        assert not path.exists()
    assert tier.stats().corrupt_blocks == len(damaged)
    await tier.put([(key(1), payload)])
    assert await tier.get(batch) == whole
    await tier.aclose()


async def test_stale_partial_writes_are_removed_on_open(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, FP)
    await tier.open()
    await tier.put([(key(1), block(1))])
    part = tier._file(key(1)).parent / ".junk.part"
    part.write_bytes(b"half a block")
    again = DiskTier(tmp_path, 1 << 20, FP)
    await again.open()
    assert not part.exists()
    assert await again.get([key(1)]) == [block(1)]


async def test_the_byte_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    per_file = BLOCK + HEADER_PREFIX + len(key(0))
    tier = DiskTier(tmp_path, 4 * per_file, FP)
    await tier.open()
    await tier.put([(key(i), block(i)) for i in range(4)])
    assert await tier.get([key(0)]) == [block(0)]  # key 0 is now the most recent
    await tier.put([(key(4), block(4)), (key(5), block(5))])
    held = await tier.contains([key(i) for i in range(6)])
    assert held == [True, False, False, True, True, True]
    assert len(files(tmp_path)) == 4
    assert tier.stats().bytes == 4 * per_file
    assert sorted(tier.take_evicted()) == sorted([key(1), key(2)])


async def test_layouts_with_different_fingerprints_never_share_files(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, 1 << 20, "a" * 16)
    b = DiskTier(tmp_path, 1 << 20, "b" * 16)
    await a.open()
    await b.open()
    await a.put([(key(1), block(1))])
    assert await b.contains([key(1)]) == [False]


def test_a_frame_of_another_key_does_not_verify() -> None:
    payload = block(9)
    header = encode_header(key(9), payload)
    assert verify(key(9), header, payload)
    assert not verify(key(8), header, payload)
    assert not verify(key(9), header, payload[:-1])
    assert not verify(key(9), header[:10], payload)


def test_the_check_thread_is_on_only_where_four_cpus_are_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two busy vCPUs give a check thread no idle core: there the reading thread verifies."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert not DiskTier(tmp_path, 1 << 20, FP).check_thread
    assert DiskTier(tmp_path, 1 << 20, FP, check_thread=True).check_thread
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert DiskTier(tmp_path, 1 << 20, FP).check_thread
    assert not DiskTier(tmp_path, 1 << 20, FP, check_thread=False).check_thread
