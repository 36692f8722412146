"""Reading the observability side port as a user would: scrape, stream events, free port.

No vLLM import here: the unit test of the side port (tests/unit) uses it too.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    response.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def read_events(url: str, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The first ``count`` events of this run (replayed from the start), as parsed JSON."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s  # heartbeats keep the stream alive: bound it
    timeout = httpx.Timeout(timeout_s)
    with httpx.stream("GET", f"{url}/v1/events?last_event_id=0", timeout=timeout) as response:
        response.raise_for_status()
        kind = ""
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} events not seen in {timeout_s} s: {events}")
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: ") and kind != "gap":
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == count:
                    break
    return events


def port_is_free(host: str, port: int) -> bool:
    try:
        with socket.create_server((host, port)):
            return True
    except OSError:
        return False
