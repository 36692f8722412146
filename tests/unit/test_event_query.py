"""The C end-event query the poller's looks use (``_kernel_issue.EventQuery``), with fake
runtime functions: no GPU needed to check what it answers and what it clears."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy, use_event_query

_kernel_issue = pytest.importorskip(
    "kvcache_offload.dataplane.copy._kernel_issue", reason="built without a C compiler"
)

_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_LAST_ERROR = ctypes.CFUNCTYPE(ctypes.c_int)
_CODES = {0x1000: 0, 0x2000: 600, 0x3000: 700}  # fired, cudaErrorNotReady, a failure


class _FakeRuntime:
    """cudaEventQuery and cudaGetLastError as C callbacks, counting the clears."""

    def __init__(self) -> None:
        self.cleared = 0
        self.query = _QUERY(lambda handle: _CODES[handle])
        self.last_error = _LAST_ERROR(self._clear)

    def _clear(self) -> int:
        self.cleared += 1
        return 0

    def event_query(self) -> Any:
        def address(f: Any) -> int:
            return ctypes.cast(f, ctypes.c_void_p).value or 0

        return _kernel_issue.EventQuery(
            query=address(self.query), last_error=address(self.last_error)
        )


def test_fired_not_yet_and_failed_queries_answer_true_false_and_none() -> None:
    runtime = _FakeRuntime()
    query = runtime.event_query()
    assert query.fired(0x1000) is True
    assert runtime.cleared == 0
    assert query.fired(0x2000) is False
    assert runtime.cleared == 1  # not ready: the last-error state is cleared, as torch does
    assert query.fired(0x3000) is None  # failed: the caller asks torch, which raises
    assert runtime.cleared == 1
    assert query.fired(0) is True  # an event never created has nothing to wait for


def test_an_event_query_needs_both_functions() -> None:
    with pytest.raises(ValueError, match="both function addresses"):
        _kernel_issue.EventQuery(query=0, last_error=0)


class _Event:
    """A torch.cuda.Event stand-in: a raw handle, and torch's own query counted."""

    def __init__(self, handle: int, fired: bool) -> None:
        self.cuda_event = handle
        self.fired = fired
        self.torch_queries = 0

    def query(self) -> bool:
        self.torch_queries += 1
        if _CODES[self.cuda_event] not in (0, 600):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.fired


def _copy(event: _Event) -> InFlightCopy:
    return InFlightCopy([(0, 1)], None, event, event, None, "kernel")  # type: ignore[arg-type]


def test_a_copy_asks_its_end_event_through_the_c_query_and_torch_only_on_failure() -> None:
    query = _FakeRuntime().event_query()
    fired, pending, failed = _Event(0x1000, True), _Event(0x2000, False), _Event(0x3000, False)
    use_event_query(query.fired)
    try:
        assert _copy(fired).done() and not _copy(pending).done()
        assert fired.torch_queries == pending.torch_queries == 0
        with pytest.raises(RuntimeError, match="illegal memory access"):
            _copy(failed).done()  # torch's query names the error
        assert failed.torch_queries == 1
    finally:
        use_event_query(None)
    assert _copy(pending).done() is False and pending.torch_queries == 1  # torch again
