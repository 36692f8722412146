"""When will the copies in flight end? A per-direction estimate from the copies' own GPU times.

The poller looks for finished CUDA copies by itself (one event query per loop iteration) for
as long as it expects one to end soon; past that it hands them to a thread that sleeps in the
driver. On the H200 host that sleep woke ~70-640 us after the copy's end (the longer the
sleep, the later), which made a 64-block load 1.3x its floor. The clock predicts each
copy's end from the seconds per block the direction's last copies took on the GPU (start to
end event), queued behind the copies of the same direction still running, so the poller
keeps looking until then and a predicted copy never pays the driver's wake-up.

A copy of n blocks also pays a fixed cost, so seconds per block learned from a small copy
over-estimate a large one (the poller looks a little longer, which is safe); the poller's
``completion_spin_s`` slack covers the opposite case.
"""

from __future__ import annotations

__all__ = ["CopyClock"]


class CopyClock:
    """Seconds per block per copy direction (an exponential average) and the predicted end
    of each direction's last copy."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self._per_block: dict[str, float] = {}
        self._busy_until: dict[str, float] = {}

    def expect(self, source: str, blocks: int, now: float) -> float:
        """The predicted end of a copy of ``blocks`` from ``source`` issued at ``now``;
        ``now`` itself while this direction has no measured copy yet."""
        per_block = self._per_block.get(source)
        if per_block is None:
            return now
        ends = max(self._busy_until.get(source, now), now) + blocks * per_block
        self._busy_until[source] = ends
        return ends

    def observe(self, source: str, blocks: int, seconds: float) -> None:
        """A copy of ``blocks`` from ``source`` took ``seconds`` on the GPU."""
        if blocks <= 0 or seconds <= 0:
            return
        sample = seconds / blocks
        old = self._per_block.get(source)
        self._per_block[source] = sample if old is None else old + self.weight * (sample - old)

    def idle(self) -> None:
        """Nothing is in flight: no copy is queued behind another any more."""
        self._busy_until.clear()

    def busy_until(self, source: str) -> float:
        """The predicted end of the last copy issued from ``source`` (0: none predicted)."""
        return self._busy_until.get(source, 0.0)

    def seconds_per_block(self, source: str) -> float | None:
        return self._per_block.get(source)
