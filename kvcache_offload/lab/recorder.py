"""Opt-in recorder of the request/key stream, replayable with ``kvcache-offload replay``.

The engine calls it as an access observer on its event loop, so the calls only append to a
buffer; a background thread encodes and writes JSON lines. One line per call::

    {"ts": 1732900000.123, "op": "lookup", "keys": ["3132...", ...], "hits": 3}
    {"ts": 1732900000.456, "op": "store", "keys": ["3133...", ...]}

Keys are the offload keys in hex (block hash followed by the 4-byte group index), in the
order given. Lookup lines also carry ``"req"`` (a sequence number) and ``"hits"`` (the prefix
hit count the service saw); a store of keys that a recent lookup asked for carries that
lookup's ``"req"``, so a replay merges them into one request instead of counting the stored
blocks as a second access. Recording never raises into the engine: a write error is logged once and
counted, and a writer that falls too far behind drops records (counted) instead of
blocking the loop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError

__all__ = ["RequestRecorder"]

logger = logging.getLogger(__name__)

_Record = tuple[float, str, tuple[OffloadKey, ...], int]


class RequestRecorder:
    """Appends the lookup/store stream to a JSONL file from a background thread.

    ``flush_interval_s`` bounds how long a record waits in memory; ``max_pending`` bounds
    the records waiting (older ones are kept, newer ones dropped and counted when full).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_interval_s: float = 0.5,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self._clock = clock
        self._pending: list[_Record] = []
        self._cond = threading.Condition()
        self._closing = False
        self._closed = False
        self.records_written = 0
        self.records_dropped = 0
        self.write_errors = 0
        self.link_window = 65_536
        self._next_req = 0
        self._req_of_key: OrderedDict[OffloadKey, int] = OrderedDict()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(f"cannot open record_path {str(self.path)!r}: {exc}") from exc
        self._thread = threading.Thread(
            target=self._run, name=f"kvcache-offload-recorder:{self.path.name}", daemon=True
        )
        self._thread.start()

    # -- observer interface (event-loop thread; must stay cheap and never raise) -------

    def on_lookup(self, keys: Sequence[OffloadKey], hits: int) -> None:
        self._add("lookup", keys, hits)

    def on_store(self, keys: Sequence[OffloadKey]) -> None:
        self._add("store", keys, -1)

    def _add(self, op: str, keys: Sequence[OffloadKey], hits: int) -> None:
        try:
            record = (self._clock(), op, tuple(keys), int(hits))
            with self._cond:
                if self._closing:
                    self.records_dropped += 1
                    return
                if len(self._pending) >= self.max_pending:
                    self.records_dropped += 1
                    self._cond.notify()
                    return
                self._pending.append(record)
                if len(self._pending) >= self.max_pending // 2:
                    self._cond.notify()
        except Exception:  # recording must never break the engine
            logger.debug("record dropped", exc_info=True)

    # -- writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending and not self._closing:
                    self._cond.wait(self.flush_interval_s)
                batch, self._pending = self._pending, []
                closing = self._closing
            if batch:
                written = self._write(batch)
                with self._cond:
                    self.records_written += written
                    self.records_dropped += len(batch) - written
                    self._cond.notify_all()
            elif closing:
                return

    def _write(self, batch: list[_Record]) -> int:
        """Write ``batch``; the number of records written (0 or all)."""
        file = self._file
        if file is None:
            return 0
        try:
            lines = []
            for ts, op, keys, hits in batch:
                obj: dict[str, object] = {"ts": ts, "op": op, "keys": [k.hex() for k in keys]}
                req = self._link(op, keys)
                if req is not None:
                    obj["req"] = req
                if hits >= 0:
                    obj["hits"] = hits
                lines.append(json.dumps(obj, separators=(",", ":")))
            file.write("\n".join(lines) + "\n")
            file.flush()
            return len(batch)
        except Exception as exc:
            self.write_errors += 1
            if self.write_errors == 1:
                logger.error("recording to %s failed: %s; records are dropped", self.path, exc)
            return 0

    def _link(self, op: str, keys: tuple[OffloadKey, ...]) -> int | None:
        """Request id of a lookup (new) or of the recent lookup a store belongs to."""
        by_key = self._req_of_key
        if op == "store":
            return by_key.get(keys[0]) if keys else None
        req = self._next_req
        self._next_req += 1
        for key in keys:
            by_key[key] = req
            by_key.move_to_end(key)
        while len(by_key) > self.link_window:
            by_key.popitem(last=False)
        return req

    # -- lifecycle -------------------------------------------------------------------

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record added so far is written or dropped; False on timeout."""
        with self._cond:
            target = self.records_written + self.records_dropped + len(self._pending)
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: (
                    self.records_written + self.records_dropped >= target
                    or not self._thread.is_alive()
                ),
                timeout_s,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is buffered, stop the thread and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except Exception as exc:
                logger.error("closing %s failed: %s", self.path, exc)

    def __enter__(self) -> RequestRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        return {
            "records_written": self.records_written,
            "records_dropped": self.records_dropped,
            "write_errors": self.write_errors,
        }
