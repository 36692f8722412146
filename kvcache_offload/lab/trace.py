"""Read request traces into the columnar form the replay driver and the Belady bound share.

Two line-oriented JSON formats are accepted; the format is detected per line, so one file may
not mix them by accident without being noticed (a mixed file is rejected):

* **Mooncake FAST'25** (``../shared/traces/*.jsonl``): one request per line,
  ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``
  with one chained hash id per 512-token block (the last block may be partial).
  Key of block ``h`` = ``make_offload_key(str(h).encode(), 0)``.
* **Recorded log** (written by :mod:`kvcache_offload.lab.recorder`): one call per line,
  ``{"ts": seconds, "op": "lookup" | "store", "keys": [hex, ...]}`` plus optional ``"req"``
  (request id, int or string), ``"hits"`` (ignored: the replay recomputes hits) and
  ``"input_length"``. A ``lookup`` line starts a request whose blocks are its keys; a later
  ``store`` line with the same ``req`` adds the keys that the request does not have yet; a
  ``store`` line with no matching request is a request of its own. Requests of a recorded
  log are emitted at the end of the file (a store may come long after its lookup), so such a
  file is held in memory once; Mooncake files stream line by line.

Files (optionally gzip-compressed, ``*.gz``) are streamed line by line
(:func:`iter_requests`); :func:`load_trace` materialises them once as parallel lists with
interned keys, because a replay sweep walks the same trace many times and shared ``bytes``
objects make every dict lookup in the manager cheaper.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import OffloadError

__all__ = [
    "BLOCK_TOKENS",
    "SAMPLE_TRACE",
    "SHARED_TRACES",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "default_trace_paths",
    "iter_requests",
    "load_trace",
    "mooncake_key",
    "sample_trace_path",
    "trace_from_requests",
]

BLOCK_TOKENS = 512
"""Tokens per block in the Mooncake traces (one hash id per 512 tokens)."""

SAMPLE_TRACE = "mooncake_conversation_sample.jsonl"
"""The slice of the Mooncake conversation trace shipped in ``kvcache_offload/data``."""

SHARED_TRACES = ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl")
"""Full traces looked for in ``$KVCACHE_OFFLOAD_TRACE_DIR`` or ``../shared/traces``."""

_GROUP0 = (0).to_bytes(4, "big")


class TraceFormatError(OffloadError, ValueError):
    """A trace line is not valid JSON or lacks the fields of a known format."""


def mooncake_key(hash_id: int) -> OffloadKey:
    """The offload key of a Mooncake hash id (group 0); same bytes as ``make_offload_key``."""
    return OffloadKey(str(hash_id).encode() + _GROUP0)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when, how long, and its block keys in prefix order."""

    ts: float
    input_length: int
    output_length: int
    keys: list[OffloadKey]
    observed_hits: int | None = None
    """Prefix hits the recording service saw for this request (recorded logs only)."""


@dataclass
class Trace:
    """A whole trace as parallel lists; keys are interned and also numbered densely.

    ``block_ids[i][j]`` is the dense number (0..num_unique-1, by first appearance) of
    ``keys[i][j]``; the Belady bound works on those ints.
    """

    name: str
    keys: list[list[OffloadKey]] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    input_lengths: list[int] = field(default_factory=list)
    output_lengths: list[int] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    num_unique_blocks: int = 0
    observed_block_hits: int | None = None
    """Sum of the recorded lookups' hit counts (recorded logs), to compare with replays."""

    @property
    def num_requests(self) -> int:
        return len(self.keys)

    @property
    def num_block_accesses(self) -> int:
        return sum(len(k) for k in self.keys)

    @property
    def num_tokens(self) -> int:
        return sum(self.input_lengths)

    def without_partial_blocks(self, block_tokens: int = BLOCK_TOKENS) -> Trace:
        """The same trace with each request's partial last block dropped.

        vLLM keys (and so offloads) only full blocks; the Mooncake traces also list the
        partial block at the end of each prompt.
        """
        out = Trace(f"{self.name} (full blocks)", observed_block_hits=self.observed_block_hits)
        seen: set[int] = set()
        outputs = self.output_lengths or [0] * len(self.keys)
        for keys, ids, length, output, ts in zip(
            self.keys, self.block_ids, self.input_lengths, outputs, self.timestamps, strict=True
        ):
            full = min(len(keys), length // block_tokens)
            out.keys.append(keys[:full])
            out.block_ids.append(ids[:full])
            out.input_lengths.append(length)
            out.output_lengths.append(output)
            out.timestamps.append(ts)
            seen.update(ids[:full])
        out.num_unique_blocks = len(seen)
        return out

    def infinite_cache_hit_rate(self) -> float:
        """Block hit rate of an unbounded cache: every access but the first of each block."""
        accesses = self.num_block_accesses
        return (accesses - self.num_unique_blocks) / accesses if accesses else 0.0

    def summary(self, path: str | Path) -> dict[str, Any]:
        """The trace's identity and size, as replay results record it in JSON."""
        return {
            "name": self.name,
            "path": str(path),
            "requests": self.num_requests,
            "block_accesses": self.num_block_accesses,
            "unique_blocks": self.num_unique_blocks,
            "infinite_cache_block_hit_rate": self.infinite_cache_hit_rate(),
            "observed_block_hits": self.observed_block_hits,
        }


def _fail(path: str, lineno: int, message: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{lineno}: {message}")


def _int_field(obj: dict[str, Any], name: str, path: str, lineno: int) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise _fail(path, lineno, f"{name!r} must be a non-negative integer, got {value!r}")
    return value


def _mooncake(
    obj: dict[str, Any], path: str, lineno: int, cache: dict[int, OffloadKey]
) -> TraceRequest:
    keys = _parsed_keys(
        obj, "hash_ids", "non-negative integers", int, _hash_id_key, cache, path, lineno
    )
    ts = obj.get("timestamp", 0)
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise _fail(path, lineno, f"'timestamp' must be a number, got {ts!r}")
    input_length = (
        _int_field(obj, "input_length", path, lineno)
        if "input_length" in obj
        else (len(keys) * BLOCK_TOKENS)
    )
    output_length = _int_field(obj, "output_length", path, lineno) if "output_length" in obj else 0
    return TraceRequest(float(ts), input_length, output_length, keys)


def _hash_id_key(h: int) -> OffloadKey:
    if h < 0:
        raise ValueError(f"'hash_ids' must hold non-negative integers, got {h!r}")
    return mooncake_key(h)


def _hex_key(text: str) -> OffloadKey:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"'keys' must hold hex strings, got {text!r}") from None
    if len(value) <= 4:
        raise ValueError(f"key {text!r} is too short: a block hash plus 4 group-index bytes")
    return OffloadKey(value)


_Item = TypeVar("_Item", int, str)


def _parsed_keys(
    obj: dict[str, Any],
    field: str,
    kind: str,
    item_type: type[_Item],
    parse: Callable[[_Item], OffloadKey],
    cache: dict[_Item, OffloadKey],
    path: str,
    lineno: int,
) -> list[OffloadKey]:
    """``obj[field]`` (a list of ``item_type``) as keys, each item parsed once per file.

    ``parse`` raises ValueError naming a bad item; the exact type check keeps ``True`` from
    passing for the integer 1 (and from finding its cached key).
    """
    raw = obj[field]
    if not isinstance(raw, list):
        raise _fail(path, lineno, f"{field!r} must be a list of {kind}, got {raw!r}")
    keys: list[OffloadKey] = []
    for item in raw:
        if type(item) is not item_type:
            raise _fail(path, lineno, f"{field!r} must hold {kind}, got {item!r}")
        key = cache.get(item)
        if key is None:
            try:
                key = cache[item] = parse(item)
            except ValueError as exc:
                raise _fail(path, lineno, str(exc)) from None
        keys.append(key)
    return keys


def _hex_keys(
    obj: dict[str, Any], path: str, lineno: int, cache: dict[str, OffloadKey]
) -> list[OffloadKey]:
    return _parsed_keys(obj, "keys", "hex strings", str, _hex_key, cache, path, lineno)


def iter_requests(path: str | os.PathLike[str]) -> Iterator[TraceRequest]:
    """Stream the requests of a trace file, raising :class:`TraceFormatError` on a bad line."""
    name = str(path)
    mooncake_cache: dict[int, OffloadKey] = {}
    hex_cache: dict[str, OffloadKey] = {}
    fmt: str | None = None
    # Recorded logs: requests are emitted once no later line can extend them, i.e. at the end
    # of the file, in the order they started (a store may follow its lookup by many lines).
    recorded: dict[int, TraceRequest] = {}
    open_by_req: dict[str, int] = {}
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(name, lineno, f"not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise _fail(name, lineno, f"expected a JSON object, got {type(obj).__name__}")
            line_fmt = "mooncake" if "hash_ids" in obj else "recorded" if "op" in obj else None
            if line_fmt is None:
                raise _fail(
                    name,
                    lineno,
                    "unknown record: expected Mooncake 'hash_ids' or a recorded 'op' line",
                )
            if fmt is None:
                fmt = line_fmt
            elif fmt != line_fmt:
                raise _fail(name, lineno, f"{line_fmt} record in a {fmt} trace")
            if fmt == "mooncake":
                yield _mooncake(obj, name, lineno, mooncake_cache)
                continue
            _add_recorded(obj, name, lineno, hex_cache, recorded, open_by_req)
    yield from recorded.values()


def _add_recorded(
    obj: dict[str, Any],
    path: str,
    lineno: int,
    cache: dict[str, OffloadKey],
    requests: dict[int, TraceRequest],
    open_by_req: dict[str, int],
) -> None:
    op = obj["op"]
    if op not in ("lookup", "store"):
        raise _fail(path, lineno, f"'op' must be 'lookup' or 'store', got {op!r}")
    if "keys" not in obj:
        raise _fail(path, lineno, "missing 'keys'")
    keys = _hex_keys(obj, path, lineno, cache)
    ts = obj.get("ts", 0.0)
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise _fail(path, lineno, f"'ts' must be a number, got {ts!r}")
    req = obj.get("req")
    if req is not None and not isinstance(req, str | int):
        raise _fail(path, lineno, f"'req' must be a string or integer, got {req!r}")
    req_id = None if req is None else str(req)
    input_length = _int_field(obj, "input_length", path, lineno) if "input_length" in obj else None
    if op == "store" and req_id is not None and req_id in open_by_req:
        index = open_by_req[req_id]
        old = requests[index]
        seen = set(old.keys)
        extra = [k for k in keys if k not in seen]
        merged = old.keys + extra
        length = (
            input_length
            if input_length is not None
            else max(old.input_length, len(merged) * BLOCK_TOKENS)
        )
        requests[index] = TraceRequest(old.ts, length, old.output_length, merged, old.observed_hits)
        return
    index = len(requests)
    length = input_length if input_length is not None else len(keys) * BLOCK_TOKENS
    hits = obj.get("hits")
    observed = hits if op == "lookup" and type(hits) is int and hits >= 0 else None
    requests[index] = TraceRequest(float(ts), length, 0, keys, observed)
    if req_id is not None:
        open_by_req[req_id] = index


def load_trace(path: str | os.PathLike[str], name: str | None = None) -> Trace:
    """Read a whole trace file (see the module docstring for the formats)."""
    return trace_from_requests(iter_requests(path), name or Path(path).name)


def trace_from_requests(requests: Iterable[TraceRequest], name: str = "trace") -> Trace:
    """Number the keys of ``requests`` densely and lay them out for replay."""
    trace = Trace(name)
    numbers: dict[OffloadKey, int] = {}
    observed: int | None = None
    for request in requests:
        if request.observed_hits is not None:
            observed = (observed or 0) + request.observed_hits
        ids: list[int] = []
        for key in request.keys:
            number = numbers.get(key)
            if number is None:
                number = numbers[key] = len(numbers)
            ids.append(number)
        trace.keys.append(request.keys)
        trace.block_ids.append(ids)
        trace.input_lengths.append(request.input_length)
        trace.output_lengths.append(request.output_length)
        trace.timestamps.append(request.ts)
    trace.num_unique_blocks = len(numbers)
    trace.observed_block_hits = observed
    return trace


def _shared_dir() -> Path | None:
    env = os.environ.get("KVCACHE_OFFLOAD_TRACE_DIR")
    if env:
        return Path(env)
    candidate = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
    return candidate if candidate.is_dir() else None


def sample_trace_path() -> Path:
    """Path of the shipped conversation sample inside the installed package."""
    return Path(str(resources.files("kvcache_offload") / "data" / SAMPLE_TRACE))


def default_trace_paths() -> list[Path]:
    """The full Mooncake traces when present (``$KVCACHE_OFFLOAD_TRACE_DIR`` or
    ``../shared/traces``), else the shipped sample."""
    shared = _shared_dir()
    if shared is not None:
        found = [shared / n for n in SHARED_TRACES if (shared / n).is_file()]
        if found:
            return found
    return [sample_trace_path()]
