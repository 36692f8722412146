"""A large JSON body's ``token_ids`` decoded in short steps, so the event loop keeps running.

Parsing in a worker thread is not enough: a one-call JSON parser (pydantic, msgspec, json)
holds the GIL for the whole body, ~0.5 s per million token ids on a busy 2-vCPU host, and
the loop answers nothing meanwhile. Here the ``token_ids`` array is located without parsing
it and decoded slice by slice (``SLICE_BYTES`` of text per C call, about a millisecond), so
the interpreter hands the GIL back to the loop between slices. The ids become one numpy
array (no millions of Python ints); counting them as they are decoded refuses a request over
``MAX_TOKEN_IDS`` (413) after bounded work. The rest of the body (``block_size``, ``salt``, ...,
a few bytes) is validated by the same pydantic model as a small body, so both paths accept
and refuse the same fields and derive the same keys.

:func:`split_token_ids` only takes the shape clients send (``token_ids`` a top-level key of
an object, at most ``FRAME_BYTES`` of other fields around it); for any other body it returns
None and the caller parses the body whole.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np
from fastapi.exceptions import RequestValidationError

from ..limits import MAX_TOKEN_IDS, RequestLimitError

__all__ = ["FRAME_BYTES", "SLICE_BYTES", "decode_token_ids", "split_token_ids"]

SLICE_BYTES = 128 * 1024
"""Text decoded per C call: ~18,000 ids, about a millisecond."""

FRAME_BYTES = 64 * 1024
"""The other fields of a body (before and after ``token_ids``) may take this many bytes."""

_KEY = b'"token_ids"'
_OPEN = re.compile(rb'"token_ids"\s*:\s*\[')
_AT_INDEX = re.compile(r"\$\[(\d+)\]")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_SLICE = msgspec.json.Decoder(list[int], strict=False)  # lax like pydantic: 7.0, "7" are 7
_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])


def split_token_ids(raw: bytes) -> tuple[bytes, int, int] | None:
    """``(rest, start, end)``: ``raw[start:end]`` is the text inside the ``token_ids`` brackets,
    ``rest`` is the body with ``"token_ids": []`` in their place; None for any other shape.
    """
    at = raw.find(_KEY, 0, FRAME_BYTES + len(_KEY))
    if at < 0:
        return None
    prefix = raw[:at]
    head = prefix.rstrip()
    # The key is a top-level key only if what comes before it is a complete object so far:
    # "{" alone, or "{...," that parses once closed (inside a string or a nested value the
    # closed text does not parse).
    if head != b"{":
        if not head.endswith(b","):
            return None
        try:
            _OBJECT.decode(head[:-1] + b"}")
        except msgspec.DecodeError:
            return None
    opened = _OPEN.match(raw, at)
    if opened is None:
        return None
    start = opened.end()
    end = _closing_bracket(raw, start)
    if end is None or len(raw) - end > FRAME_BYTES:
        return None
    return prefix + b'"token_ids":[]' + raw[end + 1 :], start, end


def _closing_bracket(raw: bytes, start: int) -> int | None:
    """The first ``]`` after ``start``, searched a slice at a time (an int array has no other)."""
    pos = start
    size = len(raw)
    while pos < size:
        found = raw.find(b"]", pos, pos + SLICE_BYTES)
        if found >= 0:
            return found
        pos += SLICE_BYTES
    return None


def decode_token_ids(raw: bytes, start: int, end: int) -> np.ndarray:
    """The ids in ``raw[start:end]`` (JSON array items) as int64, decoded a slice at a time.

    Raises ``RequestLimitError`` (413) past ``MAX_TOKEN_IDS`` ids, and the same
    ``RequestValidationError`` (422) a small body gets for an id that is not a 32-bit integer.
    """
    parts: list[np.ndarray] = []
    count = 0
    pos = start
    view = memoryview(raw)
    while pos < end:
        stop = min(pos + SLICE_BYTES, end)
        if stop < end:
            comma = raw.rfind(b",", pos, stop)
            stop = comma if comma > pos else raw.find(b",", stop, end)
            stop = end if stop < 0 else stop
        try:
            ids = _SLICE.decode(b"[" + view[pos:stop] + b"]") if stop > pos else []
        except msgspec.DecodeError as exc:
            at = _AT_INDEX.search(str(exc))  # "... - at `$[12]`": the index within the slice
            index = count + int(at.group(1)) if at else count
            raise _invalid(index, f"token ids must be integers ({exc})") from None
        part = np.array(ids, dtype=np.int64) if ids else np.empty(0, np.int64)
        if part.size and (part.min() < _INT32_MIN or part.max() > _INT32_MAX):
            bad = int(np.flatnonzero((part < _INT32_MIN) | (part > _INT32_MAX))[0])
            raise _invalid(count + bad, "token ids must fit in a signed 32-bit integer")
        count += part.size
        if count > MAX_TOKEN_IDS:
            raise RequestLimitError(
                413,
                f"request has more than {MAX_TOKEN_IDS:,} token ids (the most one request may "
                f"name); send the prompt in parts or derive the keys client-side (see "
                f"kvcache_offload.keys)",
            )
        parts.append(part)
        pos = stop + 1
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _invalid(index: int, message: str) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", "token_ids", index), "msg": message}]
    )
