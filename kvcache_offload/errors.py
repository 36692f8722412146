"""One exception hierarchy for the whole library, so callers can catch precisely.

Every error carries a message naming the offending value and what was expected; the HTTP
layer maps each class to a status code in one place (``api/errors.py``).
"""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "CapacityError",
    "ConfigError",
    "InvalidKeyError",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseLimitError",
    "NoSharedRegionError",
    "OffloadError",
    "RegionError",
    "TierError",
    "TransferError",
    "UnknownPolicyError",
    "UnknownSpecError",
]


class OffloadError(Exception):
    """Root of every error raised on purpose by kvcache-offload."""


class ConfigError(OffloadError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class UnknownPolicyError(ConfigError):
    """An eviction policy name is neither registered nor importable."""


class UnknownSpecError(ConfigError):
    """An offloading spec name is neither registered nor importable."""


class InvalidKeyError(OffloadError, ValueError):
    """An offload key is malformed (wrong type or too short to hold a group index)."""


class BlockStateError(OffloadError):
    """An operation does not fit the block's state (e.g. loading a block being written)."""


class CapacityError(OffloadError):
    """The CPU tier cannot hold what was asked for."""


class LeaseLimitError(CapacityError):
    """Too many leases are open (``max_open_leases``): complete some before preparing more."""


class TransferError(OffloadError):
    """A GPU<->CPU transfer failed or could not be submitted."""


class RegionError(OffloadError):
    """The shared /dev/shm region cannot be created, joined or sized."""


class NoSharedRegionError(RegionError):
    """A call needs the shared region (the sidecar flow) but the service runs without one."""


class LeaseError(OffloadError):
    """A lease id is unknown, already completed or expired."""


class LeaseExpiredError(LeaseError):
    """The lease expired before its completion and was rolled back (HTTP 410 Gone)."""


class TierError(OffloadError):
    """A secondary tier (disk, Redis/Valkey) could not answer; callers treat it as a miss."""
