"""The servers' ports never come from the range outgoing connections draw from."""

from __future__ import annotations

import socket

from tests._ports import _ephemeral_range, free_port


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
