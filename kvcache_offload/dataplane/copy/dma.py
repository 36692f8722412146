"""One batched DMA per job: ``cudaMemcpyBatchAsync`` through ctypes on the CUDA runtime.

The copy engines move the fragments without using SMs; one call enqueues the whole job. The
pointer and size arrays are passed straight from numpy (no per-fragment Python). The runtime
is the ``libcudart`` that torch already loaded (found through ``/proc/self/maps``), so the
calls share torch's context and streams. CUDA 12.8 added the call; CUDA 13 dropped its
``failIdx`` argument, so the signature follows ``cudaRuntimeGetVersion``.

Also here: ``cudaPointerGetAttributes`` (is a host range mapped for the GPU at the same
address, i.e. usable by the UVA kernel?) and ``cudaHostRegister``/``cudaHostUnregister``
for pinning the shared region when torch's ``cudart()`` binding lacks them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

try:  # the host-copy extension's loop over a few pieces' cudaMemcpyAsync calls
    from kvcache_offload.dataplane.copy._hostcopy import issue_copies as _issue_copies
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _issue_copies = None

__all__ = ["FEW_PIECES", "CudaRuntime", "coalesce_pieces", "get_cuda_runtime"]

logger = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_MEMORY_TYPE_HOST = 1
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) addresses
_EVENT_BLOCKING_SYNC = 1  # cudaEventBlockingSync
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
FEW_PIECES = 7
"""A DMA of at most this many pieces is one ``cudaMemcpyAsync`` per piece instead of one
``cudaMemcpyBatchAsync``. Host time per call on the H200 host (1.25 MiB
pieces, either direction): 3.7 us for one piece and about 2.4 us per added one, against
12.7 us plus about 1.1 us per added piece for the batch; they cross between 7 pieces (18.1
against 19.1 us by that fit) and 8 (20.7 against 19.6 us measured)."""


def coalesce_pieces(table: np.ndarray) -> np.ndarray:
    """``table`` (rows: source, destination, size) with each run of pieces that continue one
    another on both sides merged into one piece.

    A cross-layer block is one piece, and consecutive GPU blocks stored into (or loaded
    from) consecutive CPU slots are then one copy: the copy engines pay per piece, so a
    job of 64 adjacent 2 MiB blocks moves as fast as one 128 MiB copy.
    """
    n = table.shape[1]
    if n < 2:
        return table
    src, dst, size = table[0], table[1], table[2]
    ends_src, ends_dst = src[:-1] + size[:-1], dst[:-1] + size[:-1]
    joined = (ends_src == src[1:]) & (ends_dst == dst[1:])
    if not joined.any():
        return table
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return np.stack([src[starts], dst[starts], np.add.reduceat(size, starts)])


_MEMCPY_ASYNC = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
"""``cudaMemcpyAsync(dst, src, count, kind, stream)``."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class _PointerAttributes(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("_reserved", ctypes.c_byte * 64),
    ]


def _find_cudart() -> ctypes.CDLL:
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    if path not in paths:
                        paths.append(path)
    except OSError:
        pass
    names = [*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError("cannot load the CUDA runtime: " + "; ".join(errors))


class CudaRuntime:
    """The few runtime calls the data plane needs beyond torch."""

    def __init__(self) -> None:
        import torch

        torch.cuda.init()  # make sure torch's runtime (and its context) is loaded first
        self.lib = _find_cudart()
        version = ctypes.c_int(0)
        self._check(self.lib.cudaRuntimeGetVersion(ctypes.byref(version)), "version")
        self.version = version.value
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._batch = getattr(self.lib, "cudaMemcpyBatchAsync", None)
        if self._batch is not None:
            self._batch.restype = ctypes.c_int
        self._attrs = _MemcpyAttributes()
        self._attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        self._attrs.flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE
        # A typed prototype: ctypes converts the int arguments itself, so a call builds no
        # c_void_p / c_size_t objects in Python (~0.3-0.6 us of the ~1.5 us a call costs).
        self._memcpy = _MEMCPY_ASYNC(("cudaMemcpyAsync", self.lib))
        self._memcpy_addr = ctypes.cast(self._memcpy, ctypes.c_void_p).value or 0
        """The function's address, for the extension's ``issue_copies``."""
        self._event_record = self.lib.cudaEventRecord
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._event_record.restype = ctypes.c_int
        self._stream_wait = self.lib.cudaStreamWaitEvent
        self._stream_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._stream_wait.restype = ctypes.c_int
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)

    @property
    def memcpy_address(self) -> int:
        """``cudaMemcpyAsync``'s address in the runtime torch loaded, for C callers."""
        return self._memcpy_addr

    @property
    def event_calls(self) -> tuple[int, int]:
        """``cudaEventQuery``'s and ``cudaEventElapsedTime``'s addresses, for C callers."""
        lib = self.lib
        return (
            ctypes.cast(lib.cudaEventQuery, ctypes.c_void_p).value or 0,
            ctypes.cast(lib.cudaEventElapsedTime, ctypes.c_void_p).value or 0,
        )

    def error_string(self, code: int) -> str:
        msg = self.lib.cudaGetErrorString(int(code))
        return msg.decode() if msg else f"cudaError {code}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self.error_string(code)} ({code})")

    @property
    def has_batch_memcpy(self) -> bool:
        return self._batch is not None and self.version >= 12080

    def memcpy_batch_async(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """Enqueue ``len(dsts)`` copies on ``stream`` (a ``cudaStream_t`` as int).

        Arrays are 1-D, contiguous, 8-byte integers; the runtime reads them during the call.
        """
        n = len(dsts)
        if n == 0:
            return
        if self._batch is None:
            raise RuntimeError("cudaMemcpyBatchAsync is not available in this CUDA runtime")
        args: list[object] = [
            ctypes.c_void_p(dsts.ctypes.data),
            ctypes.c_void_p(srcs.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data),
            ctypes.c_size_t(n),
            ctypes.byref(self._attrs),
            self._attr_idx,
            ctypes.c_size_t(1),
        ]
        if self.version < 13000:
            args.append(ctypes.byref(self._fail_idx))
        args.append(ctypes.c_void_p(stream))
        self._check(self._batch(*args), f"cudaMemcpyBatchAsync of {n} copies")

    def memcpy_pieces(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """Enqueue one copy per piece on ``stream``: at most :data:`FEW_PIECES` as that many
        ``cudaMemcpyAsync`` calls (made by the host-copy extension where it is built), more
        as one ``cudaMemcpyBatchAsync`` (same arrays as :meth:`memcpy_batch_async`)."""
        if len(dsts) <= FEW_PIECES:
            if _issue_copies is not None:  # the same calls, from C: no ctypes work per piece
                issued, code = _issue_copies(
                    self._memcpy_addr, dsts, srcs, sizes, _MEMCPY_DEFAULT, stream
                )
                if code != 0:
                    self._check(code, f"cudaMemcpyAsync of {int(sizes[issued])} bytes")
                return
            for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                self.memcpy_async(dst, src, size, stream)
        else:
            self.memcpy_batch_async(dsts, srcs, sizes, stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue one copy of ``nbytes`` on ``stream`` (addresses as ints, any direction).

        One ctypes call: a fraction of the host time of a torch ``copy_`` through the
        dispatcher, which matters for the small per-job tables."""
        code = self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream)
        if code != 0:  # the message only on failure: formatting it costs as much as the call
            self._check(code, f"cudaMemcpyAsync of {nbytes} bytes")

    def event_create(self, blocking: bool = False) -> int:
        """A raw event without timing (``cudaEventDisableTiming``), for ordering streams, or
        with ``blocking`` also ``cudaEventBlockingSync`` (a host wait on it sleeps);
        release it with :meth:`event_destroy`."""
        event = ctypes.c_void_p()
        flags = _EVENT_DISABLE_TIMING | (_EVENT_BLOCKING_SYNC if blocking else 0)
        self._check(
            self.lib.cudaEventCreateWithFlags(ctypes.byref(event), ctypes.c_uint(flags)),
            "cudaEventCreateWithFlags",
        )
        return int(event.value or 0)

    def event_destroy(self, event: int) -> None:
        self.lib.cudaEventDestroy(ctypes.c_void_p(event))

    def stream_after(self, stream: int, before: int, event: int) -> None:
        """Make ``stream`` wait for the work enqueued so far on ``before`` through the raw
        ``event`` (two driver calls, no Python objects)."""
        code = self._event_record(event, before)
        if code == 0:
            code = self._stream_wait(stream, event, 0)
        if code:
            self._check(code, "ordering a copy after the current stream")

    def is_uva_mapped(self, ptr: int) -> bool:
        """Whether host address ``ptr`` is pinned and usable by kernels at that address."""
        attrs = _PointerAttributes()
        code = self.lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if code != 0:
            self.lib.cudaGetLastError()  # clear the sticky-free error
            return False
        return attrs.type == _MEMORY_TYPE_HOST and attrs.devicePointer == ptr

    def host_register(self, ptr: int, nbytes: int) -> tuple[bool, str]:
        """Pin (and map) a host range; (success, message)."""
        for flags in (_HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED, 0):
            code = self.lib.cudaHostRegister(
                ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)
            )
            if code == 0:
                return True, f"flags={flags}"
            self.lib.cudaGetLastError()
            last = self.error_string(code)
        return False, last

    def host_unregister(self, ptr: int) -> tuple[bool, str]:
        code = self.lib.cudaHostUnregister(ctypes.c_void_p(ptr))
        if code != 0:
            self.lib.cudaGetLastError()
            return False, self.error_string(code)
        return True, ""


_runtime: CudaRuntime | None = None
_runtime_error: str | None = None
_lock = threading.Lock()


def get_cuda_runtime() -> CudaRuntime | None:
    """The process-wide :class:`CudaRuntime`, or None when CUDA's runtime cannot be loaded."""
    global _runtime, _runtime_error
    with _lock:
        if _runtime is None and _runtime_error is None:
            if os.environ.get("KVCACHE_OFFLOAD_DISABLE_CUDART"):
                _runtime_error = "disabled by KVCACHE_OFFLOAD_DISABLE_CUDART"
            else:
                try:
                    _runtime = CudaRuntime()
                except Exception as exc:
                    _runtime_error = f"{type(exc).__name__}: {exc}"
                    logger.info("CUDA runtime calls unavailable: %s", _runtime_error)
        return _runtime
