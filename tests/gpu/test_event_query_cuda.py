"""The runtime's C end-event query against torch's, on a real event."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvcache_offload.dataplane.copy.dma import get_cuda_runtime  # noqa: E402

pytestmark = pytest.mark.cuda


def test_the_c_query_answers_as_torch_does_and_leaves_no_error_behind() -> None:
    runtime = get_cuda_runtime()
    assert runtime is not None
    fired = runtime.event_fired
    if fired is None:
        pytest.skip("the _kernel_issue extension is not built")
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    assert fired(event.cuda_event) is True  # never recorded: nothing to wait for
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        event.record(stream)
    assert fired(event.cuda_event) is False
    # Not ready is no error: the runtime's last-error state was cleared, so torch's next
    # launch check (and ours) sees none.
    assert runtime.lib.cudaGetLastError() == 0
    assert event.query() is False
    event.synchronize()
    assert fired(event.cuda_event) is True
    assert event.query() is True
