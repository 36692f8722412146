"""Configuration: one pydantic settings model, from arguments, environment, a file or defaults.

Precedence: explicit arguments > environment (``KVCACHE_OFFLOAD_*``, nested fields with
``__``) > config file (TOML, JSON or YAML) > defaults. The CLI passes its flags as explicit
arguments. Sizes accept "4GiB"-style strings.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvcache_offload.errors import ConfigError

__all__ = ["KVCacheLayout", "OffloadConfig", "load_config"]


class KVCacheLayout(BaseModel):
    """What the spec needs to know about the GPU KV cache to size the CPU tier.

    The default is a Llama-3-8B-like cache: 16-token GPU blocks, 32 layers x K/V x 8 heads x
    128 dims x 2 bytes x 16 tokens = 2 MiB per GPU block.
    """

    model_config = {"extra": "forbid"}

    gpu_block_sizes: list[int] = Field(default=[16], min_length=1)
    """Tokens per GPU block, one entry per KV-cache group."""
    bytes_per_block: int = Field(default=2 * 1024 * 1024, gt=0)
    """Bytes of one GPU block on one worker, all layers of all groups together."""
    num_gpu_blocks: int = Field(default=1024, ge=0)
    world_size: int = Field(default=1, ge=1)

    @field_validator("gpu_block_sizes")
    @classmethod
    def _positive_sizes(cls, sizes: list[int]) -> list[int]:
        if any(s <= 0 for s in sizes):
            raise ValueError(f"every GPU block size must be > 0, got {sizes}")
        return sizes


class OffloadConfig(BaseSettings):
    """Every setting of the library and the service."""

    model_config = SettingsConfigDict(
        env_prefix="KVCACHE_OFFLOAD_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    # -- vLLM's kv_connector_extra_config keys --------------------------------------------
    cpu_bytes_to_use: ByteSize = Field(default=ByteSize(1024**3))
    """Total CPU bytes for offloaded blocks, across all workers."""
    block_size: int | None = Field(default=None, gt=0)
    """Tokens per offloaded block (a multiple of the GPU block size); None = GPU block size."""
    eviction_policy: str = "adaptive"
    """Registered policy name or "package.module:ClassName". The default, "adaptive", is the
    policy lab's recommendation (docs/policy-lab.md, twelfth round)."""
    store_threshold: int = Field(default=0, ge=0)
    """>= 2 stores a block only after it was offered that many times; 0 or 1 stores all."""
    max_tracker_size: int = Field(default=64_000, ge=1)
    spec_name: str = "CPUOffloadingSpec"
    spec_module_path: str | None = None

    # -- the GPU side -----------------------------------------------------------------------
    layout: KVCacheLayout = Field(default_factory=KVCacheLayout)
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    """Data plane: "cuda" needs a GPU, "cpu" copies between CPU tensors, "auto" picks."""
    transfer_mechanism: Literal["auto", "kernel", "dma", "staged", "torch"] = "auto"
    """How the CUDA handlers copy a job: "auto" picks per job from its size and fragment
    size (docs/transfers.md gives the rule and the measurements behind it); the others force
    one path (the Triton UVA kernel, batched copy-engine DMA, the staged gather + DMA, or
    plain torch ops). Ignored by the CPU backend."""
    staged_when_busy: Literal["off", "stores", "both", "mixed"] = "mixed"
    """Under "auto", which directions send a job that queues behind copies in flight through
    the staged path (the copy engines, which overlap the other direction) instead of the
    kernel: "mixed" (the default: both directions, but only while the other direction is
    copying too, so traffic both ways overlaps on the copy engines and one-way traffic keeps
    the batched kernel below ``staged_one_way_min_*_bytes``), "stores", "both" or "off". A
    lone job keeps the kernel either way (loads of 32 MiB and more excepted: they take the
    staged path on an idle direction too; and under "mixed", jobs of
    ``staged_mixed_min_job_bytes`` while the other direction copies).
    ``true`` / ``false`` (or 1 / 0) mean "both" / "off". docs/transfers.md has the
    measurements of each."""
    staged_one_way_min_load_bytes: ByteSize = Field(default=ByteSize(5 * 1024**2), ge=0)
    """Under ``staged_when_busy="mixed"``, loads queued behind loads take the staged path
    even while no store is copying, once they average this many bytes each (e.g. "5MiB");
    0: one-way loads always keep the kernel. One way, the copy engines moved load streams of
    5-16 MiB jobs at 0.93-1.02 of the link against the kernel's 0.85-0.91 on an H200, but
    cost more host time per copy, which smaller jobs cannot hide: 4 MiB jobs lost on one
    layout (docs/transfers.md)."""
    staged_one_way_min_store_bytes: ByteSize = Field(default=ByteSize(8 * 1024**2), ge=0)
    """The same for stores queued behind stores ("8MiB"; 0: never). Stores gain from 8 MiB
    jobs on; below that the staged path's gains and losses were within the spread."""
    staged_mixed_min_job_bytes: ByteSize = Field(default=ByteSize(5 * 1024**2), ge=0)
    """Under ``staged_when_busy="mixed"``, jobs that average this many bytes ("5MiB") take
    the staged path whenever the other direction is copying, on an idle direction too (a
    lone job, or a batch whose previous copy has ended); 0: only behind copies in flight.
    The kernel's traffic does not overlap the other direction's: without this, tp4_70b's
    5 MiB stores in a mixed stream went through the kernel about half the time and the
    stream's p99 was 23 % longer on an H200 (docs/transfers.md, sixteenth session)."""
    dma_min_fragment_bytes: ByteSize = Field(default=ByteSize(0), ge=0)
    """Under "auto", copy jobs whose contiguous pieces average at least this many bytes (e.g.
    "1MiB", as with a cross-layer layout's 2 MiB per block) by plain copy-engine DMA instead
    of the rule the per-layer layouts follow; 0 (the default): never while the Triton kernel
    works, so cross-layer jobs take the kernel when small or alone and the staged path when
    large or queued, which moved them faster on an H200 (docs/transfers.md)."""
    batch_min_bytes: ByteSize = Field(default=ByteSize(16 * 1024**2), gt=0)
    """CUDA handlers: behind copies in flight, the jobs submitted in one event-loop tick are
    held and issued as one copy at the end of the tick; the held batch goes out early once it
    holds this many bytes *and* at least as many bytes as its direction has in flight, so the
    copy queued behind the running one never runs dry and a steady stream settles at about
    two copies per direction (docs/transfers.md, twelfth session). Ignored by the CPU
    backend."""
    batch_max_bytes: ByteSize = Field(default=ByteSize(64 * 1024**2), gt=0)
    """CUDA handlers: a held batch goes out once it holds this many bytes, whatever is in
    flight; a job this large or larger is never held. Setting it to ``batch_min_bytes``
    gives a fixed split (before the twelfth session: 16 MiB)."""
    shared_region: bool = False
    """Keep offloaded blocks in a /dev/shm region that worker processes can map."""
    region_name: str | None = None
    enable_events: bool = True

    # -- async core -------------------------------------------------------------------------
    lease_ttl_s: float = Field(default=30.0, gt=0)
    max_open_leases: int = Field(default=65_536, ge=1)
    """Open sidecar leases at most (each pins blocks until completed or expired); a prepare
    beyond it answers 429. Leases that hold nothing are not kept and do not count."""
    lease_grace_s: float = Field(default=60.0, ge=0)
    """How long the slots of an expired (or reset) sidecar lease stay out of use, so that a
    client still copying after its ``expires_at`` cannot touch another key's block. 0 frees
    them at once (only safe when no sidecar client can be late)."""
    event_buffer_size: int = Field(default=10_000, ge=1)
    subscriber_queue_size: int = Field(default=1_000, ge=1)
    gc_freeze: bool = True
    """At start, collect garbage once and ``gc.freeze()`` every object then alive, undone on
    close where nothing was frozen before: the cycle collector's full passes then
    walk only what was allocated since, instead of the whole torch/model heap while every
    job in flight waits (80-175 ms pauses; kvcache_offload/aio/gc_freeze.py). Turn it off
    if the process later drops large cyclic structures that existed before the engine
    started and needs them collected while the engine runs."""
    completion_caller_looks: bool = True
    """CUDA handlers: a lone ``store``/``load`` (nothing else in flight) looks for its own
    copy's end on its caller's turns, instead of waking the engine's poller task, so the
    result it awaits is ready when it awaits it. The caller yields to the loop once before
    its first look, so a copy done by then does not let one task run job after job while
    others wait. On an H200 (twenty-third session, two in-process A/B runs, three layouts)
    lone 1-block jobs came out 1-8 us faster (11 of 12 rows 5-8 us), 8-block jobs 2-15 us,
    and the streams moved within their run-to-run spread (docs/transfers.md). Off: every
    end is found by the poller task."""
    evict_ahead_fraction: float = Field(default=1 / 32, ge=0, le=0.5)
    """Once a lone store's copy is on its way (nothing else in flight, the copy not done
    during its submission), an ``lru`` policy chooses in its shadow the blocks the next
    store of the same size would evict, at most this fraction of the CPU tier: that store's
    copy then starts without the policy's choice in front of it. On an H200 this took 4-9 us
    off a lone 8-block store into a full tier on two layouts of three (docs/transfers.md,
    thirtieth session). The chosen blocks stay loadable (a lookup finds them; a load, a
    touch or a store naming them puts them back where they were) until a store needs their
    slots, and only then are they evicted and published, so LRU's decisions and events stay
    as they were. Other policies (the default ``adaptive`` among them) choose at need: their
    choice, made while the previous store's blocks are still being written, would differ
    (``CachePolicy.chooses_ahead``). Stores behind other jobs choose at need. 0 turns it
    off (each store's eviction chooses for itself, as vLLM's manager does). Tiers under 32
    blocks keep none chosen at the default."""
    completion_sleep_behind_s: float = Field(default=0.003, ge=0)
    """CUDA handlers: the engine's poller stops looking for copies' ends (one event query per
    event-loop iteration) and lets the completion watchers wake it while every direction with
    copies in flight is predicted to stay busy this long after its next copy ends. The link
    then stays busy through the watcher's wake-up, and a one-way stream at link speed no
    longer spends the loop thread looking: on an H200, 32 tasks of 4-block loads or stores
    moved the same bytes on 0.55-0.97 cores instead of 1.02-1.07. At 3 ms the mixed and
    1-block streams (2.4 and 1.2 ms queued per direction) look as before. A lone copy, and a
    direction's last copies, are always looked for. 0: always look while an end is
    predicted (docs/transfers.md, seventeenth session)."""

    # -- KV events for routers (vLLM's ZMQ wire format, docs/kv-events.md) -----------------
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint, e.g. "tcp://*:5557" (bound; a host without "*" is connected to)."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint answering replay requests, e.g. "tcp://*:5558"."""
    kv_events_topic: str = ""
    kv_events_encoding: Literal["array", "map"] = "array"
    """Event encoding: "array" as vLLM <= 0.23 decodes it, "map" as vLLM >= 0.24 does."""
    kv_events_hash_format: Literal["int", "bytes"] = "int"
    """Block hashes as vLLM publishes them by default (low 64 bits) or as raw bytes."""
    kv_events_media: dict[str, str] = Field(default_factory=dict)
    """Tier names as the router spells them, e.g. {"CPU": "CPU_TIER1"} for Dynamo."""
    kv_events_replay_batches: int | None = Field(default=None, ge=1)
    """Batches kept for replay; None = event_buffer_size (never fewer)."""
    kv_events_hwm: int = Field(default=100_000, ge=0)
    kv_events_data_parallel_rank: int = Field(default=0, ge=0)

    # -- HTTP service -----------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_token: SecretStr | None = None
    max_keys_per_request: int = Field(default=4096, ge=1)
    max_body_bytes: ByteSize = Field(default=ByteSize(256 * 1024**2))
    max_large_bodies: int = Field(default=2, ge=1)
    """Request bodies over 4 MiB (or of unknown length) received at once; memory for bodies
    stays near ``max_large_bodies x max_body_bytes`` whatever the number of clients."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """A request body that stalls longer than this between chunks is answered 408."""
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    """A connection whose request headers are not complete this long after it opened (or
    after its previous response) is closed: idle and half-sent requests cannot pile up."""
    max_event_subscribers: int = Field(default=256, ge=1)
    """Event streams (SSE clients) served at once; more are answered 503."""
    sse_send_timeout_s: float = Field(default=30.0, gt=0)
    """An event-stream client that accepts no bytes for this long is disconnected, so a
    stalled client holds at most one chunk (~100 KiB) for a bounded time."""
    sse_heartbeat_s: float = Field(default=15.0, gt=0)
    record_path: Path | None = None
    """Append the request/key stream to this JSONL file (replayable with ``replay``)."""
    mrc_sample_rate: float = Field(default=1.0, gt=0, le=1)
    """Initial fraction of keys sampled for the live miss-ratio curve; the sampler lowers it
    by itself to stay within its fixed key budget, so 1.0 is accurate and still bounded."""
    shadow_policies: list[str] = Field(
        default_factory=lambda: ["lru", "arc", "alru", "s3fifo-prefix"]
    )
    """Policies simulated next to the live one on a key sample (``kvcache_offload_shadow_*``
    metrics); the live policy always runs too. Empty = no shadow simulation."""
    shadow_sample_blocks: int = Field(default=2048, ge=1)
    """Size of each shadow cache: the key sample is this over the tier's capacity (<= 1)."""

    # -- secondary tiers (below the CPU tier) ---------------------------------------------
    model_id: str = Field(default="default", min_length=1, max_length=256)
    """Names the model whose KV blocks these are; instances share tier blocks only when it,
    the KV dtype and the block layout all match (the layout fingerprint)."""
    kv_dtype: str = Field(default="unspecified", min_length=1, max_length=64)
    """KV-cache dtype (e.g. "bfloat16") for the fingerprint; the offloaded bytes do not say."""
    remote_url: str | None = None
    """Redis/Valkey tier: redis://HOST:PORT/DB, rediss://..., unix://..., or
    redis+cluster://HOST:PORT (any cluster node) for Redis Cluster."""
    disk_path: Path | None = None
    """Disk tier directory (created if missing; contents found again after a restart)."""
    disk_bytes: ByteSize = Field(default=ByteSize(16 * 1024**3))
    """Byte budget of the disk tier (its own LRU eviction keeps it under)."""
    tier_write: Literal["through", "back"] = "through"
    """"through": a block goes below when its store completes (other hosts see it at once);
    "back": only when the CPU tier evicts it (fewer writes; its bytes are copied out in the
    evicting store's path)."""
    tier_queue_size: int = Field(default=256, ge=1)
    """Write jobs (one per completed store) queued for the tiers; more are dropped, counted."""
    tier_write_backpressure: bool = Field(
        default=False,
        description=(
            "Write-through only. False: a store never waits for the tiers; when the write "
            "queue is full its write is dropped and counted (writes_dropped), so a slow tier "
            "never slows the CPU tier, and the tiers may lack blocks the CPU tier acknowledged. "
            "True: a store first waits for room in the write queue (at most "
            "tier_write_backpressure_timeout_s), so stores slow down to the tiers' pace "
            "instead; a store whose wait timed out goes on, and its write is dropped if the "
            "queue is still full."
        ),
    )
    tier_write_backpressure_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Longest a store waits for room in the tier write queue (backpressure).",
    )
    tier_read_timeout_s: float = Field(default=0.5, gt=0)
    """A tier that takes longer to answer a lookup or a read is a miss (and backed off)."""

    @field_validator("staged_when_busy", mode="before")
    @classmethod
    def _staged_when_busy_words(cls, value: Any) -> Any:
        """Booleans (and their spellings in the environment) from before the setting had
        three values: on means both directions."""
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

    @field_validator("cpu_bytes_to_use", "disk_bytes")
    @classmethod
    def _positive_budget(cls, value: ByteSize) -> ByteSize:
        if value <= 0:
            raise ValueError("must be > 0 (e.g. '4GiB')")
        return value

    @model_validator(mode="after")
    def _batch_bounds(self) -> OffloadConfig:
        if self.batch_min_bytes > self.batch_max_bytes:
            raise ValueError(
                f"batch_min_bytes ({int(self.batch_min_bytes)}) must not exceed "
                f"batch_max_bytes ({int(self.batch_max_bytes)})"
            )
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OffloadConfig:
        """Build from a plain dict (e.g. vLLM's ``kv_connector_extra_config``)."""
        return load_config(**values)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"config file {path} has an unknown type {path.suffix or '(no suffix)'!r}: use "
                f".toml, .json, .yaml or .yml"
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"cannot parse config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data.get("kvcache_offload", data)


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(parts)


def load_config(config_file: str | Path | None = None, **overrides: Any) -> OffloadConfig:
    """Merge file, environment and explicit values; raises :class:`ConfigError` when invalid."""
    file_values = _read_file(Path(config_file)) if config_file else {}
    try:
        from_env = OffloadConfig()
        env_values = from_env.model_dump(include=from_env.model_fields_set)
        merged = {**file_values, **env_values, **overrides}
        return OffloadConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None
