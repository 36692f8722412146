"""One file per run: how a shared region's files are named and found.

A region called ``name`` lives in ``<shm_dir>/kvcache_offload_<name>@<run>.mmap``, where
``<run>`` is new each time a creator makes the file. Workers still meet by ``name`` (they
open the newest file of that name), but a path handed out by one run (``/v1/region``) never
names the next run's file: a sidecar client that outlives a service restart and opens its
old path again finds no file, instead of writing into slots the new run gave to other keys.
``@`` cannot appear in a name, so one name's files never match another's. Files named
``kvcache_offload_<name>.mmap`` (before runs had ids) are only ever removed as stale.
"""

from __future__ import annotations

import os
import uuid

__all__ = ["new_run_file", "run_files", "stable_stem", "stale_files"]

_PREFIX = "kvcache_offload_"
_RUN_SEPARATOR = "@"
_SUFFIX = ".mmap"


def stable_stem(shm_dir: str, name: str) -> str:
    """``<shm_dir>/kvcache_offload_<name>`` with ``shm_dir`` resolved: the same for every run
    and every process that names the region (the handshake's socket names derive from it)."""
    return os.path.join(os.path.realpath(shm_dir), f"{_PREFIX}{name}")


def new_run_file(shm_dir: str, name: str) -> str:
    """The path of a file for a new run of ``name``."""
    run = uuid.uuid4().hex[:16]
    return os.path.join(shm_dir, f"{_PREFIX}{name}{_RUN_SEPARATOR}{run}{_SUFFIX}")


def run_files(shm_dir: str, name: str) -> list[str]:
    """The run files of ``name`` in ``shm_dir``, newest first (normally one)."""
    head = f"{_PREFIX}{name}{_RUN_SEPARATOR}"
    found: list[tuple[int, str]] = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith(head) and entry.name.endswith(_SUFFIX):
            try:
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
            except FileNotFoundError:
                continue  # unlinked while we looked
    return [path for _, path in sorted(found, reverse=True)]


def stale_files(shm_dir: str, name: str) -> list[str]:
    """Every file of ``name``, the pre-run-id name included: what a new creator removes."""
    legacy = os.path.join(shm_dir, f"{_PREFIX}{name}{_SUFFIX}")
    return run_files(shm_dir, name) + ([legacy] if os.path.lexists(legacy) else [])
