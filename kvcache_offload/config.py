"""Configuration: one pydantic settings model, from arguments, environment, a file or defaults.

Precedence: explicit arguments > environment (``KVCACHE_OFFLOAD_*``, nested fields with
``__``) > config file (TOML, JSON or YAML) > defaults. The CLI passes its flags as explicit
arguments. Sizes accept "4GiB"-style strings. The user's settings are the top-level fields;
how copies are issued and awaited is tuned in ``transfer`` (:mod:`kvcache_offload.tuning`).
docs/configuration.md lists every field (``python -m kvcache_offload.config_reference``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvcache_offload._config_compat import OldEnvironmentNames, move_old_names
from kvcache_offload._config_file import read_config_file
from kvcache_offload.errors import ConfigError
from kvcache_offload.tuning import TransferTuning

__all__ = ["KVCacheLayout", "OffloadConfig", "TransferTuning", "load_config"]


class KVCacheLayout(BaseModel):
    """What the spec needs to know about the GPU KV cache to size the CPU tier.

    The default is a Llama-3-8B-like cache: 16-token GPU blocks, 32 layers x K/V x 8 heads x
    128 dims x 2 bytes x 16 tokens = 2 MiB per GPU block.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    gpu_block_sizes: list[int] = Field(default=[16], min_length=1)
    """Tokens per GPU block, one entry per KV-cache group."""
    bytes_per_block: int = Field(default=2 * 1024 * 1024, gt=0)
    """Bytes of one GPU block on one worker, all layers of all groups together."""
    num_gpu_blocks: int = Field(default=1024, ge=0)
    """GPU blocks in the KV cache (informational: the vLLM plug-in records its own count)."""
    world_size: int = Field(default=1, ge=1)
    """Workers (tensor-parallel ranks) sharing the CPU tier; each holds 1/world_size of it."""

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
        use_attribute_docstrings=True,
    )

    # -- vLLM's kv_connector_extra_config keys --------------------------------------------
    cpu_bytes_to_use: ByteSize = Field(default=ByteSize(1024**3))
    """Total CPU bytes for offloaded blocks, across all workers (e.g. "4GiB")."""
    block_size: int | None = Field(default=None, gt=0)
    """Tokens per offloaded block (a multiple of the GPU block size); None = GPU block size."""
    eviction_policy: str = "adaptive"
    """Registered policy name (lru, arc, alru, s3fifo-prefix, adaptive, ...) or
    "package.module:ClassName". "adaptive", the default, is best or within 0.25 points of the
    best at 9 of the policy lab's 10 points, never below LRU on a whole trace
    (docs/policy-lab.md, "The default: `adaptive`")."""
    store_threshold: int = Field(default=0, ge=0)
    """>= 2 stores a block only after it was offered that many times; 0 or 1 stores all."""
    max_tracker_size: int = Field(default=64_000, ge=1)
    """Keys whose offer count the store-threshold filter remembers (oldest forgotten first)."""
    spec_name: str = "CPUOffloadingSpec"
    """Offloading spec class: a registered name, or a class in ``spec_module_path``."""
    spec_module_path: str | None = None
    """Module to import ``spec_name`` from, for a spec defined outside this package."""

    # -- the GPU side -----------------------------------------------------------------------
    layout: KVCacheLayout = Field(default_factory=KVCacheLayout)
    """The GPU KV cache's block geometry, used to size the CPU tier."""
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    """Data plane: "cuda" needs a GPU, "cpu" copies between CPU tensors, "auto" picks."""
    transfer: TransferTuning = Field(default_factory=TransferTuning)
    """Advanced: how copies are issued, batched and awaited; every default is measured."""
    shared_region: bool = False
    """Keep offloaded blocks in a /dev/shm region that worker processes can map."""
    region_name: str | None = None
    """Name of the shared region (one per service on a host); None = "default"."""
    enable_events: bool = True
    """Publish stored/evicted events (engine.events(), SSE, KV events, metrics)."""

    # -- async core -------------------------------------------------------------------------
    lease_ttl_s: float = Field(default=30.0, gt=0)
    """Seconds a sidecar prepare stays open; one never completed is rolled back then."""
    max_open_leases: int = Field(default=65_536, ge=1)
    """Open sidecar leases at most (each pins blocks until completed or expired); a prepare
    beyond it answers 429. Leases that hold nothing are not kept and do not count."""
    lease_grace_s: float = Field(default=60.0, ge=0)
    """How long the slots of an expired (or reset) sidecar lease stay out of use, so that a
    client still copying after its ``expires_at`` cannot touch another key's block. 0 frees
    them at once (only safe when no sidecar client can be late)."""
    event_buffer_size: int = Field(default=10_000, ge=1)
    """Events kept for subscribers that resume (SSE ``Last-Event-ID``, KV-event replay)."""
    subscriber_queue_size: int = Field(default=1_000, ge=1)
    """Events queued per subscriber; one that falls further behind is told it lost events."""

    # -- KV events for routers (vLLM's ZMQ wire format, docs/kv-events.md) -----------------
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint, e.g. "tcp://*:5557" (bound; a host without "*" is connected to)."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint answering replay requests, e.g. "tcp://*:5558"."""
    kv_events_topic: str = ""
    """Topic frame of every KV-event message."""
    kv_events_encoding: Literal["array", "map"] = "array"
    """Event encoding: "array" as vLLM <= 0.23 decodes it, "map" as vLLM >= 0.24 does."""
    kv_events_hash_format: Literal["int", "bytes"] = "int"
    """Block hashes as vLLM publishes them by default (low 64 bits) or as raw bytes."""
    kv_events_media: dict[str, str] = Field(default_factory=dict)
    """Tier names as the router spells them, e.g. {"CPU": "CPU_TIER1"} for Dynamo."""
    kv_events_replay_batches: int | None = Field(default=None, ge=1)
    """Batches kept for replay; None = event_buffer_size (never fewer)."""
    kv_events_hwm: int = Field(default=100_000, ge=0)
    """ZMQ send high-water mark: messages queued for slow subscribers before dropping."""
    kv_events_data_parallel_rank: int = Field(default=0, ge=0)
    """Data-parallel rank stamped on each batch, as vLLM does."""

    # -- HTTP service -----------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface the service binds."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port the service listens on (0: any free port)."""
    api_token: SecretStr | None = None
    """Bearer token required on /v1 routes; None = no authentication (loopback use)."""
    max_keys_per_request: int = Field(default=4096, ge=1)
    """Keys one request may name; more are answered 413."""
    max_body_bytes: ByteSize = Field(default=ByteSize(256 * 1024**2))
    """Largest request body; a larger one is answered 413."""
    max_header_bytes: ByteSize = Field(default=ByteSize(64 * 1024), gt=0)
    """Largest request line plus headers; a larger request is answered 431."""
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
    """Seconds between keep-alive comments on an idle event stream."""
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
    object_url: str | None = Field(
        default=None,
        description="Object-store tier: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
        "az://ACCOUNT/CONTAINER/PREFIX or file:///PATH (through obstore). Credentials come from "
        "each cloud's standard environment variables (AWS_ACCESS_KEY_ID, "
        "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...).",
    )
    object_endpoint: str | None = Field(
        default=None,
        description="Endpoint of an S3-compatible server for an s3:// object_url, e.g. "
        "http://minio.internal:9000 (MinIO, SeaweedFS, Ceph, R2); http:// is allowed.",
    )
    object_bytes: ByteSize | None = Field(
        default=None,
        description="Byte budget of the object tier under its fingerprint's prefix: it deletes "
        "its oldest objects to stay under it. None (the default): the bucket's lifecycle rules "
        "age objects out (docs/tiers.md recommends one).",
    )
    object_concurrency: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Requests in flight per direction on the object tier: a restore fetches "
        "this many blocks at once, a write uploads this many, a lookup checks this many "
        "unknown keys with HEAD.",
    )
    object_read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Deadline of one lookup or restore batch of the object tier (it replaces "
        "tier_read_timeout_s there): a 64-block restore moves 128 MiB, which takes longer than "
        "a Redis round trip. Past it the batch is a miss and the tier is backed off.",
    )
    object_refresh_s: float = Field(
        default=60.0,
        gt=0,
        description="The object tier lists its prefix at start and again this often, so its "
        "index learns other instances' writes and lifecycle deletions without a request per "
        "lookup.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        return move_old_names(values)

    @field_validator("cpu_bytes_to_use", "disk_bytes", "object_bytes")
    @classmethod
    def _positive_budget(cls, value: ByteSize | None) -> ByteSize | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0 (e.g. '4GiB')")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The 0.1 environment names of moved settings count, below the current names."""
        return (
            init_settings,
            env_settings,
            OldEnvironmentNames(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OffloadConfig:
        """Build from a plain dict (e.g. vLLM's ``kv_connector_extra_config``)."""
        return load_config(**values)


def _set_values(model: BaseModel) -> dict[str, Any]:
    """The fields of ``model`` that were set, nested models included, as plain values."""
    values: dict[str, Any] = {}
    for name in model.model_fields_set:
        value = getattr(model, name)
        values[name] = _set_values(value) if isinstance(value, BaseModel) else value
    return values


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        if isinstance(value, BaseModel) and isinstance(below, dict):
            value = _set_values(value)
        if isinstance(value, dict) and isinstance(below, dict):
            merged[key] = _merge(below, value)
        else:
            merged[key] = value
    return merged


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(parts)


def load_config(config_file: str | Path | None = None, **overrides: Any) -> OffloadConfig:
    """Merge file, environment and explicit values; raises :class:`ConfigError` when invalid."""
    file_values = read_config_file(Path(config_file)) if config_file else {}
    try:
        env_values = _set_values(OffloadConfig())
        merged = _merge(_merge(move_old_names(file_values), env_values), move_old_names(overrides))
        return OffloadConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None
