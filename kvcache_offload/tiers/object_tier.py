"""ObjectTier: blocks as objects in S3, GCS, Azure Blob or a local directory, through obstore.

One URL names the store: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``az://account/container/prefix``, ``file:///path`` (``obstore.store.from_url``). Credentials
come from each cloud's standard environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_REGION``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_KEY``, ...); ``endpoint`` points an
``s3://`` URL at an S3-compatible server (MinIO, SeaweedFS, Ceph, R2).

Layout: ``<prefix>/<fingerprint>/<key hex>.kvb``, each object one frame
(:mod:`kvcache_offload.tiers.frame`: header, then the block's bytes), written by one ``PUT``, so
a reader sees a whole object or none. Instances with the same layout fingerprint share objects;
others list and name other paths and never see them. An object that fails its checks
(truncated, overwritten, bit rot) is a miss, counted in ``corrupt_blocks`` and deleted.

Speed:

* A lookup answers from :class:`~kvcache_offload.tiers.object_index.ObjectIndex` (this
  instance's writes, and a listing of the prefix at start and every ``refresh_s``), so a key it
  knows costs no request. Keys it knows nothing about get one concurrent ``HEAD`` each (at most
  ``concurrency`` per lookup, the first ones: a prefix walk stops at the first miss anyway);
  a key found absent is not asked again for ``absent_ttl_s``.
* A read fetches its batch concurrently, at most ``concurrency`` requests in flight; each
  object is verified on a worker thread as soon as it arrives, while the others download.
* A write runs in the tier set's background writer, never in a store's path; its blocks are
  hashed and uploaded concurrently, at most ``concurrency`` at a time.

Capacity: the bucket's lifecycle rules (expire objects some days after creation), or
``capacity_bytes``: the tier then deletes its oldest objects (by its index: listing time for
what it found, write or read order for what it touched) to stay under it. A restart lists the
prefix again, so what the bucket holds is found. The client does not retry: a failed request
is one :class:`~kvcache_offload.errors.TierError`, and the tier set backs the tier off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import anyio

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, TierError
from kvcache_offload.tiers import frame
from kvcache_offload.tiers.base import LatencyHistogram, SecondaryTier, TierStats
from kvcache_offload.tiers.object_index import ObjectIndex

__all__ = ["ObjectTier", "object_block_path", "open_object_store"]

logger = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_KINDS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure"}
_KINDS |= {"abfss": "azure", "adl": "azure", "file": "file", "memory": "memory"}
_T = TypeVar("_T")


def object_block_path(fingerprint: str, key: OffloadKey) -> str:
    """A block's object path below the URL's prefix."""
    return f"{fingerprint}/{key.hex()}{_SUFFIX}"


def open_object_store(url: str, endpoint: str | None = None) -> Any:
    """The obstore store for ``url`` (credentials from the environment); ConfigError if bad."""
    from obstore.store import from_url

    scheme = url.partition("://")[0].lower()
    if "://" not in url or scheme not in _KINDS:
        raise ConfigError(
            f"object_url must start with s3://, gs://, az://, file:// (or s3a, azure, abfs, "
            f"abfss, adl, memory), got {url!r}"
        )
    if endpoint and _KINDS[scheme] != "s3":
        raise ConfigError(f"object_endpoint applies to s3:// URLs, not {url!r}")
    kwargs: dict[str, Any] = {}
    if scheme in ("file", "memory"):
        kwargs = {"mkdir": True} if scheme == "file" else {}
    else:
        client: dict[str, Any] = {"connect_timeout": "1s", "timeout": "30s"}
        if endpoint:
            kwargs["endpoint"] = endpoint
            client["allow_http"] = endpoint.startswith("http://")
        kwargs["client_options"] = client
        kwargs["retry_config"] = {"max_retries": 0}
    try:
        return from_url(url, **kwargs)
    except Exception as exc:  # obstore raises its own errors and ValueError for bad URLs
        raise ConfigError(f"bad object_url {url!r}: {exc}") from exc


def _framed(key: OffloadKey, payload: bytes) -> Any:
    """Header and payload as one object body (one copy, off the loop).

    A numpy array, which obstore takes as a buffer: numpy copies the payload without holding
    the GIL, where ``header + payload`` held it for the whole 2 MiB copy and stalled the
    event loop meanwhile."""
    import numpy as np

    header = frame.encode_header(key, payload)
    body = np.empty(len(header) + len(payload), np.uint8)
    body[: len(header)] = np.frombuffer(header, np.uint8)
    body[len(header) :] = np.frombuffer(payload, np.uint8)
    return body


def _unframed(key: OffloadKey, body: Any) -> bytes | None:
    """The verified payload of an object body, or None (truncated, wrong key, bad checksum).

    The payload is a read-only view into the body obstore received, not a copy: the engine
    copies it once, into a CPU slot, and a 2 MiB copy per block was a fifth of a restore's
    time next to a co-located server on two vCPUs. The body is immutable, so the view cannot
    change after it was checked."""
    view = memoryview(body)
    head = frame.HEADER_PREFIX + len(key)
    payload = view[head:]
    if not frame.verify(key, bytes(view[:head]), payload):
        return None
    return cast(bytes, payload)  # a buffer the engine's write_blocks takes as bytes


class ObjectTier(SecondaryTier):
    """Blocks in an object store; see the module docstring."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        *,
        endpoint: str | None = None,
        capacity_bytes: int | None = None,
        concurrency: int = 16,
        refresh_s: float = 60.0,
        absent_ttl_s: float = 5.0,
        read_timeout_s: float | None = 10.0,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ConfigError(f"object_bytes must be > 0, got {capacity_bytes}")
        if concurrency < 1:
            raise ConfigError(f"object_concurrency must be >= 1, got {concurrency}")
        self.name = "object"
        self.url = url
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.concurrency = concurrency
        self.refresh_s = refresh_s
        self.read_timeout_s = read_timeout_s
        self._store = open_object_store(url, endpoint)
        self._index = ObjectIndex(absent_ttl_s)
        self._reads = asyncio.Semaphore(concurrency)
        self._writes = asyncio.Semaphore(concurrency)
        self._listed_at: float | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._evicted: list[OffloadKey] = []
        kind = _KINDS[url.partition("://")[0].lower()]
        self._stats = TierStats(self.name, kind, capacity_bytes=capacity_bytes)
        self._hist = {op: LatencyHistogram() for op in ("contains", "get", "put", "delete")}
        self._hist["list"] = LatencyHistogram()

    def _path(self, key: OffloadKey) -> str:
        return object_block_path(self.fingerprint, key)

    def _key_of(self, path: str) -> OffloadKey | None:
        name = path.rpartition("/")[2]
        if not name.endswith(_SUFFIX):
            return None
        try:
            return OffloadKey(bytes.fromhex(name[: -len(_SUFFIX)]))
        except ValueError:
            return None

    def _failed(self, op: str, exc: BaseException) -> TierError:
        self._stats.errors += 1
        first_line = (str(exc) or type(exc).__name__).splitlines()[0]  # obstore adds a debug dump
        return TierError(f"object {op} at {self.url} failed: {first_line}")

    # -- listing -----------------------------------------------------------------------------

    async def _list(self) -> None:
        """Rebuild the index from a listing of the fingerprint's prefix."""
        import obstore

        self._index.begin_listing()
        listed: list[tuple[OffloadKey, int, float]] = []
        start = time.perf_counter()
        try:
            async for chunk in obstore.list(self._store, prefix=f"{self.fingerprint}/"):
                for meta in chunk:
                    key = self._key_of(meta["path"])
                    if key is not None:
                        listed.append((key, int(meta["size"]), meta["last_modified"].timestamp()))
        except Exception as exc:  # obstore's errors, OSError from a local store
            raise self._failed("list", exc) from exc
        self._hist["list"].observe(time.perf_counter() - start)
        self._index.apply_listing(listed)
        self._listed_at = time.monotonic()
        await self._evict_over_budget(0)

    async def _refresh(self) -> None:
        try:
            await self._list()
        except TierError as exc:
            logger.debug("object tier listing failed: %s", exc)

    def _maybe_refresh(self) -> None:
        """Start a listing in the background once the last one is ``refresh_s`` old."""
        listed = self._listed_at
        if self._refresher is not None and not self._refresher.done():
            return
        if listed is not None and time.monotonic() - listed < self.refresh_s:
            return
        self._listed_at = time.monotonic()  # a failed listing is retried a period later
        self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    # -- contract ----------------------------------------------------------------------------

    async def open(self) -> None:
        self._listed_at = time.monotonic()
        await self._list()

    async def _bounded(
        self, gate: asyncio.Semaphore | None, calls: Sequence[Callable[[], Awaitable[_T]]]
    ) -> list[_T | BaseException]:
        """Run ``calls`` concurrently, at most the gate's count at once (None: the calls take
        the gate themselves); each one's result or exception, in order."""

        async def one(call: Callable[[], Awaitable[_T]]) -> _T:
            if gate is None:
                return await call()
            async with gate:
                return await call()

        if len(calls) == 1:  # the common case: no task to create
            try:
                return [await one(calls[0])]
            except Exception as exc:
                return [exc]
        return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)

    def _raise_first(self, op: str, results: Sequence[object]) -> None:
        for result in results:
            if isinstance(result, TierError):
                raise result
            if isinstance(result, BaseException):
                raise self._failed(op, result) from result

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._maybe_refresh()
        index = self._index
        unknown = index.unknown(dict.fromkeys(keys))[: self.concurrency]
        if unknown:
            import obstore

            store = self._store

            async def head(key: OffloadKey) -> None:
                try:
                    meta = await obstore.head_async(store, self._path(key))
                except FileNotFoundError:
                    index.forget(key)
                    return
                index.add(key, int(meta["size"]))

            start = time.perf_counter()
            results = await self._bounded(self._reads, [partial(head, k) for k in unknown])
            self._raise_first("contains", results)
            self._hist["contains"].observe(time.perf_counter() - start)
        return [key in index for key in keys]

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        # Held keys, and keys not known absent (a GET answers for them as a HEAD would).
        unique = list(dict.fromkeys(keys))
        wanted = [k for k in unique if k in self._index] + self._index.unknown(unique)
        if not wanted:
            return [None] * len(keys)
        start = time.perf_counter()
        results = await self._bounded(None, [partial(self._get_one, k) for k in wanted])
        self._raise_first("get", results)
        self._hist["get"].observe(time.perf_counter() - start)
        by_key = {
            k: r
            for k, r in zip(wanted, results, strict=True)
            if r is not None and not isinstance(r, BaseException)
        }
        return [by_key.get(k) for k in keys]

    async def _get_one(self, key: OffloadKey) -> bytes | None:
        import obstore

        path = self._path(key)
        try:
            async with self._reads:  # the requests are bounded; checks overlap them
                body = await (await obstore.get_async(self._store, path)).bytes_async()
        except FileNotFoundError:
            self._index.forget(key)
            return None
        payload = await anyio.to_thread.run_sync(_unframed, key, body)
        if payload is None:
            self._stats.corrupt_blocks += 1
            self._index.forget(key)
            # Still a miss if this fails; it will be found corrupt again and deleted then.
            with contextlib.suppress(Exception):
                await obstore.delete_async(self._store, path)
            return None
        if key in self._index:
            self._index.touch(key)
        else:
            self._index.add(key, len(body))
        self._stats.get_blocks += 1
        self._stats.get_bytes += len(payload)
        return payload

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        fresh: dict[OffloadKey, bytes] = {}
        for key, payload in items:
            if key in self._index:
                self._index.touch(key)
            else:
                fresh.setdefault(key, payload)
        if not fresh:
            return
        incoming = sum(len(p) + frame.HEADER_PREFIX + len(k) for k, p in fresh.items())
        await self._evict_over_budget(incoming)
        start = time.perf_counter()
        calls = [partial(self._put_one, k, p) for k, p in fresh.items()]
        results = await self._bounded(self._writes, calls)
        self._raise_first("put", results)
        self._hist["put"].observe(time.perf_counter() - start)

    async def _put_one(self, key: OffloadKey, payload: bytes) -> None:
        import obstore

        body = await anyio.to_thread.run_sync(_framed, key, payload)
        await obstore.put_async(self._store, self._path(key), body, use_multipart=False)
        self._index.add(key, len(body))
        self._stats.put_blocks += 1
        self._stats.put_bytes += len(payload)

    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        import obstore

        for key in keys:
            self._index.forget(key)
        start = time.perf_counter()
        try:
            await obstore.delete_async(self._store, [self._path(k) for k in dict.fromkeys(keys)])
        except Exception as exc:
            raise self._failed("delete", exc) from exc
        self._hist["delete"].observe(time.perf_counter() - start)
        self._stats.deleted_blocks += len(keys)

    # -- eviction ----------------------------------------------------------------------------

    def take_evicted(self) -> list[OffloadKey]:
        evicted, self._evicted = self._evicted, []
        return evicted

    async def _evict_over_budget(self, incoming: int) -> None:
        """Delete the oldest objects until ``incoming`` more bytes fit ``capacity_bytes``."""
        if self.capacity_bytes is None:
            return
        victims = self._index.oldest_over(self.capacity_bytes, incoming)
        if not victims:
            return
        import obstore

        self._stats.evicted_blocks += len(victims)
        self._evicted.extend(victims)
        try:
            await obstore.delete_async(self._store, [self._path(k) for k in victims])
        except Exception as exc:  # left behind: the next listing finds them, evicted again
            logger.debug("object tier eviction failed: %r", exc)

    def stats(self) -> TierStats:
        return TierStats(
            **{
                **self._stats.__dict__,
                "blocks": len(self._index),
                "bytes": self._index.used_bytes,
                "op_seconds": {op: h.copy() for op, h in self._hist.items()},
            }
        )

    async def aclose(self) -> None:
        task, self._refresher = self._refresher, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
