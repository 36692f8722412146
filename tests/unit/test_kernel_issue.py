"""The C kernel issuer (``_kernel_issue``) against fake CUDA functions.

The GPU tests check the bytes a real copy moves; these check, on any machine, that the one
C call makes the CUDA calls a lone kernel copy needs, in order, with the kernel's parameters
as Triton would pass them, and that it stops at the first failing call and says which.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvcache_offload.dataplane.copy import kernel_issue
from kvcache_offload.dataplane.copy.triton_kernel import KernelConfig

pytestmark = pytest.mark.skipif(
    not kernel_issue.kernel_issue_available(), reason="the _kernel_issue extension is not built"
)

_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)

_GET_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_SET_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)

FUNCTION, STREAM, BEFORE, MARK, PREV, START, END = 0xF00, 0x51, 0xB4, 0x3A, 0x9E, 0x57, 0xE4
REF_PTR = 0x7000_0000


@dataclass
class FakeCuda:
    """Records every call; ``fail`` maps a call's name to the code it returns."""

    param_sizes: list[int]
    fail: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    current_device: int = 0

    def __post_init__(self) -> None:
        self._memcpy = _MEMCPY(self.memcpy)
        self._record = _RECORD(self.record)
        self._wait = _WAIT(self.wait)
        self._launch = _LAUNCH(self.launch)
        self._get_device = _GET_DEVICE(self.get_device)
        self._set_device = _SET_DEVICE(self.set_device)

    def get_device(self, out: Any) -> int:
        out[0] = self.current_device
        self.calls.append(("get_device",))
        return self.fail.get("get_device", 0)

    def set_device(self, device: int) -> int:
        self.calls.append(("set_device", device))
        code = self.fail.get("set_device", 0)
        if not code:
            self.current_device = device
        return code

    def address(self, name: str) -> int:
        return int(ctypes.cast(getattr(self, "_" + name), ctypes.c_void_p).value or 0)

    def memcpy(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        if src not in _TABLES:  # a staged piece: made-up addresses, nothing to read
            self.calls.append(("memcpy", dst, src, size, kind, stream, None))
            return self.fail.get("piece", 0)
        table = np.frombuffer(ctypes.string_at(src, size), dtype=np.int64).copy()
        self.calls.append(("memcpy", dst, src, size, kind, stream, table))
        if "memcpy" not in self.fail:
            ctypes.memmove(dst, src, size)
        return self.fail.get("memcpy", 0)

    def record(self, event: int, stream: int) -> int:
        self.calls.append(("record", event, stream))
        return self.fail.get(f"record {event:#x}", 0)

    def wait(self, stream: int, event: int, flags: int) -> int:
        self.calls.append(("wait", stream, event, flags))
        return self.fail.get("wait", 0)

    def launch(self, function: int, *rest: Any) -> int:
        gx, gy, gz, bx, by, bz, shared, stream, params, extra = rest
        values = []
        for i, size in enumerate(self.param_sizes):
            kind = ctypes.c_int32 if size == 4 else ctypes.c_int64
            values.append(ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value)
        self.calls.append(
            ("launch", function, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra)
        )
        return self.fail.get("launch", 0)

    def issuer(self, *, grid: int = 264, block_bytes: int = 16384) -> Any:
        from kvcache_offload.dataplane.copy._kernel_issue import KernelIssuer

        return KernelIssuer(
            memcpy_async=self.address("memcpy"),
            event_record=self.address("record"),
            stream_wait=self.address("wait"),
            launch=self.address("launch"),
            function=FUNCTION,
            shared=512,
            threads=128,
            grid=grid,
            block_bytes=block_bytes,
            ref_ptr=REF_PTR,
            src_factor=2,
            dst_factor=1,
            param_sizes=self.param_sizes,
        )


class FakeRuntime:
    def error_string(self, code: int) -> str:
        return f"fake error {code}"


# Triton 3.6's copy kernel: two pointers, 24 unspecialised i32 ints (seven, ref_row, eight
# units per side), two scratch pointers.
TRITON_SIZES = [8, 8, *[4] * 24, 8, 8]


_KEEP: list[np.ndarray] = []
_TABLES: set[int] = set()
"""Host job tables (real memory the fake upload reads and copies) and their addresses."""


def _tables(units: list[int]) -> tuple[np.ndarray, np.ndarray]:
    host = np.full(64, -1, dtype=np.int64)
    host[4 : 4 + len(units)] = units
    _KEEP.append(host)  # its address stays a table's for the whole session
    _TABLES.add(host.ctypes.data)
    return host, np.zeros(64, dtype=np.int64)


def _issue(issuer: Any, host: np.ndarray, dev: np.ndarray, **kw: int) -> int:
    args = dict(n_units=2, ref_row=3, pairs=128, max_size=65536, before=0, prev=0)
    args.update(kw)
    mark = args.get("mark", MARK if args["before"] else 0)
    code = issuer.issue(
        host.ctypes.data, dev.ctypes.data, args["n_units"], args["ref_row"], args["pairs"],
        args["max_size"], STREAM, args["before"], mark, args["prev"], START, END,
    )  # fmt: skip
    return int(code)


def test_a_load_uploads_its_table_then_launches_between_its_events() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([10, 11, 20, 21])
    assert _issue(cuda.issuer(), host, dev) == 0
    names = [c[0] for c in cuda.calls]
    assert names == ["memcpy", "record", "launch", "record"]
    memcpy = cuda.calls[0]
    assert memcpy[1:6] == (dev.ctypes.data, host.ctypes.data, 8 * (4 + 4), 4, STREAM)
    # The group row was written before the upload: (pair start, units, ref row, unit start).
    assert memcpy[6].tolist() == [0, 2, 3, 0, 10, 11, 20, 21]
    assert dev[:8].tolist() == [0, 2, 3, 0, 10, 11, 20, 21]
    assert cuda.calls[1] == ("record", START, STREAM)
    assert cuda.calls[3] == ("record", END, STREAM)
    _, function, grid, block, shared, stream, values, extra = cuda.calls[2]
    chunks, work = 4, 128 * 4  # 64 KiB fragments in 16 KiB work items
    assert (function, block, shared, stream, extra) == (FUNCTION, (128, 1, 1), 512, STREAM, None)
    assert grid == (264, 1, 1)
    # A job over a table: the inline parameters (ref_row, eight units a side) are 0.
    assert values == [REF_PTR, dev.ctypes.data, 1, 2, work, 2, chunks, 2, 1, *[0] * 17, 0, 0]


def test_a_store_waits_for_the_current_stream_and_the_previous_copy_first() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    assert _issue(cuda.issuer(), host, dev, n_units=1, pairs=3, max_size=100, before=BEFORE,
                  prev=PREV) == 0  # fmt: skip
    assert [c[:4] for c in cuda.calls[1:5]] == [
        ("record", MARK, BEFORE),
        ("wait", STREAM, MARK, 0),
        ("wait", STREAM, PREV, 0),
        ("record", START, STREAM),
    ]
    launch = cuda.calls[5]
    assert launch[2] == (3, 1, 1)  # fewer work items than the grid: one program each
    assert launch[6][4:7] == [3, 1, 1]  # total work, iterations, chunks
    assert cuda.calls[6] == ("record", END, STREAM)


def test_a_store_waits_for_the_default_stream_whose_handle_is_0() -> None:
    # The mark says a store must wait; the model's stream may be the default one (raw handle
    # 0), which must not read as "no wait" (it once did: stores copied unwritten KV).
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    assert _issue(cuda.issuer(), host, dev, n_units=1, pairs=3, max_size=100, before=0,
                  mark=MARK) == 0  # fmt: skip
    assert [c[:4] for c in cuda.calls[1:4]] == [
        ("record", MARK, None),  # ctypes hands a null pointer over as None
        ("wait", STREAM, MARK, 0),
        ("record", START, STREAM),
    ]


def test_one_program_per_work_item_without_a_grid_and_no_launch_for_no_pairs() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    assert _issue(cuda.issuer(grid=0), host, dev, pairs=1000, max_size=16384) == 0
    assert cuda.calls[2][2] == (1000, 1, 1)
    cuda.calls.clear()
    assert _issue(cuda.issuer(), host, dev, pairs=0, max_size=0) == 0
    assert [c[0] for c in cuda.calls] == ["memcpy", "record", "record"]


def test_eight_byte_int_parameters_take_values_past_int32() -> None:
    cuda = FakeCuda([8] * 26)
    host, dev = _tables([1, 2])
    big = 3 * 2**31
    assert _issue(cuda.issuer(block_bytes=1), host, dev, pairs=big, max_size=1) == 0
    assert cuda.calls[2][6][4] == big


def test_a_value_an_int32_parameter_cannot_hold_issues_nothing() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    before = host.copy()
    code = _issue(cuda.issuer(block_bytes=1), host, dev, pairs=2**31, max_size=1)
    assert code == kernel_issue.STAGE_RANGE << 16
    assert cuda.calls == []
    assert host.tolist() == before.tolist()
    wrapped = kernel_issue.KernelIssue(cuda.issuer(block_bytes=1), FakeRuntime())
    args = (host.ctypes.data, dev.ctypes.data, 2, 0, 2**31, 1, STREAM, 0, 0, 0, START, END)
    assert wrapped.issue(*args) is False  # the caller then launches through Triton
    assert cuda.calls == []


@pytest.mark.parametrize(
    ("fail", "stage", "made", "named"),
    [
        ("memcpy", 1, ["memcpy"], "uploading the job table"),
        ("wait", 2, ["memcpy", "record", "wait"], "current stream"),
        (f"record {START:#x}", 4, ["memcpy", "record", "wait", "wait", "record"], "start event"),
        ("launch", 5, ["memcpy", "record", "wait", "wait", "record", "launch"], "cuLaunchKernel"),
        (f"record {END:#x}", 6, ["memcpy", "record", "wait", "wait", "record", "launch", "record"],
         "end event"),
    ],
)  # fmt: skip
def test_the_first_failing_call_stops_the_job_and_is_named(
    fail: str, stage: int, made: list[str], named: str
) -> None:
    cuda = FakeCuda(TRITON_SIZES, fail={fail: 700})
    host, dev = _tables([1, 2])
    code = _issue(cuda.issuer(), host, dev, before=BEFORE, prev=PREV)
    assert code == (stage << 16) | 700
    assert [c[0] for c in cuda.calls] == made
    cuda.calls.clear()
    wrapped = kernel_issue.KernelIssue(cuda.issuer(), FakeRuntime())
    args = (host.ctypes.data, dev.ctypes.data, 2, 0, 64, 65536, STREAM, BEFORE, MARK, PREV)
    with pytest.raises(RuntimeError, match=named) as info:
        wrapped.issue(*args, START, END)
    assert "700" in str(info.value)


def test_the_issuer_refuses_what_it_cannot_launch() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    with pytest.raises(ValueError, match="only 4 and 8"):
        FakeCuda([8, 8, *[4] * 23, 2]).issuer()
    with pytest.raises(ValueError, match="parameter sizes"):
        FakeCuda([8, 8, 4]).issuer()
    with pytest.raises(ValueError, match="every function address"):
        from kvcache_offload.dataplane.copy._kernel_issue import KernelIssuer

        KernelIssuer(
            memcpy_async=0, event_record=1, stream_wait=1, launch=1, function=1, shared=0,
            threads=128, grid=0, block_bytes=16384, ref_ptr=0, src_factor=1, dst_factor=1,
            param_sizes=TRITON_SIZES,
        )  # fmt: skip
    host, dev = _tables([1, 2])
    with pytest.raises(ValueError, match="events"):
        cuda.issuer().issue(host.ctypes.data, dev.ctypes.data, 2, 0, 1, 1, STREAM, 0, 0, 0, 0, END)
    with pytest.raises(TypeError, match="12 arguments"):
        cuda.issuer().issue(1, 2, 3)
    assert cuda.calls == []


@dataclass
class _Meta:
    shared: int = 0
    num_warps: int = 4
    num_ctas: int = 1
    launch_cooperative_grid: bool = False
    launch_pdl: bool = False
    global_scratch_size: int = 0
    profile_scratch_size: int = 0


@dataclass
class _Compiled:
    metadata: Any
    function: int = FUNCTION


@pytest.mark.parametrize(
    "compiled",
    [
        _Compiled(None),
        _Compiled(_Meta(), function=0),
        _Compiled(_Meta(num_ctas=2)),
        _Compiled(_Meta(launch_pdl=True)),
        _Compiled(_Meta(launch_cooperative_grid=True)),
        _Compiled(_Meta(global_scratch_size=128)),
        _Compiled(_Meta(profile_scratch_size=64)),
        _Compiled(_Meta(num_warps=8)),
    ],
)
def test_kernels_triton_launches_differently_stay_with_triton(compiled: _Compiled) -> None:
    bound = kernel_issue.bind_kernel_issue(
        compiled, FakeRuntime(), ref_ptr=REF_PTR, src_factor=1, dst_factor=1,
        config=KernelConfig(), grid=264,
    )  # type: ignore[arg-type]  # fmt: skip
    assert bound is None


# -- staged jobs of one chunk -------------------------------------------------------------

KS, DS, READY, FREED, FILLED = 0x4B, 0xD5, 0x7E, 0xF7, 0xF1


def _pieces(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dst = np.arange(n, dtype=np.int64) * 4096 + 0x10_0000
    src = np.arange(n, dtype=np.int64) * 4096 + 0x20_0000
    return dst, src, np.full(n, 2048, dtype=np.int64)


def _staged(issuer: Any, gpu_to_cpu: bool, host: np.ndarray, dev: np.ndarray, **kw: Any) -> int:
    dst, src, size = kw.get("pieces", _pieces(3))
    code = issuer.issue_staged(
        gpu_to_cpu, KS, DS, kw.get("ready", 0), kw.get("prev", 0), START, END,
        host.ctypes.data, dev.ctypes.data, kw.get("entries", 8), kw.get("offset", 4),
        kw.get("groups", 1), 2, kw.get("pairs", 128), 65536, FREED, kw.get("used", True),
        FILLED, dst, src, size, kw.get("lo", 0), kw.get("hi", 3),
    )  # fmt: skip
    return int(code)


def _calls(cuda: FakeCuda) -> list[tuple[Any, ...]]:
    """The calls without the memcpy's table snapshot and the launch's details."""
    out = []
    for c in cuda.calls:
        if c[0] == "memcpy":
            out.append(("memcpy", c[1], c[2], c[3], c[5]))
        elif c[0] == "launch":
            out.append(("launch", c[5]))
        else:
            out.append(c)
    return out


def test_a_staged_load_copies_then_scatters_through_its_ring_buffer() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    dst, src, _ = _pieces(3)
    assert _staged(cuda.issuer(), False, host, dev, prev=PREV) == 0
    assert _calls(cuda) == [
        ("wait", DS, PREV, 0),
        ("record", START, DS),
        ("memcpy", dev.ctypes.data, host.ctypes.data, 64, KS),  # the table, on the kernel stream
        ("wait", DS, FREED, 0),  # the buffer's last scatter is done
        *[("memcpy", int(dst[i]), int(src[i]), 2048, DS) for i in range(3)],
        ("record", FILLED, DS),
        ("wait", KS, FILLED, 0),
        ("launch", KS),
        ("record", FREED, KS),
        ("record", END, KS),
    ]
    launch = next(c for c in cuda.calls if c[0] == "launch")
    assert launch[6][1] == dev.ctypes.data + 8 * 4  # the table from its chunk's offset
    assert launch[6][2:4] == [1, 2]  # groups, units


def test_a_staged_store_gathers_then_copies_after_the_models_work() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    dst, src, _ = _pieces(3)
    assert _staged(cuda.issuer(), True, host, dev, ready=READY, used=False, lo=1, hi=3) == 0
    assert _calls(cuda) == [
        ("wait", KS, READY, 0),
        ("record", START, KS),
        ("memcpy", dev.ctypes.data, host.ctypes.data, 64, KS),
        ("launch", KS),  # a buffer never used: no wait for its last copy
        ("record", FILLED, KS),
        ("wait", DS, FILLED, 0),
        *[("memcpy", int(dst[i]), int(src[i]), 2048, DS) for i in (1, 2)],
        ("record", FREED, DS),
        ("record", END, DS),
    ]


def test_a_staged_job_stops_at_its_first_failing_call() -> None:
    cuda = FakeCuda(TRITON_SIZES, fail={f"record {FILLED:#x}": 9})
    host, dev = _tables([1, 2])
    code = _staged(cuda.issuer(), False, host, dev)
    assert code == (9 << 16) | 9  # handing over the staging buffer
    assert [c[0] for c in cuda.calls][-1] == "record" and ("launch", KS) not in _calls(cuda)
    wrapped = kernel_issue.KernelIssue(cuda.issuer(), FakeRuntime())
    dst, src, size = _pieces(3)
    args = (False, KS, DS, 0, 0, START, END, host.ctypes.data, dev.ctypes.data, 8, 4, 1, 2,
            128, 65536, FREED, True, FILLED, dst, src, size, 0, 3)  # fmt: skip
    with pytest.raises(RuntimeError, match="staging buffer"):
        wrapped.issue_staged(*args)


def test_staged_jobs_the_issuer_cannot_take_issue_nothing() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([1, 2])
    wrapped = kernel_issue.KernelIssue(cuda.issuer(block_bytes=1), FakeRuntime())
    dst, src, size = _pieces(20)
    base = [False, KS, DS, 0, 0, START, END, host.ctypes.data, dev.ctypes.data, 8, 4, 1, 2,
            128, 65536, FREED, True, FILLED, dst, src, size, 0, 3]  # fmt: skip
    too_big = list(base)
    too_big[14] = 2**31  # a fragment size whose work items overflow an int32 parameter
    assert wrapped.issue_staged(*too_big) is False
    many = list(base)
    many[22] = kernel_issue.MAX_PIECES + 1
    assert wrapped.issue_staged(*many) is False
    floats = list(base)
    floats[18] = dst.astype(np.float64)
    assert wrapped.issue_staged(*floats) is False
    assert cuda.calls == []


def test_a_kernel_is_bound_once_compiled_and_never_where_triton_launches_itself() -> None:
    from types import SimpleNamespace

    def kernel(compiled: Any, direct: bool) -> Any:
        return SimpleNamespace(compiled=lambda: compiled, direct=direct)

    bind = kernel_issue.bind_when_compiled
    assert bind(kernel(None, True), FakeRuntime()) == (None, True)  # not compiled yet: later
    assert bind(kernel(None, False), FakeRuntime()) == (None, False)  # the JIT launches
    refused = SimpleNamespace(
        compiled=lambda: _Compiled(_Meta(num_ctas=2)), direct=True, factors=(1, 1),
        ref_table=SimpleNamespace(data_ptr=lambda: REF_PTR), config=KernelConfig(), grid=264,
    )  # fmt: skip
    assert bind(refused, FakeRuntime()) == (None, False)  # compiled, not bindable: never again


# -- lone one-group jobs planned in the issuer's call (issue_units) -------------------------


def _units_issuer(cuda: FakeCuda, *, device: int = 0, **kw: int) -> Any:
    """An issuer (source factor 2, destination factor 1) told the one group's geometry."""
    issuer = cuda.issuer(**kw)
    issuer.set_units(
        10, 6, 3, 4, 65536, device, cuda.address("get_device"), cuda.address("set_device")
    )
    return issuer


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _issue_units(
    issuer: Any, host: np.ndarray, dev: np.ndarray, src: Any, dst: Any, size: int,
    start: int = 0, capacity: int = 64, before: int = 0, mark: int | None = None,
) -> int:  # fmt: skip
    if mark is None:
        mark = MARK if before else 0
    return int(issuer.issue_units(
        host.ctypes.data, dev.ctypes.data, capacity, src, dst, size, start, STREAM, before,
        mark, 0, START, END,
    ))  # fmt: skip


def test_a_lone_job_passes_its_units_to_the_kernel_and_uploads_no_table() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    before = host.copy()
    # Three pieces from the second sub-block of the request: source blocks of two pieces
    # (factor 2) skip one, destination blocks hold one piece each.
    code = _issue_units(_units_issuer(cuda), host, dev, _ids(4, 7), _ids(5, 0, 2), 3, start=1)
    assert code == 0
    assert [c[0] for c in cuda.calls] == ["get_device", "record", "launch", "record"]
    assert host.tolist() == before.tolist()  # the table is not written, let alone uploaded
    values = cuda.calls[2][6]
    chunks = 4  # 64 KiB fragments in 16 KiB work items
    # No table (0), no groups (0: the units are parameters), the group's ref row 3.
    assert values[:10] == [REF_PTR, 0, 0, 3, 3 * 4 * chunks, 1, chunks, 2, 1, 3]
    assert values[10:18] == [9, 14, 15, 0, 0, 0, 0, 0]
    assert values[18:26] == [5, 0, 2, 0, 0, 0, 0, 0]


def test_a_lone_job_past_the_inline_units_is_planned_into_its_table() -> None:
    size = 9  # one past the eight units a kernel's parameters hold
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    issuer = _units_issuer(cuda)
    src, dst = _ids(4, 7, 1, 2, 3)[: (size + 2) // 2], _ids(5, 0, 2, 1, 3, 4, 0, 1, 2)[:size]
    assert _issue_units(issuer, host, dev, src, dst, size, start=1) == 0
    assert [c[0] for c in cuda.calls] == ["get_device", "memcpy", "record", "launch", "record"]
    uploaded = cuda.calls[1][6]
    want_src = [int(src[(i + 1) // 2]) * 2 + (i + 1) % 2 for i in range(size)]
    assert uploaded.tolist() == [0, size, 3, 0, *want_src, *dst.tolist()]
    values = cuda.calls[3][6]
    chunks = 4
    assert values[:7] == [REF_PTR, dev.ctypes.data, 1, size, size * 4 * chunks, 1, chunks]
    assert values[9:26] == [0] * 17


def test_a_unit_an_int32_parameter_cannot_hold_issues_nothing() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    issuer = cuda.issuer()
    get, put = cuda.address("get_device"), cuda.address("set_device")
    issuer.set_units(2**32, 6, 3, 4, 65536, 0, get, put)
    code = _issue_units(issuer, host, dev, _ids(2**31), _ids(0, 1), 2)  # unit 2**32 (factor 2)
    assert code == kernel_issue.STAGE_RANGE << 16
    assert cuda.calls == []


def test_a_lone_store_waits_for_the_models_stream_on_the_kernels_device() -> None:
    cuda = FakeCuda(TRITON_SIZES, current_device=1)
    host, dev = _tables([])
    issuer = _units_issuer(cuda, device=2)
    assert _issue_units(issuer, host, dev, _ids(1), _ids(3, 4), 2, before=BEFORE) == 0
    names = [c[0] for c in cuda.calls]
    assert names == ["get_device", "set_device", "record", "wait", "record", "launch", "record",
                     "set_device"]  # fmt: skip
    assert cuda.calls[1] == ("set_device", 2) and cuda.calls[-1] == ("set_device", 1)
    assert cuda.calls[2][:3] == ("record", MARK, BEFORE)


def test_a_lone_store_waits_for_the_default_stream_too() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    assert _issue_units(_units_issuer(cuda), host, dev, _ids(1), _ids(3, 4), 2, mark=MARK) == 0
    names = [c[0] for c in cuda.calls]
    assert names == ["get_device", "record", "wait", "record", "launch", "record"]
    assert cuda.calls[1][:3] == ("record", MARK, None)  # on the default stream (handle 0)
    assert cuda.calls[2] == ("wait", STREAM, MARK, 0)


@pytest.mark.parametrize(
    ("src", "dst", "size", "capacity", "why"),
    [
        (_ids(10), _ids(0, 1), 2, 64, "a source block past its rows"),
        (_ids(1), _ids(0, -1), 2, 64, "a negative destination block"),
        (_ids(1, 2), _ids(0, 1), 2, 64, "a source block the pieces do not need"),
        (_ids(1), _ids(0), 2, 64, "too few destination blocks"),
        (np.array([1], dtype=np.int32), _ids(0, 1), 2, 64, "ids that are not int64"),
        (_ids(1, 2, 3, 4)[::2], _ids(0, 1, 2, 3), 4, 64, "a strided id view"),
        ([1], _ids(0, 1), 2, 64, "a list"),
        (_ids(0, 1, 2, 3, 4), _ids(0, 1, 2, 3, 4, 5, 0, 1, 2), 9, 21, "a table too small"),
        (_ids(1), _ids(0, 1), 0, 64, "no pieces"),
    ],
)
def test_a_job_the_lane_does_not_take_issues_nothing(
    src: Any, dst: Any, size: int, capacity: int, why: str
) -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    assert _issue_units(_units_issuer(cuda), host, dev, src, dst, size, capacity=capacity) == -1
    assert cuda.calls == [], why
    wrapped = kernel_issue.KernelIssue(_units_issuer(cuda), FakeRuntime())
    wrapped.units_ready = True
    args = (host.ctypes.data, dev.ctypes.data, capacity, src, dst, size, 0, STREAM, 0, 0, 0)
    assert wrapped.issue_units(*args, START, END) is False  # the general path plans it
    assert cuda.calls == []


def test_the_lane_takes_nothing_before_it_knows_the_groups_geometry() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    assert _issue_units(cuda.issuer(), host, dev, _ids(1), _ids(0, 1), 2) == -1
    assert cuda.calls == []


@pytest.mark.parametrize("size", [2, 9], ids=["inline", "table"])
def test_a_value_a_parameter_cannot_hold_leaves_the_table_as_it_was(size: int) -> None:
    cuda = FakeCuda(TRITON_SIZES)
    host, dev = _tables([])
    issuer = cuda.issuer(block_bytes=1)
    get, put = cuda.address("get_device"), cuda.address("set_device")
    issuer.set_units(10, 6, 3, 4, 2**31, 0, get, put)  # 2**31 one-byte chunks per fragment
    before = host.copy()
    if size == 2:
        src, dst = _ids(1), _ids(0, 1)
    else:
        src, dst = _ids(4, 7, 1, 2, 3), _ids(5, 0, 2, 1, 3, 4, 0, 1, 2)
    code = _issue_units(issuer, host, dev, src, dst, size)
    assert code == kernel_issue.STAGE_RANGE << 16
    assert cuda.calls == [] and host.tolist() == before.tolist()


@pytest.mark.parametrize(("fail", "made"), [("get_device", 1), ("set_device", 2)])
def test_a_device_that_cannot_be_made_current_stops_the_job_and_is_named(
    fail: str, made: int
) -> None:
    cuda = FakeCuda(TRITON_SIZES, fail={fail: 101}, current_device=1)
    host, dev = _tables([])
    wrapped = kernel_issue.KernelIssue(_units_issuer(cuda, device=0), FakeRuntime())
    wrapped.units_ready = True
    args = (host.ctypes.data, dev.ctypes.data, 64, _ids(1), _ids(0, 1), 2, 0, STREAM, 0, 0, 0)
    with pytest.raises(RuntimeError, match="device current") as info:
        wrapped.issue_units(*args, START, END)
    assert "101" in str(info.value)
    assert len(cuda.calls) == made  # nothing enqueued


def test_set_units_refuses_a_geometry_it_cannot_plan() -> None:
    cuda = FakeCuda(TRITON_SIZES)
    issuer = cuda.issuer()
    get, put = cuda.address("get_device"), cuda.address("set_device")
    with pytest.raises(ValueError, match="set_units"):
        issuer.set_units(10, 6, 3, 0, 65536, 0, get, put)
    with pytest.raises(ValueError, match="set_units"):
        issuer.set_units(10, 6, 3, 4, 65536, 0, 0, put)
    host, dev = _tables([])
    with pytest.raises(TypeError, match="13 arguments"):
        issuer.issue_units(host.ctypes.data, dev.ctypes.data, 64)


_SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
PROXY = 0x9C


def _wait_through_fakes(cuda: FakeCuda) -> tuple[int, int, int, Any]:
    def sync(event: int) -> int:
        cuda.calls.append(("sync", event))
        return cuda.fail.get("sync", 0)

    sync_fn = _SYNC(sync)
    return cuda.address("wait"), cuda.address("record"), _address_of(sync_fn), sync_fn


def _address_of(function: Any) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def test_wait_through_sleeps_on_its_own_event_recorded_after_the_copy_ends() -> None:
    # The waiter's stream waits on the copy's end event, the waiter's blocking event is
    # recorded there, and the thread sleeps on that event: the copy's event needs no
    # blocking-sync flag (docs/transfers.md, "Completion").
    from kvcache_offload.dataplane.copy._kernel_issue import wait_through

    cuda = FakeCuda(param_sizes=[])
    wait, record, sync, _keep = _wait_through_fakes(cuda)
    assert wait_through(wait, record, sync, END, STREAM, PROXY) == 0
    assert cuda.calls == [("wait", STREAM, END, 0), ("record", PROXY, STREAM), ("sync", PROXY)]


@pytest.mark.parametrize(
    ("fail", "calls"),
    [({"wait": 400}, 1), ({f"record {PROXY:#x}": 709}, 2), ({"sync": 700}, 3)],
)
def test_wait_through_stops_at_the_first_failing_call_and_says_so(fail, calls) -> None:
    from kvcache_offload.dataplane.copy._kernel_issue import STAGE_WAIT, wait_through

    cuda = FakeCuda(param_sizes=[], fail=fail)
    wait, record, sync, _keep = _wait_through_fakes(cuda)
    (code,) = fail.values()
    assert wait_through(wait, record, sync, END, STREAM, PROXY) == (STAGE_WAIT << 16) | code
    assert len(cuda.calls) == calls


def test_wait_through_refuses_null_handles_before_calling_anything() -> None:
    from kvcache_offload.dataplane.copy._kernel_issue import wait_through

    cuda = FakeCuda(param_sizes=[])
    wait, record, sync, _keep = _wait_through_fakes(cuda)
    for args in [(0, record, sync, END, STREAM, PROXY), (wait, record, sync, 0, STREAM, PROXY),
                 (wait, record, sync, END, STREAM, 0)]:  # fmt: skip
        with pytest.raises(ValueError, match="is 0"):
            wait_through(*args)
    with pytest.raises(TypeError):
        wait_through(wait, record, sync, END, STREAM)
    assert cuda.calls == []


def test_the_issuer_and_the_kernel_agree_on_the_inline_units() -> None:
    # The C issuer fills the kernel's parameters by position: ref_row after the seven ints,
    # then INLINE_UNITS source units, then as many destination units.
    from kvcache_offload.dataplane.copy import _kernel_issue, triton_kernel

    assert _kernel_issue.INLINE_UNITS == triton_kernel.INLINE_UNITS
    assert _kernel_issue.KERNEL_ARGS == 10 + 2 * triton_kernel.INLINE_UNITS
    assert len(triton_kernel._TABLE_MODE) == 1 + 2 * triton_kernel.INLINE_UNITS
    assert _kernel_issue.KERNEL_ARGS + 2 <= _kernel_issue.MAX_PARAMS  # and Triton's scratch


_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_ELAPSED = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p
)


@dataclass
class FakeEvents:
    """``cudaEventQuery`` / ``cudaEventElapsedTime`` stand-ins: the end fires once ``fired``."""

    fired: bool = False
    query_code: int = 0
    elapsed_code: int = 0
    ms: float = 0.25
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._query = _QUERY(self.query)
        self._elapsed = _ELAPSED(self.elapsed)

    def query(self, event: int) -> int:
        self.calls.append(("query", event))
        if self.query_code:
            return self.query_code
        return 0 if self.fired else 600  # cudaErrorNotReady

    def elapsed(self, out: Any, start: int, end: int) -> int:
        self.calls.append(("elapsed", start, end))
        out[0] = self.ms
        return self.elapsed_code

    def functions(self) -> tuple[int, int]:
        return _address_of(self._query), _address_of(self._elapsed)


def test_copy_seconds_reads_a_copys_end_and_its_gpu_time_in_one_call() -> None:
    # The poller's look at a lone copy: -1.0 until its end event fired (only the end is
    # asked), then the time from its start event to its end, in seconds.
    from kvcache_offload.dataplane.copy._kernel_issue import copy_seconds

    events = FakeEvents()
    query, elapsed = events.functions()
    assert copy_seconds(query, elapsed, START, END) == -1.0
    assert events.calls == [("query", END)]
    events.fired = True
    assert copy_seconds(query, elapsed, START, END) == pytest.approx(0.25e-3)
    assert events.calls[1:] == [("query", END), ("elapsed", START, END)]


@pytest.mark.parametrize(("query_code", "elapsed_code"), [(700, 0), (0, 1)])
def test_copy_seconds_raises_on_a_cuda_error(query_code: int, elapsed_code: int) -> None:
    # As torch's Event.query() / elapsed_time() raise: a failed copy is never read as done
    # with a made-up time, nor as still running forever.
    from kvcache_offload.dataplane.copy._kernel_issue import copy_seconds

    events = FakeEvents(fired=True, query_code=query_code, elapsed_code=elapsed_code)
    with pytest.raises(RuntimeError, match=f"CUDA error {query_code or elapsed_code}"):
        copy_seconds(*events.functions(), START, END)


def test_copy_seconds_refuses_null_handles_before_calling_anything() -> None:
    from kvcache_offload.dataplane.copy._kernel_issue import copy_seconds

    events = FakeEvents(fired=True)
    query, elapsed = events.functions()
    for args in [(0, elapsed, START, END), (query, 0, START, END), (query, elapsed, 0, END),
                 (query, elapsed, START, 0)]:  # fmt: skip
        with pytest.raises(ValueError, match="is 0"):
            copy_seconds(*args)
    with pytest.raises(TypeError):
        copy_seconds(query, elapsed, START)
    assert events.calls == []


def test_a_kernel_copy_issued_from_c_is_done_when_its_end_event_fired() -> None:
    # InFlightCopy.done() of a copy with raw events asks copy_seconds, not torch's events
    # (which a copy issued from C does not need; here there are none at all).
    from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy

    events = FakeEvents()
    copy = InFlightCopy(
        jobs=[(1, 2)], stream=None, start_event=None, end_event=None, slot=None,  # type: ignore[arg-type]
        mechanism="kernel", raw_start=START, raw_end=END, event_calls=events.functions(),
    )  # fmt: skip
    assert not copy.done()
    events.fired = True
    assert copy.done()
    assert events.calls[0] == ("query", END)
