"""The private CPU tier is pinned at its exact size, and unpinned when its last view goes."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402
from kvcache_offload.dataplane.memory import pinned_buffer  # noqa: E402


class FakeRuntime:
    """Records cudaHostRegister/Unregister calls (the CUDA runtime is absent on CI)."""

    def __init__(self, register_ok: bool = True) -> None:
        self.register_ok = register_ok
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def host_register(self, ptr: int, nbytes: int) -> tuple[bool, str]:
        if not self.register_ok:
            return False, "cudaErrorNotSupported"
        self.registered.append((ptr, nbytes))
        return True, ""

    def host_unregister(self, ptr: int) -> tuple[bool, str]:
        self.unregistered.append(ptr)
        return True, ""


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr("kvcache_offload.dataplane.copy.dma.get_cuda_runtime", lambda: fake)
    return fake


def test_the_exact_size_is_registered_and_unregistered_after_the_last_view(
    runtime: FakeRuntime,
) -> None:
    gpu = [torch.zeros((4, n), dtype=torch.int8) for n in (3000, 1000)]  # 4,000 B per slot
    cpu = allocate_cpu_tensors(gpu, 1, 1001, pin_memory=True)
    ((ptr, nbytes),) = runtime.registered
    assert nbytes == 1001 * 4000  # not 4 MiB, 8 MiB or any power of two
    assert cpu[0].data_ptr() == ptr and cpu[1].data_ptr() == ptr + 3000
    assert all(bool((t == 0).all()) for t in cpu)
    cpu[1][1000].fill_(7)  # the last byte of the buffer is writable
    assert int(cpu[1][1000, -1]) == 7
    first = cpu.pop(0)
    del first
    gc.collect()
    assert runtime.unregistered == []  # a view is still alive
    cpu.clear()
    gc.collect()
    assert runtime.unregistered == [ptr]


def test_a_failed_registration_falls_back_to_torch_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeRuntime(register_ok=False)
    monkeypatch.setattr("kvcache_offload.dataplane.copy.dma.get_cuda_runtime", lambda: fake)
    calls: list[dict[str, object]] = []
    real_zeros = torch.zeros

    def zeros(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(dict(kwargs))
        kwargs.pop("pin_memory", None)  # no CUDA here to pin with
        return real_zeros(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "zeros", zeros)
    out = pinned_buffer.pinned_zeros(3, 5)
    assert tuple(out.shape) == (3, 5) and out.dtype == torch.int8
    assert calls and calls[-1].get("pin_memory") is True
    assert fake.registered == []
