"""The CPU backend's copy thread: order, waiting, errors and shutdown."""

from __future__ import annotations

import threading

import pytest

from kvcache_offload.dataplane.handlers.copy_thread import CopyThread


def test_copies_run_in_order_report_errors_and_call_back_after_each():
    done_calls = []
    ran: list[int] = []
    gate = threading.Event()
    thread = CopyThread("test-copy", lambda: done_calls.append(len(ran)))
    try:

        def copy(i: int) -> None:
            gate.wait(5)
            if i == 2:
                raise ValueError("bad fragment")
            ran.append(i)

        items = [thread.submit(copy, i) for i in range(4)]
        assert not any(item.done() for item in items)  # queued behind the gated first one
        gate.set()
        thread.wait(items)
        assert ran == [0, 1, 3]
        assert all(item.done() for item in items)
        assert isinstance(items[2].exception(), ValueError)
        assert items[0].exception() is None and items[0].result() >= 0.0
        assert len(done_calls) == 4
    finally:
        thread.shutdown()


def test_shutdown_finishes_the_running_copy_and_cancels_the_queued_ones():
    started, release = threading.Event(), threading.Event()
    thread = CopyThread("test-copy", lambda: None)

    def slow() -> None:
        started.set()
        release.wait(5)

    running = thread.submit(slow)
    queued = thread.submit(lambda: None)
    assert started.wait(5)
    stopper = threading.Thread(target=thread.shutdown)
    stopper.start()
    for _ in range(500):  # shutdown cancels the queued copy at once, then waits for slow()
        if queued.done():
            break
        threading.Event().wait(0.01)
    release.set()
    stopper.join(5)
    assert not stopper.is_alive()
    assert running.done() and not running.cancelled()
    assert queued.done() and queued.cancelled()
    try:
        thread.submit(lambda: None)
    except RuntimeError as exc:
        assert "shut down" in str(exc)
    else:
        raise AssertionError("a shut-down copy thread accepted a copy")


def _threads_named(prefix: str) -> set[str]:
    """Every thread of this process whose name starts with ``prefix``: Python threads by
    their Python name, native ones by their OS name."""
    import os

    names = {f"py:{t.ident}:{t.name}" for t in threading.enumerate() if t.name.startswith(prefix)}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        if name.startswith(prefix):
            names.add(f"{tid}:{name}")
    return names


@pytest.mark.parametrize("native_queue", [False, True], ids=["python-thread", "native-queue"])
def test_a_handler_dropped_without_shutdown_stops_its_copy_threads(native_queue):
    import gc
    import os
    import time

    torch = pytest.importorskip("torch")
    from kvcache_offload.dataplane.handlers.cpu_backend import CpuBackendOffloadingHandlers
    from kvcache_offload.dataplane.handlers.host_copy_queue import HostCopyQueue
    from tests._roundtrip import make_caches

    if native_queue and not HostCopyQueue.available():
        pytest.skip("the host-copy extension is not built")
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to see OS threads")
    kv = make_caches(
        num_tensors=1, num_gpu_blocks=4, page=64, group_layers=[[(0, 64)]],
        gen=torch.Generator().manual_seed(0),
    )  # fmt: skip
    before = _threads_named("kvoffload")
    handlers = CpuBackendOffloadingHandlers(kv, 1, 4, native_queue=native_queue)
    assert handlers.native_queue is native_queue
    started = _threads_named("kvoffload") - before
    assert len(started) == 2  # one copy thread per direction
    del handlers
    deadline = time.monotonic() + 5
    while started & _threads_named("kvoffload") and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not started & _threads_named("kvoffload")


@pytest.mark.parametrize("batch_policy", [True, False])
def test_the_native_copy_thread_runs_as_a_batch_thread_unless_asked_not_to(batch_policy):
    # Waking a SCHED_BATCH thread does not preempt the waker: the loop thread's submit
    # returns at once instead of waiting out the copy on a shared core.
    import os
    import time

    from kvcache_offload.dataplane.handlers.host_copy_queue import NativeCopyQueue

    if NativeCopyQueue is None:
        pytest.skip("the host-copy extension is not built")
    if not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux scheduling policies and /proc")
    name = "kvoffload-pol" + ("b" if batch_policy else "n")
    queue = NativeCopyQueue(name, batch_policy=batch_policy)
    try:
        wanted = os.SCHED_BATCH if batch_policy else os.SCHED_OTHER
        deadline = time.monotonic() + 5
        policies: set[int] = set()
        while policies != {wanted} and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread sets its policy first thing: give it the time
            policies = {os.sched_getscheduler(int(t.split(":")[0])) for t in _threads_named(name)}
        assert policies == {wanted}
    finally:
        queue.close()
