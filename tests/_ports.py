"""Free loopback ports for the servers the tests start, chosen outside the ephemeral range.

A port the kernel hands out for ``bind(0)`` comes from the same range it uses for the local
end of outgoing connections. Between our probe and the server's own bind, any client
connection in the run (httpx, redis, ZMQ) may take it, and the server then fails with
"address already in use" (CI saw this once). Ports below the ephemeral range are never
handed to a connecting socket, so only another listener can take them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_PICK = random.SystemRandom()  # no test seeding of `random` makes two runs pick alike


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port no listener holds now and no outgoing connection will be given."""
    low, high = _ephemeral_range()
    below = low - _LOWEST >= 1000
    candidates = range(_LOWEST, low) if below else range(high + 1, 65536)
    for _ in range(200):
        port = _PICK.choice(candidates)
        if _bindable(port):
            return port
    with socket.socket() as sock:  # an exotic range: fall back to the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
