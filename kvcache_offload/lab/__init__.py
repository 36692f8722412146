"""Trace replay: drive the real manager with recorded or published request streams.

Readers (Mooncake FAST'25 JSONL, recorded logs), the scheduler-like driver, the Belady bound
and the policy/capacity sweep. Importing this package pulls in neither torch nor matplotlib;
``kvcache_offload.lab.plot`` and ``.cli`` are imported on demand.
"""

from kvcache_offload.lab.belady import (
    BeladyResult,
    belady_hits,
)
from kvcache_offload.lab.driver import (
    ReplayCounts,
    replay_trace,
)
from kvcache_offload.lab.sweep import (
    Capacity,
    SweepPoint,
    SweepResult,
    parse_capacities,
    run_sweep,
)
from kvcache_offload.lab.synth import (
    synth_requests,
    write_synth_trace,
)
from kvcache_offload.lab.trace import (
    Trace,
    TraceFormatError,
    TraceRequest,
    default_trace_paths,
    iter_requests,
    load_trace,
    mooncake_key,
    sample_trace_path,
    trace_from_requests,
)

__all__ = [
    "BeladyResult",
    "Capacity",
    "ReplayCounts",
    "SweepPoint",
    "SweepResult",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "belady_hits",
    "default_trace_paths",
    "iter_requests",
    "load_trace",
    "mooncake_key",
    "parse_capacities",
    "replay_trace",
    "run_sweep",
    "sample_trace_path",
    "synth_requests",
    "trace_from_requests",
    "write_synth_trace",
]
