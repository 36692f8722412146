"""SharedOffloadRegion across real processes: sharing, SIGKILL, stale files, races, space."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvcache_offload.dataplane.memory import shared_offload_region as sor
from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion
from kvcache_offload.errors import RegionError
from tests._regions import region_name

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the region is Linux-only")

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 16
PAGE = 4096 + 24  # not a multiple of the page size: cells straddle pages


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    """/dev/shm when usable (real tmpfs), else a temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return str(tmp_path)


@pytest.fixture
def name() -> str:
    return region_name("it")


def _leftovers(shm_dir: str, name: str) -> list[str]:
    return glob.glob(os.path.join(shm_dir, f"kvcache_offload_{name}*"))


class Worker:
    def __init__(self, name: str, shm_dir: str, rank: int, num_workers: int) -> None:
        args = {
            "name": name,
            "num_blocks": NUM_BLOCKS,
            "cpu_page_size": PAGE,
            "num_workers": num_workers,
            "rank": rank,
            "shm_dir": shm_dir,
        }
        self.rank = rank
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives with the worker)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration._region_worker", json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def expect(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return json.loads(self.lines.get(timeout=0.1))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    self.stderr.seek(0)
                    raise AssertionError(
                        f"worker {self.rank} exited ({self.proc.returncode}): "
                        f"{self.stderr.read()[-2000:]}"
                    ) from None
        raise AssertionError(f"worker {self.rank} said nothing for {timeout}s")

    def send(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError):
                self.send("exit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _start(name: str, shm_dir: str, ranks: list[int], num_workers: int) -> list[Worker]:
    workers = []
    for r in ranks:
        w = Worker(name, shm_dir, r, num_workers)
        event = w.expect()
        assert event["event"] == "mapped", event
        workers.append(w)
    return workers


def test_two_workers_map_one_region_and_read_each_others_rows(shm_dir, name):
    creator, joiner = _start(name, shm_dir, [0, 1], 2)
    try:
        assert creator.send("write") == {"event": "written"}
        assert joiner.send("write") == {"event": "written"}
        assert creator.send("check 0 1") == {"event": "checked", "bad": []}
        assert joiner.send("check 0 1") == {"event": "checked", "bad": []}
        assert _leftovers(shm_dir, name) == []  # every worker mapped it: unlinked
    finally:
        creator.close()
        joiner.close()
    assert _leftovers(shm_dir, name) == []


@pytest.mark.parametrize("victim", ["creator", "joiner"])
def test_sigkill_of_any_process_leaves_nothing_in_shm(shm_dir, name, victim):
    creator, joiner = _start(name, shm_dir, [0, 1], 2)
    try:
        creator.send("write")
        joiner.send("write")
        dead, alive = (creator, joiner) if victim == "creator" else (joiner, creator)
        dead.kill()
        assert _leftovers(shm_dir, name) == []
        # the survivor's mapping still holds both workers' bytes
        assert alive.send("check 0 1") == {"event": "checked", "bad": []}
    finally:
        creator.close()
        joiner.close()
    assert _leftovers(shm_dir, name) == []


def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_creator_sigkilled_before_any_joiner_leaves_no_file(shm_dir, name):
    (crashed,) = _start(name, shm_dir, [0], 2)  # waits for a second worker that never comes
    assert len(_leftovers(shm_dir, name)) == 1
    crashed.kill()
    _wait_until(lambda: _leftovers(shm_dir, name) == [])  # its reaper removed the file


def test_a_region_garbage_collected_without_cleanup_removes_its_file(tmp_path):
    import gc

    region = SharedOffloadRegion("gc", 4, 512, num_workers=2, rank=0, shm_dir=tmp_path)
    path = region.path
    assert os.path.exists(path)
    del region
    gc.collect()
    assert not os.path.exists(path)


def test_stale_file_from_a_crashed_creator_does_not_break_the_next_start(shm_dir, name):
    stale = os.path.join(shm_dir, f"kvcache_offload_{name}.mmap")
    with open(stale, "wb") as f:  # a crash whose reaper was killed too (e.g. a kill -9 -PGID)
        f.write(b"KVOFFRG1" + bytes(8192))
    creator, joiner = _start(name, shm_dir, [0, 1], 2)
    try:
        assert creator.send("write") == {"event": "written"}
        assert joiner.send("write") == {"event": "written"}
        assert joiner.send("check 0 1") == {"event": "checked", "bad": []}
        assert _leftovers(shm_dir, name) == []
    finally:
        creator.close()
        joiner.close()


def test_four_processes_racing_agree_on_one_region(shm_dir, name):
    workers = [Worker(name, shm_dir, r, 4) for r in range(4)]
    try:
        events = [w.expect() for w in workers]
        assert all(e["event"] == "mapped" for e in events), events
        assert sum(e["creator"] for e in events) == 1
        for w in workers:
            assert w.send("write") == {"event": "written"}
        for w in workers:
            assert w.send("check 0 1 2 3") == {"event": "checked", "bad": []}
        assert _leftovers(shm_dir, name) == []
    finally:
        for w in workers:
            w.close()


def test_a_late_joiner_gets_a_clear_error(shm_dir, name):
    creator, joiner = _start(name, shm_dir, [0, 1], 2)
    late = Worker(name, shm_dir, 1, 2)
    try:
        event = late.expect()
        assert event["event"] == "error" and event["type"] == "RegionError"
        assert "too late" in event["message"]
        assert late.proc.wait(10) == 0
    finally:
        for w in (late, creator, joiner):
            w.close()


# -- in-process behaviour -----------------------------------------------------------------------


def _join_racing(name: str, rank: int, shm_dir: Path, start: threading.Barrier, out: list) -> None:
    start.wait()
    try:
        out.append(
            SharedOffloadRegion(
                name, 4, 512, num_workers=8, rank=rank, shm_dir=shm_dir, populate=False
            )
        )
    except BaseException as exc:  # collected for the test's assert
        out.append(exc)


def test_racing_joiners_never_get_a_spurious_too_late(tmp_path, monkeypatch):
    """Eight threads join at once, twenty times: every one maps the region, none is "late".

    The creator is slowed down so that the joiners keep probing while it creates the file.
    """
    create = SharedOffloadRegion._create

    def slow_create(self: SharedOffloadRegion) -> None:
        time.sleep(0.05)  # widens the window in which joiners find no file yet
        create(self)

    monkeypatch.setattr(SharedOffloadRegion, "_create", slow_create)
    for round_ in range(20):
        start = threading.Barrier(8)
        out: list = []  # list.append is atomic
        threads = [
            threading.Thread(target=_join_racing, args=(f"race{round_}", r, tmp_path, start, out))
            for r in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        regions = [r for r in out if isinstance(r, SharedOffloadRegion)]
        try:
            assert len(regions) == 8, f"round {round_}: {[e for e in out if e not in regions]}"
            assert sum(r.is_creator for r in regions) == 1
            assert not os.path.exists(regions[0].path)  # all eight mapped it: sealed
        finally:
            for r in regions:
                r.cleanup()
        assert list(tmp_path.iterdir()) == []


def test_a_second_service_on_the_same_region_name_is_refused(tmp_path):
    first = SharedOffloadRegion("svc2", 4, 512, num_workers=2, rank=None, shm_dir=tmp_path)
    try:
        with pytest.raises(RegionError, match="already used by another service"):
            SharedOffloadRegion("svc2", 4, 512, num_workers=2, rank=None, shm_dir=tmp_path)
        assert not first.sealed and os.path.exists(first.path)  # the first one is untouched
        worker = SharedOffloadRegion("svc2", 4, 512, num_workers=2, rank=0, shm_dir=tmp_path)
        worker.cleanup()
    finally:
        first.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_too_small_shm_gives_a_clear_region_error(tmp_path, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize = 4096
            self.f_bavail = 10  # 40 KiB free

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny(real(p)))
    with pytest.raises(RegionError) as info:
        SharedOffloadRegion("tiny", num_blocks=1000, cpu_page_size=8192, shm_dir=tmp_path)
    msg = str(info.value)
    assert "free" in msg and "needs" in msg and "--shm-size" in msg
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_view_geometry_cursor_and_overflow(tmp_path):
    a = SharedOffloadRegion("geo", 8, 1000, num_workers=4, rank=1, shm_dir=tmp_path)
    try:
        v1 = a.create_next_view(600)
        assert v1.shape == (8, 600) and v1.stride() == (4000, 1)
        assert v1.storage_offset() == a.data_offset + 1000  # rank 1 starts one cell in
        with pytest.raises(RegionError, match="exceeds worker area end"):
            a.create_next_view(401)
        assert a.cursor == 1600  # unchanged by the failure
        v2 = a.create_next_view(400)  # exact fill
        assert v2.storage_offset() == a.data_offset + 1600
        v1.fill_(3)
        v2.fill_(4)
        rows = a.rows_array()
        assert rows.shape == (8, 4000)
        assert bool((rows[:, 1000:1600] == 3).all() and (rows[:, 1600:2000] == 4).all())
        assert bool((rows[:, :1000] == 0).all() and (rows[:, 2000:] == 0).all())
        del rows, v1, v2
    finally:
        a.cleanup()
        a.cleanup()  # idempotent
    assert list(tmp_path.iterdir()) == []


def test_a_service_without_rank_counts_as_one_more_mapper(tmp_path):
    service = SharedOffloadRegion("svc", 4, 512, num_workers=1, rank=None, shm_dir=tmp_path)
    try:
        assert service.is_creator and not service.sealed
        assert len(list(tmp_path.iterdir())) == 1
        worker = SharedOffloadRegion("svc", 4, 512, num_workers=1, rank=0, shm_dir=tmp_path)
        assert worker.sealed and list(tmp_path.iterdir()) == []
        view = worker.create_next_view(512)
        view.fill_(9)
        mem = service.rows_memoryview()
        assert mem.shape == (4, 512) and mem[2, 0] == 9
        mem.release()
        del view
        worker.cleanup()
    finally:
        service.cleanup()


def test_mismatched_geometry_is_refused(tmp_path):
    a = SharedOffloadRegion("mm", 4, 512, num_workers=2, rank=0, shm_dir=tmp_path)
    try:
        with pytest.raises(RegionError, match="expects"):
            SharedOffloadRegion("mm", 5, 512, num_workers=2, rank=1, shm_dir=tmp_path, timeout_s=2)
        with pytest.raises(RegionError, match="rank 0 already"):
            SharedOffloadRegion("mm", 4, 512, num_workers=2, rank=0, shm_dir=tmp_path, timeout_s=2)
    finally:
        a.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_populate_falls_back_to_touching_pages_on_old_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(sor, "MADV_POPULATE_WRITE", 9999)  # the kernel answers EINVAL
    a = SharedOffloadRegion("old", 6, PAGE, num_workers=2, rank=1, shm_dir=tmp_path)
    try:
        rows = a.rows_array()
        assert rows.shape == (6, 2 * PAGE) and not rows.any()
        del rows
    finally:
        a.cleanup()


def test_cleanup_with_live_views_warns_and_still_unlinks(tmp_path, caplog):
    a = SharedOffloadRegion("live", 4, 512, num_workers=2, rank=0, shm_dir=tmp_path)
    view = a.create_next_view(256)
    a.cleanup()
    assert list(tmp_path.iterdir()) == []
    assert "live views" in caplog.text
    view.fill_(1)  # the mapping stays valid while the view lives
    del view


def test_bad_arguments_raise_region_errors(tmp_path):
    with pytest.raises(RegionError):
        SharedOffloadRegion("bad/name", 4, 512, shm_dir=tmp_path)
    with pytest.raises(RegionError):
        SharedOffloadRegion("zero", 0, 512, shm_dir=tmp_path)
    with pytest.raises(RegionError):
        SharedOffloadRegion("rank", 4, 512, num_workers=2, rank=2, shm_dir=tmp_path)


def test_rows_pattern_helper_is_deterministic():
    from tests.integration._region_worker import pattern

    assert np.array_equal(pattern(1, 2, 3), pattern(1, 2, 3))
    assert not np.array_equal(pattern(0, 2, 3), pattern(1, 2, 3))


def test_a_normal_exit_without_cleanup_leaves_no_unsealed_file(tmp_path):
    code = (
        "from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion\n"
        f"r = SharedOffloadRegion('exit', 4, 512, 2, 0, shm_dir={str(tmp_path)!r})\n"
        "import os; print(len(os.listdir(os.path.dirname(r.path))))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # it existed while the process ran
    assert list(tmp_path.iterdir()) == []
