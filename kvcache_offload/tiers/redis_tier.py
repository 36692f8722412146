"""RedisTier: blocks in a Redis or Valkey server (standalone or Cluster) shared by many hosts.

Each block is two string keys that share one hash tag, so one cluster slot:
``kvo:v2:<fingerprint>:{<key hex>}`` holds the block's bytes and the same name plus ``:h`` the
frame header (key, length, checksum). One ``MSET`` writes both, so a reader never sees half a
block, and the server keeps the 2 MiB argument it received as the value; a hash field (the
``HSET`` of format 1, keys ``kvo:<fingerprint>:...``) made it copy every value: a fifth more
server CPU per PUT. A reader fetches both keys with one ``MGET``; a header without bytes or
bytes without a header (Redis evicted one of them) is a miss and both are deleted, as is a value
that fails its checks. The ``v2`` in the prefix keeps format-1 and format-2 instances from ever
reading each other's values.

A put on a standalone server streams its batch down one pooled connection, block after block:
each ``MSET`` is written up to the end of the block's bytes, and its last argument, the header,
follows once the block's checksum is known. The server runs a command only once all of it has
arrived (a connection lost halfway writes nothing), so the bytes can leave before their checksum
exists, and hashing a batch does not hold back its first byte. A pipeline must hash its whole
batch first, and nothing is on the wire meanwhile: that held PUT to 0.67x of a bare pipeline of
``SET`` on a quiet host. Where the process has a core to spare (four usable CPUs, as for the
disk tier's check thread) a hash thread of the tier checksums block *i* while the loop sends it;
elsewhere the loop hashes each block itself just after sending it (~0.1-0.3 ms per 2 MiB, no
longer than the socket writes the loop does anyway), which cost less CPU than handing it over on
two busy vCPUs. The put yields to the loop between blocks, so other tasks wait at most one
block's send and hash (loop gaps while PUTs ran: p99.9 ~1.4 ms either way, as with a bare
pipeline, whose writes of a whole batch are the longer steps). On a cluster a batch spans nodes,
so a put hashes the batch in a worker thread and sends one pipeline of ``MSET`` (the client
routes each to its slot's node).

Every batch read is one round trip on a standalone server, one per node holding a slot of the
batch on a cluster (a pipeline). A lookup on a standalone
server is one ``EVAL`` of a script that answers ``EXISTS`` per key: the same answer and round
trip as a pipeline of ``EXISTS``, but one command to pack and one reply to parse instead of one
per key (the client's per-command and per-reply costs, not the server's, dominated a 64-key
lookup); its answer is one string of ``0`` and ``1``, not an array of 64 replies. A server
that refuses the script (ACLs, scripting disabled, busy) is asked with the pipeline instead,
and the script is tried again a minute later. Capacity and eviction are Redis's: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru``; a key Redis evicted is simply a miss.

URLs: ``redis://`` / ``rediss://`` (TLS) / ``unix://`` for a standalone server (``/DB``
selects the database), ``redis+cluster://`` / ``rediss+cluster://`` for a cluster (any node as
the seed). Connection errors and timeouts raise :class:`~kvcache_offload.errors.TierError`;
the client itself does not retry (the tier set backs off and tries again later), so a dead
server costs one connect timeout, not a retry storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from binascii import hexlify
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import ConfigError, TierError
from kvcache_offload.tiers import frame
from kvcache_offload.tiers._cpus import SPARE_CORE_CPUS, usable_cpus
from kvcache_offload.tiers.base import LatencyHistogram, SecondaryTier, TierStats

__all__ = ["EXISTS_EACH_SCRIPT", "RedisTier", "redis_block_names", "redis_key_prefix"]

logger = logging.getLogger(__name__)

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_FORMAT = 2
"""The value format, named in every key: instances of different formats never share a key."""
_HEADER_SUFFIX = b":h"
EXISTS_EACH_SCRIPT = (
    "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end "
    "return table.concat(r)"
)
"""``EXISTS`` of every key, one answer per key (a multi-key ``EXISTS`` only counts them), as
one string of ``0`` and ``1``: one reply to parse, where an array would be one per key."""
_ONE = ord("1")
_SCRIPT_RETRY_S = 60.0


def redis_key_prefix(fingerprint: str) -> bytes:
    """Every key of one layout and value format starts with this (``kvo:v2:<fingerprint>:``)."""
    return f"kvo:v{_FORMAT}:{fingerprint}:".encode()


def redis_block_names(fingerprint: str, key: OffloadKey) -> tuple[bytes, bytes]:
    """The names of a block's bytes and of its header: one hash tag, so one cluster slot."""
    data = redis_key_prefix(fingerprint) + b"{" + hexlify(key) + b"}"
    return data, data + _HEADER_SUFFIX


def _mset_head(name: bytes, size: int) -> bytes:
    """RESP of ``MSET <name> <value>`` up to the value's bytes, which follow as they are."""
    return b"*5\r\n$4\r\nMSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, size)


def _mset_tail(name: bytes, header: bytes) -> bytes:
    """RESP from the end of the value to the end of the ``MSET``: the header key and value."""
    hname = name + _HEADER_SUFFIX
    return b"\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(hname), hname, len(header), header)


def _encode_headers(items: Sequence[tuple[OffloadKey, bytes]]) -> list[bytes]:
    return [frame.encode_header(key, data) for key, data in items]


class RedisTier(SecondaryTier):
    """Blocks in Redis/Valkey; see the module docstring."""

    socket_timeout_s: float = 2.0
    """Longest wait for a reply (the tier set's read deadline is shorter for lookups)."""
    connect_timeout_s: float = 0.5
    """A dead server costs this much per retry after its back-off, not a TCP timeout."""

    def __init__(self, url: str, fingerprint: str, *, hash_thread: bool | None = None) -> None:
        """``hash_thread``: a standalone put checksums each block on a thread of the tier while
        the loop sends it, rather than on the loop just after sending it. Default: where the
        process may run on four CPUs or more."""
        scheme, sep, rest = url.partition("://")
        if not sep or (scheme not in _PLAIN_SCHEMES and scheme not in _CLUSTER_SCHEMES):
            raise ConfigError(
                f"remote_url must start with redis://, rediss://, unix://, redis+cluster:// or "
                f"rediss+cluster://, got {url!r}"
            )
        self.name = "redis"
        self.cluster = scheme in _CLUSTER_SCHEMES
        self._url = f"{_CLUSTER_SCHEMES.get(scheme, scheme)}://{rest}"
        self._prefix = redis_key_prefix(fingerprint)
        self._client: Any = None
        self._script_after = float("inf") if self.cluster else 0.0
        """Look up with one script from this monotonic time on (never on a cluster: a batch's
        keys span slots, which one script cannot)."""
        self.hash_thread = usable_cpus() >= SPARE_CORE_CPUS if hash_thread is None else hash_thread
        self._hasher: ThreadPoolExecutor | None = None
        """The hash thread: one, so a put's checksums come in the order its blocks are sent."""
        self._stats = TierStats(self.name, "redis-cluster" if self.cluster else "redis")
        self._hist = {op: LatencyHistogram() for op in ("contains", "get", "put", "delete")}

    @property
    def url(self) -> str:
        """The server URL without credentials (for logs and ``/v1/stats``)."""
        scheme, _, rest = self._url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"

    def _redis_key(self, key: OffloadKey) -> bytes:
        """The name of the block's bytes; its header's is this plus ``:h``."""
        return self._prefix + b"{" + hexlify(key) + b"}"

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        common: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        try:
            if self.cluster:
                from redis.asyncio.cluster import RedisCluster

                self._client = RedisCluster.from_url(self._url, **common)
            else:
                from redis.asyncio import Redis

                self._client = Redis.from_url(self._url, **common)
        except ValueError as exc:
            raise ConfigError(f"bad remote_url {self.url!r}: {exc}") from exc
        return self._client

    async def _pipeline(self, op: str, queue: Any, timed: bool = True) -> list[Any]:
        """Run one pipeline built by ``queue(pipe)``; any client failure is a TierError."""
        from redis.exceptions import RedisClusterException, RedisError

        start = time.perf_counter()
        try:
            pipe = self._connect().pipeline(transaction=False)
            queue(pipe)
            results: list[Any] = await pipe.execute()
        except (RedisError, RedisClusterException, OSError) as exc:
            # The client is kept, on a cluster too: it refreshes its slot map itself and puts
            # a node that failed last among its seeds. A new client would start from the
            # URL's node and the first primary of the slot map, and stay down while either is.
            self._stats.errors += 1
            raise TierError(f"redis {op} at {self.url} failed: {exc!r}") from exc
        if timed:
            self._hist[op].observe(time.perf_counter() - start)
        return results

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        with contextlib.suppress(Exception):  # the connection is already broken
            await client.aclose()

    # -- contract ----------------------------------------------------------------------------

    async def _script_contains(self, names: list[bytes]) -> list[bool] | None:
        """``contains`` in one script call, or None when the server refused the script."""
        from redis.exceptions import RedisError, ResponseError

        start = time.perf_counter()
        try:
            found = await self._connect().execute_command(
                "EVAL", EXISTS_EACH_SCRIPT, len(names), *names
            )
        except ResponseError as exc:  # the server answered, but did not run the script
            self._script_after = time.monotonic() + _SCRIPT_RETRY_S
            logger.info("redis at %s refused the lookup script (%s); pipelining", self.url, exc)
            return None
        except (RedisError, OSError) as exc:
            self._stats.errors += 1
            raise TierError(f"redis contains at {self.url} failed: {exc!r}") from exc
        self._hist["contains"].observe(time.perf_counter() - start)
        return [answer == _ONE for answer in found]

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        if not keys:
            return []
        names = [self._redis_key(k) for k in keys]
        if time.monotonic() >= self._script_after:
            found = await self._script_contains(names)
            if found is not None:
                return found

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)

        return [bool(n) for n in await self._pipeline("contains", queue)]

    async def get(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self._redis_key(k) for k in keys]

        def queue(pipe: Any) -> None:
            for name in names:  # commands by name: a cluster client splits mget() by slot
                pipe.execute_command("MGET", name, name + _HEADER_SUFFIX)

        replies = await self._pipeline("get", queue)
        frames = [(reply[1], reply[0]) for reply in replies]

        def check() -> list[bool]:
            return [frame.verify(k, h, d) for k, (h, d) in zip(keys, frames, strict=True)]

        ok = await anyio.to_thread.run_sync(check)
        out: list[bytes | None] = []
        corrupt: list[bytes] = []
        for name, (header, data), good in zip(names, frames, ok, strict=True):
            if good and data is not None:
                out.append(data)
                self._stats.get_blocks += 1
                self._stats.get_bytes += len(data)
            else:
                out.append(None)
                if header is not None or data is not None:
                    corrupt.append(name)
        if corrupt:
            self._stats.corrupt_blocks += len(corrupt)

            def queue_delete(pipe: Any) -> None:
                for name in corrupt:
                    pipe.execute_command("DEL", name, name + _HEADER_SUFFIX)

            # Still a miss if this fails; it will be found corrupt again and deleted then.
            with contextlib.suppress(TierError):
                await self._pipeline("delete", queue_delete)
        return out

    async def put(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        if not items:
            return
        start = time.perf_counter()
        if self.cluster:
            await self._put_pipelined(items)
        else:
            await self._put_streamed(items)
        self._hist["put"].observe(time.perf_counter() - start)
        self._stats.put_blocks += len(items)
        self._stats.put_bytes += sum(len(data) for _, data in items)

    async def _put_streamed(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        """Each block's ``MSET`` down one connection, its header sent once its checksum is
        known (see the module docstring); a failure anywhere is one TierError. Only the
        connection's public calls are used (``get_connection()`` without arguments: redis-py
        5.3 on)."""
        from redis.exceptions import RedisError, ResponseError

        digests = self._start_checksums(items)
        pool = self._connect().connection_pool
        conn: Any = None
        in_sync = False
        try:
            conn = await pool.get_connection()
            tail = b""
            for i, (key, data) in enumerate(items):
                name = self._redis_key(key)
                await conn.send_packed_command([tail + _mset_head(name, len(data)), data])
                if digests is not None and not digests[i].done():
                    digest = await asyncio.wrap_future(digests[i])
                else:  # on the loop, or the hash thread is ahead: no wake-up to wait for
                    digest = frame.checksum(data) if digests is None else digests[i].result()
                    # Yield between blocks: a socket that takes every block whole never would.
                    await asyncio.sleep(0)
                tail = _mset_tail(name, frame.encode_header(key, data, digest))
            await conn.send_packed_command(tail)
            refused: ResponseError | None = None
            for _ in items:  # every reply is read, so the connection stays in step
                try:
                    await conn.read_response()
                except ResponseError as exc:  # e.g. OOM: that block was not written
                    refused = refused or exc
            in_sync = True
            if refused is not None:
                raise refused
        except (RedisError, OSError) as exc:
            self._stats.errors += 1
            raise TierError(f"redis put at {self.url} failed: {exc!r}") from exc
        finally:
            for pending in digests or ():
                pending.cancel()
            if conn is not None:
                with anyio.CancelScope(shield=True):
                    if not in_sync:  # a command may be half sent, or replies unread
                        with contextlib.suppress(Exception):  # the socket is dropped anyway
                            await conn.disconnect(nowait=True)
                    await pool.release(conn)

    def _start_checksums(
        self, items: Sequence[tuple[OffloadKey, bytes]]
    ) -> list[Future[int]] | None:
        """The batch's checksums, in order, on the hash thread; None where the loop hashes."""
        if not self.hash_thread:
            return None
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvo-redis-hash")
        return [self._hasher.submit(frame.checksum, data) for _, data in items]

    async def _put_pipelined(self, items: Sequence[tuple[OffloadKey, bytes]]) -> None:
        """The batch hashed in one worker-thread hop, then one pipeline of ``MSET``."""
        headers = await anyio.to_thread.run_sync(_encode_headers, items)

        def queue(pipe: Any) -> None:
            for (key, data), header in zip(items, headers, strict=True):
                name = self._redis_key(key)
                pipe.execute_command("MSET", name, data, name + _HEADER_SUFFIX, header)

        await self._pipeline("put", queue, timed=False)

    async def delete(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        names = [self._redis_key(k) for k in keys]

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.execute_command("DEL", name, name + _HEADER_SUFFIX)

        await self._pipeline("delete", queue)
        self._stats.deleted_blocks += len(keys)

    def stats(self) -> TierStats:
        return TierStats(
            **{**self._stats.__dict__, "op_seconds": {o: h.copy() for o, h in self._hist.items()}}
        )

    async def aclose(self) -> None:
        hasher, self._hasher = self._hasher, None
        if hasher is not None:
            hasher.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            await self._drop_client()
