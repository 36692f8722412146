"""usable_cpus: how many CPUs this process may run on, for tiers that hand work to a second core.

Why: a tier that overlaps checksums with I/O on another thread gains only where a core is idle
for it; on two busy vCPUs the extra thread's hand-offs cost more than they hide. The disk
tier's check thread and the Redis tier's overlapped put hashes are on from four CPUs.
"""

from __future__ import annotations

import os

__all__ = ["SPARE_CORE_CPUS", "usable_cpus"]

SPARE_CORE_CPUS = 4
"""From this many usable CPUs on, a tier assumes a core is free for its second thread."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
