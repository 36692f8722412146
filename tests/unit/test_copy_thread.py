"""The CPU backend's copy thread: order, waiting, errors and shutdown."""

from __future__ import annotations

import threading

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


def test_a_handler_dropped_without_shutdown_stops_its_copy_threads():
    import gc

    torch = __import__("pytest").importorskip("torch")
    from kvcache_offload.dataplane.handlers.cpu_backend import CpuBackendOffloadingHandlers
    from tests._roundtrip import make_caches

    kv = make_caches(
        num_tensors=1, num_gpu_blocks=4, page=64, group_layers=[[(0, 64)]],
        gen=torch.Generator().manual_seed(0),
    )  # fmt: skip
    before = {t for t in threading.enumerate() if t.name.startswith("kvoffload")}
    handlers = CpuBackendOffloadingHandlers(kv, 1, 4)
    started = {t for t in threading.enumerate() if t.name.startswith("kvoffload")} - before
    assert started  # one copy thread per direction
    del handlers
    gc.collect()
    for t in started:
        t.join(5)
    assert not any(t.is_alive() for t in started)
