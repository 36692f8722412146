"""Transfer tuning: the advanced knobs of how GPU<->CPU copies are issued and awaited.

A user rarely sets any of these: each default was chosen by a measurement on an H200 host
(PCIe Gen5 x16) with ``python -m bench.serving --device cuda``, cited in the field's
description, and docs/transfers.md gives the rules ``auto`` follows. They live in
``OffloadConfig.transfer`` (environment: ``KVCACHE_OFFLOAD_TRANSFER__<FIELD>``). The CPU
backend ignores the copy-path knobs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

__all__ = ["MOVED_TO_TRANSFER", "REMOVED_FIELDS", "TransferTuning"]

_MIB = 1024**2


class TransferTuning(BaseModel):
    """How the engine issues, batches and awaits GPU<->CPU copies (advanced)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mechanism: Literal["auto", "kernel", "dma", "staged", "torch"] = "auto"
    """How the CUDA handlers copy a job. "auto" picks per job from its size, its fragment
    size and the traffic in flight (docs/transfers.md); the others force one path: the
    Triton UVA copy kernel, batched copy-engine DMA, the staged gather + DMA, or plain torch
    ops on a worker thread."""
    staged_when_busy: Literal["off", "stores", "both", "mixed"] = "mixed"
    """Under "auto", which jobs queued behind copies in flight take the staged path (the
    copy engines, which overlap the other direction) instead of the kernel. "mixed": both
    directions, while the other direction is copying too; "stores", "both" or "off".
    ``true``/``false`` mean "both"/"off". Measured on an H200: llama8b's mixed 4-block
    stream moved 1.55x the one-way rate with "mixed" against 0.92x with "off"."""
    staged_one_way_min_load_bytes: ByteSize = Field(default=ByteSize(5 * _MIB), ge=0)
    """Under "mixed", loads queued behind loads take the staged path while no store is
    copying once their jobs average this many bytes (0: never). H200: 5-16 MiB load streams
    at 0.93-1.02 of the link staged against the kernel's 0.85-0.91; 4 MiB jobs lost."""
    staged_one_way_min_store_bytes: ByteSize = Field(default=ByteSize(8 * _MIB), ge=0)
    """The same for stores queued behind stores (0: never). H200: 10-16 MiB store streams
    at 0.95-1.01 of the link staged against the kernel's 0.90-0.94."""
    staged_mixed_min_job_bytes: ByteSize = Field(default=ByteSize(5 * _MIB), ge=0)
    """Under "mixed", jobs averaging this many bytes take the staged path whenever the other
    direction is copying, on an idle direction too (0: only behind copies in flight). H200:
    the p99 of tp4_70b's mixed 4-block stream fell from 4.75 to 3.86 ms."""
    staged_min_job_bytes: ByteSize = Field(default=ByteSize(256 * _MIB), gt=0)
    """Under "auto", a lone job of small fragments takes the staged path from this size on;
    a smaller one takes the kernel, which starts at once instead of queueing on the submit
    thread."""
    staged_lone_min_load_bytes: ByteSize = Field(default=ByteSize(32 * _MIB), gt=0)
    """Under "auto", a lone load takes the staged path from this size on. H200: 64-block
    loads (80-128 MiB) took 2-13 % less time staged than through the kernel in 7 of 8
    pairs; stores showed no such gain, so a lone store keeps ``staged_min_job_bytes``."""
    batch_min_bytes: ByteSize = Field(default=ByteSize(16 * _MIB), gt=0)
    """Behind copies in flight, the jobs submitted in one event-loop tick are held and issued
    as one copy; a held batch goes out early once it holds this many bytes and at least as
    many as its direction has in flight, so the queue behind the running copy never runs dry
    and a steady stream settles at about two copies per direction."""
    batch_max_bytes: ByteSize = Field(default=ByteSize(64 * _MIB), gt=0)
    """A held batch goes out once it holds this many bytes, whatever is in flight; a job this
    large is never held. Equal to ``batch_min_bytes``, it gives a fixed split."""
    completion_caller_looks: bool = True
    """A lone store or load (nothing else in flight) looks for its own copy's end on its
    caller's turns instead of waking the poller task. H200, two A/B runs over three layouts:
    lone 1-block jobs 1-8 us faster (11 of 12 rows 5-8 us), 8-block jobs 2-15 us; streams
    within their run-to-run spread (docs/transfers.md, "Completion"). Off: the poller finds
    every end."""
    completion_sleep_behind_s: float = Field(default=0.003, ge=0)
    """The poller stops looking for copies' ends and lets the completion watchers wake it
    while every direction in flight is predicted to stay busy this long after its next copy
    ends (0: always look). H200: 32 tasks of 4-block loads or stores moved the same bytes on
    0.55-0.97 cores instead of 1.02-1.07 (docs/transfers.md, "Completion")."""
    evict_ahead_fraction: float = Field(default=1 / 32, ge=0, le=0.5)
    """Once a lone store's copy is on its way, an ``lru`` policy chooses in its shadow the
    blocks the next store of the same size would evict, at most this fraction of the CPU
    tier; they stay loadable until a store needs their slots, so decisions and events are
    unchanged. Policies whose choice would differ (``adaptive`` among them) choose at need.
    H200: 4-9 us off a lone 8-block store into a full tier on two layouts of three
    (docs/transfers.md, "Victims chosen ahead (LRU only)"). 0: off."""
    gc_freeze: bool = True
    """At start, collect garbage once and ``gc.freeze()`` what is alive (undone on close), so
    the cycle collector's full passes walk only what was allocated since: 13-27 ms instead of
    80-175 ms pauses that every job in flight waited through. Turn it off if the process
    drops large cyclic structures older than the engine and needs them collected."""

    @field_validator("staged_when_busy", mode="before")
    @classmethod
    def _staged_when_busy_words(cls, value: Any) -> Any:
        """Booleans and their environment spellings: on means both directions."""
        if isinstance(value, bool):
            return "both" if value else "off"
        if isinstance(value, str):
            word = value.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return "both"
            if word in ("0", "false", "no", ""):
                return "off"
            return word
        return value

    @model_validator(mode="after")
    def _batch_bounds(self) -> TransferTuning:
        if self.batch_min_bytes > self.batch_max_bytes:
            raise ValueError(
                f"batch_min_bytes ({int(self.batch_min_bytes)}) must not exceed "
                f"batch_max_bytes ({int(self.batch_max_bytes)})"
            )
        return self


MOVED_TO_TRANSFER: dict[str, str] = {
    "transfer_mechanism": "mechanism",
    "staged_when_busy": "staged_when_busy",
    "staged_one_way_min_load_bytes": "staged_one_way_min_load_bytes",
    "staged_one_way_min_store_bytes": "staged_one_way_min_store_bytes",
    "staged_mixed_min_job_bytes": "staged_mixed_min_job_bytes",
    "batch_min_bytes": "batch_min_bytes",
    "batch_max_bytes": "batch_max_bytes",
    "completion_caller_looks": "completion_caller_looks",
    "completion_sleep_behind_s": "completion_sleep_behind_s",
    "evict_ahead_fraction": "evict_ahead_fraction",
    "gc_freeze": "gc_freeze",
}
"""Top-level ``OffloadConfig`` fields of 0.1 that now live in ``transfer`` (old name: new)."""

REMOVED_FIELDS: dict[str, str] = {
    "dma_min_fragment_bytes": (
        "it was off by default and the kernel or the staged path moved large fragments "
        "faster; transfer.mechanism='dma' still forces the DMA"
    ),
}
"""Fields of 0.1 that are gone, accepted and ignored (with a warning) for one release."""
