"""Starting the service: refuse impossible configurations up front, report failures in one line.

:func:`preflight` runs before the server binds its port: it builds the spec and its manager
(an unknown policy fails here) and checks that the CPU tier holds a block and fits the
host's memory (:mod:`kvcache_offload.dataplane.memory.tier_check`). What can only fail
while the engine starts (e.g. a shared region that another service already uses) is caught by
:class:`OneLineStartupErrors`, which replaces the lifespan's traceback with the error's own
one-line message; ``serve`` then exits with code 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvcache_offload import __version__
from kvcache_offload.config import OffloadConfig
from kvcache_offload.contracts.capabilities import ShutsDown, SizesCpuTier
from kvcache_offload.control.spec_factory import OffloadingSpecFactory
from kvcache_offload.dataplane.memory.shared_offload_region import DEFAULT_SHM_DIR
from kvcache_offload.dataplane.memory.tier_check import check_cpu_tier
from kvcache_offload.errors import OffloadError

if TYPE_CHECKING:
    from kvcache_offload.aio.engine import OffloadEngine

__all__ = ["OneLineStartupErrors", "preflight", "startup_line"]

Scope = dict[str, Any]
Message = dict[str, Any]


def preflight(config: OffloadConfig) -> None:
    """Raise :class:`~kvcache_offload.errors.ConfigError` (one line) for a config that fails."""
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        spec.get_manager()
        if isinstance(spec, SizesCpuTier):
            check_cpu_tier(
                int(spec.num_blocks),
                int(spec.kv_bytes_per_offloaded_block),
                int(config.cpu_bytes_to_use),
                shm_dir=DEFAULT_SHM_DIR if config.shared_region else None,
            )
    finally:
        if isinstance(spec, ShutsDown):
            spec.shutdown()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"  # pragma: no cover


def _where(url: str) -> str:
    """``scheme://host:port`` of a tier URL: no credentials, paths or queries in the log."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}"


def startup_line(config: OffloadConfig, engine: OffloadEngine) -> str:
    """One line saying what ``serve`` runs: policy, tiers, capacity, block size, backend."""
    stats = engine.stats()
    tokens = engine.spec.gpu_block_size[0] * engine.spec.block_size_factor
    tiers = [f"CPU {_size(stats.capacity_blocks * stats.block_nbytes)}"]
    if config.disk_path is not None:
        tiers.append(f"disk {config.disk_path} {_size(int(config.disk_bytes))}")
    if config.remote_url:
        tiers.append(_where(config.remote_url))
    object_url = getattr(config, "object_url", None)
    if object_url:
        tiers.append(_where(str(object_url)))
    if len(tiers) > 1:
        tiers[-1] += f" (write-{config.tier_write})"
    copies = "HTTP block bytes"
    if config.shared_region:
        region = config.region_name or "default"
        copies = f"the shared region {region!r} in {DEFAULT_SHM_DIR}, or {copies}"
    return (
        f"kvcache-offload {__version__} serving: policy {stats.policy}, tiers {' > '.join(tiers)},"
        f" capacity {stats.capacity_blocks} blocks of {_size(stats.block_nbytes)}"
        f" ({tokens} tokens each), backend host memory (clients copy through {copies})"
    )


class OneLineStartupErrors:
    """ASGI wrapper: a lifespan startup that fails with an ``OffloadError`` logs one line.

    The app's lifespan records the error in ``app.state.startup_error``; ``failed`` tells the
    caller (``serve``) to exit with code 2 rather than uvicorn's 3.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.failed: OffloadError | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_one_line(message: Message) -> None:
            error = getattr(self.app.state, "startup_error", None)
            if message.get("type") == "lifespan.startup.failed" and error is not None:
                self.failed = error
                message = {**message, "message": f"kvcache-offload cannot start: {error}"}
            await send(message)

        await self.app(scope, receive, send_one_line)
