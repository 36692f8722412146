"""Each run of a region has its own file; workers find the newest of their region's name only."""

from __future__ import annotations

import os
from pathlib import Path

from kvcache_offload.dataplane.memory.region_files import new_run_file, run_files, stale_files


def test_every_run_gets_a_new_path_under_its_name(tmp_path: Path) -> None:
    first, second = new_run_file(str(tmp_path), "a"), new_run_file(str(tmp_path), "a")
    assert first != second
    assert os.path.basename(first).startswith("kvcache_offload_a@")


def test_a_name_finds_its_own_runs_newest_first_and_never_another_names(tmp_path: Path) -> None:
    older, newer = new_run_file(str(tmp_path), "a"), new_run_file(str(tmp_path), "a")
    other = new_run_file(str(tmp_path), "a.b")
    for i, path in enumerate((older, newer, other)):
        Path(path).write_bytes(b"x")
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    assert run_files(str(tmp_path), "a") == [newer, older]
    assert run_files(str(tmp_path), "a.b") == [other]
    assert run_files(str(tmp_path / "missing"), "a") == []


def test_a_new_creator_removes_every_older_file_of_its_name_the_pre_run_id_one_too(
    tmp_path: Path,
) -> None:
    legacy = tmp_path / "kvcache_offload_a.mmap"
    legacy.write_bytes(b"x")
    run = new_run_file(str(tmp_path), "a")
    Path(run).write_bytes(b"x")
    assert sorted(stale_files(str(tmp_path), "a")) == sorted([run, str(legacy)])
