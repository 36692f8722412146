"""The request recorder: readable JSONL, off the hot path, never raising into the engine."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvcache_offload.errors import ConfigError
from kvcache_offload.lab.recorder import RequestRecorder
from kvcache_offload.lab.trace import iter_requests
from tests.unit._keys import key, keys


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lookups_and_stores_are_written_as_jsonl_in_call_order(tmp_path: Path) -> None:
    path = tmp_path / "rec" / "log.jsonl"
    clock = iter([10.0, 11.0, 12.0])
    with RequestRecorder(path, clock=lambda: next(clock)) as rec:
        rec.on_lookup(keys(1, 2, 3), 1)
        rec.on_store(keys(2, 3))
        rec.on_lookup([], 0)
    lines = _lines(path)
    assert [line["op"] for line in lines] == ["lookup", "store", "lookup"]
    assert [line["ts"] for line in lines] == [10.0, 11.0, 12.0]
    assert lines[0]["keys"] == [k.hex() for k in keys(1, 2, 3)]
    assert lines[0]["hits"] == 1
    assert "hits" not in lines[1]
    assert lines[1]["req"] == lines[0]["req"], "a store is linked to the lookup that asked"
    assert lines[2]["req"] != lines[0]["req"]
    assert rec.stats() == {"records_written": 3, "records_dropped": 0, "write_errors": 0}


def test_replay_reader_merges_a_store_into_its_lookup(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    with RequestRecorder(path) as rec:
        rec.on_lookup(keys(1, 2), 1)
        rec.on_lookup(keys(7), 0)
        rec.on_store(keys(2))
        rec.on_store(keys(9))  # never looked up: a request of its own
    requests = list(iter_requests(path))
    assert [r.keys for r in requests] == [keys(1, 2), keys(7), keys(9)]


def test_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    for i in range(2):
        with RequestRecorder(path) as rec:
            rec.on_lookup([key(i)], 0)
    assert [line["keys"] for line in _lines(path)] == [[key(0).hex()], [key(1).hex()]]


def test_flush_makes_records_visible_before_close(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    rec = RequestRecorder(path, flush_interval_s=60.0)
    try:
        rec.on_lookup(keys(1), 0)
        assert rec.flush(timeout_s=10.0)
        assert len(_lines(path)) == 1
    finally:
        rec.close()


class _FailingFile:
    def write(self, text: str) -> int:
        raise OSError("disk full")

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_write_errors_are_counted_not_raised(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path / "log.jsonl")
    rec._file = _FailingFile()  # type: ignore[assignment]
    rec.on_lookup(keys(1), 0)
    rec.on_store(keys(1))
    assert rec.flush(timeout_s=10.0)
    rec.close()
    assert rec.write_errors >= 1
    assert rec.records_written == 0
    assert rec.records_dropped == 2


def test_calls_after_close_are_dropped_silently(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path / "log.jsonl")
    rec.close()
    rec.close()
    rec.on_lookup(keys(1), 0)
    rec.on_store(keys(1))
    assert rec.records_dropped == 2


class _BlockingFile:
    """Holds the writer thread inside ``write`` until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(10.0)
        self.text.append(text)
        return len(text)

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_a_stalled_writer_drops_records_instead_of_blocking_the_caller(tmp_path: Path) -> None:
    rec = RequestRecorder(tmp_path / "log.jsonl", flush_interval_s=0.01, max_pending=4)
    blocking = _BlockingFile()
    rec._file = blocking  # type: ignore[assignment]
    rec.on_lookup(keys(0), 0)
    assert blocking.entered.wait(10.0)  # the writer now holds record 0
    for i in range(1, 7):
        rec.on_lookup(keys(i), 0)  # 4 fit in the buffer, 2 are dropped
    assert rec.records_dropped == 2
    blocking.release.set()
    rec.close()
    assert rec.records_written == 5
    assert sum(t.count("\n") for t in blocking.text) == 5


def test_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="record_path"):
        RequestRecorder(blocker / "log.jsonl")
