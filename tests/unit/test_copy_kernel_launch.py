"""The copy kernel's direct launch, without a GPU: what reaches Triton's launcher.

The handlers launch the copy kernel through two entry points, the generic
``launch_copy_kernel`` (any tables) and a handler's ``BoundCopyKernel`` (its ref table,
factors and alignment fixed). Both must hand the launcher the same arguments for the same
job, and a launcher whose calling convention we do not know must turn the direct launch off
and fall back to the JIT, never fail the job. A fake compiled kernel records the calls.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch

from kvcache_offload.dataplane.copy import triton_kernel as tk


class FakeCompiled:
    function = "cu-function"
    packed_metadata = "metadata"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def run(self, *args: Any) -> None:
        if self.fail:
            raise TypeError("a launcher with another signature")
        self.calls.append(args)


class FakeJit:
    """Stands in for ``_uva_copy_kernel``: records a JIT launch ``kernel[grid](...)``."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, args, kwargs))

        return launch


CONFIG = tk.KernelConfig(block_bytes=16384, num_warps=4, ctas_per_sm=2)
NUM_SMS = 132
ALIGN = 16


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> FakeCompiled:
    hooks = types.SimpleNamespace(
        launch_enter_hook=types.SimpleNamespace(calls=[]),  # an empty chain: not passed
        launch_exit_hook=None,
    )
    monkeypatch.setattr(
        tk, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=hooks))
    )
    monkeypatch.setattr(tk, "_DIRECT", True)
    monkeypatch.setattr(tk, "_num_sms", lambda device: NUM_SMS)
    compiled = FakeCompiled()
    key = (0, CONFIG.block_bytes, ALIGN, CONFIG.num_warps)
    monkeypatch.setattr(tk, "_COMPILED", {key: compiled})
    return compiled


def _expected(ref: torch.Tensor, job: torch.Tensor, offset: int, **job_args: int) -> tuple:
    chunks = -(-job_args["max_size"] // CONFIG.block_bytes)
    total_work = job_args["total_pairs"] * chunks
    programs = min(total_work, CONFIG.ctas_per_sm * NUM_SMS)
    return (
        programs, 1, 1, 7, "cu-function", "metadata", None, None, None,
        ref.data_ptr(), job.data_ptr() + 8 * offset,
        job_args["n_groups"], job_args["n_units"], total_work, -(-total_work // programs),
        chunks, 1, 4, *[0] * 17, CONFIG.block_bytes, ALIGN,  # a table job: no inline units
    )  # fmt: skip


@pytest.mark.parametrize(
    "job_args",
    [
        {"n_groups": 1, "n_units": 1, "total_pairs": 32, "max_size": 65536},  # one 2 MiB block
        {"n_groups": 2, "n_units": 64, "total_pairs": 4096, "max_size": 8192},  # grid-bound
    ],
)
def test_the_generic_and_the_bound_launch_pass_the_launcher_the_same_job(
    launcher: FakeCompiled, job_args: dict[str, int]
) -> None:
    ref = torch.zeros(64, dtype=torch.int64)
    job = torch.zeros(256, dtype=torch.int64)
    tk.launch_copy_kernel(
        ref, job, src_factor=1, dst_factor=4, alignment=ALIGN, config=CONFIG, stream=7,
        job_offset=5, **job_args,
    )  # fmt: skip
    bound = tk.BoundCopyKernel(ref, src_factor=1, dst_factor=4, alignment=ALIGN, config=CONFIG)
    bound.launch(job, stream=7, job_offset=5, **job_args)
    want = _expected(ref, job, 5, **job_args)
    assert launcher.calls == [want, want]


def test_an_empty_job_launches_nothing(launcher: FakeCompiled) -> None:
    ref, job = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    args = {"n_groups": 1, "n_units": 0, "total_pairs": 0, "max_size": 4096}
    assert (
        tk.launch_copy_kernel(ref, job, src_factor=1, dst_factor=1, alignment=ALIGN, **args) is None
    )
    tk.BoundCopyKernel(ref, src_factor=1, dst_factor=1, alignment=ALIGN).launch(
        job, stream=7, **args
    )
    assert launcher.calls == []


def test_an_unknown_launcher_turns_the_direct_launch_off_and_the_jit_runs_the_job(
    monkeypatch: pytest.MonkeyPatch, launcher: FakeCompiled
) -> None:
    launcher.fail = True
    jit = FakeJit()
    monkeypatch.setattr(tk, "_uva_copy_kernel", jit, raising=False)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda stream, device: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    ref = torch.zeros(64, dtype=torch.int64)
    job = torch.zeros(64, dtype=torch.int64)
    bound = tk.BoundCopyKernel(ref, src_factor=1, dst_factor=1, alignment=ALIGN, config=CONFIG)
    bound.launch(job, n_groups=1, n_units=1, total_pairs=32, max_size=65536, stream=7)
    assert tk._DIRECT is False  # off for the process: no second failed attempt per job
    assert len(jit.launches) == 1
    grid, args, kwargs = jit.launches[0]
    assert grid == (32 * 4,)
    assert args[0] is ref
    assert kwargs == {"BLOCK": CONFIG.block_bytes, "ALIGN": ALIGN, "num_warps": CONFIG.num_warps}
    bound.launch(job, n_groups=1, n_units=1, total_pairs=32, max_size=65536, stream=7)
    assert len(jit.launches) == 2 and launcher.calls == []
