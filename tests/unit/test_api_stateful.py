"""Random sequences of HTTP calls agree with a model of block states; nothing stays pinned.

A hypothesis state machine drives lookup, store and load leases through the HTTP API (a
real engine behind a sync ``TestClient``) and checks every answer against a model: which keys
are ready, which are being written, which are pinned for reading, and what was evicted.
"""

from __future__ import annotations

import warnings
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette asks for httpx2 here; httpx works
    from starlette.testclient import TestClient

from kvcache_offload_service import create_app
from tests.unit._api_app import hex_key, small_config

KEYS = [hex_key(i) for i in range(10)]
CAPACITY = 4

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)


class HttpBlockStates(RuleBasedStateMachine):
    store_leases = Bundle("store_leases")
    load_leases = Bundle("load_leases")

    def __init__(self) -> None:
        super().__init__()
        config = small_config(cpu_bytes_to_use=CAPACITY * 4096, lease_ttl_s=3600)
        self.client = TestClient(create_app(config))
        self.client.__enter__()
        self.ready: set[str] = set()
        self.writing: dict[str, list[str]] = {}
        self.reading: dict[str, list[str]] = {}

    def teardown(self) -> None:
        try:
            for lease_id in list(self.writing):
                self._post("/v1/store/complete", {"lease_id": lease_id})
            for lease_id in list(self.reading):
                self._post("/v1/load/complete", {"lease_id": lease_id})
            stats = self.client.get("/v1/stats").json()
            assert stats["blocks_writing"] == 0 and stats["blocks_reading"] == 0
            assert stats["leases_active"] == 0
        finally:
            self.client.__exit__(None, None, None)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(path, json=body)

    def _being_written(self) -> set[str]:
        return {k for keys in self.writing.values() for k in keys}

    def _being_read(self) -> set[str]:
        return {k for keys in self.reading.values() for k in keys}

    @rule(target=store_leases, keys=key_lists)
    def prepare_store(self, keys: list[str]) -> str:
        before = self._states(KEYS)
        r = self._post("/v1/store/prepare", {"keys": keys})
        if r.status_code == 507:
            assert self._states(KEYS) == before  # a refused store changes nothing
            return "refused"
        assert r.status_code == 200, r.text
        out = r.json()
        written = self._being_written()
        assert out["keys_to_store"] == [k for k in keys if k not in self.ready | written]
        if out["evicted_keys"]:
            event("evicted")
        for key in out["evicted_keys"]:
            assert key in self.ready and key not in self._being_read(), key
        self.ready -= set(out["evicted_keys"])
        self.writing[out["lease_id"]] = out["keys_to_store"]
        return str(out["lease_id"])

    @rule(lease_id=consumes(store_leases), success=st.booleans())
    def complete_store(self, lease_id: str, success: bool) -> None:
        r = self._post("/v1/store/complete", {"lease_id": lease_id, "success": success})
        if lease_id not in self.writing:
            assert r.status_code == 404
            return
        assert r.status_code == 200, r.text
        keys = self.writing.pop(lease_id)
        assert r.json()["keys"] == (keys if success else [])
        if success:
            self.ready |= set(keys)

    @precondition(lambda self: bool(self.ready))
    @rule(target=load_leases, data=st.data())
    def prepare_load(self, data: st.DataObject) -> str:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, unique=True))
        r = self._post("/v1/load/prepare", {"keys": keys})
        assert r.status_code == 200, r.text
        self.reading[r.json()["lease_id"]] = keys
        return str(r.json()["lease_id"])

    @rule(keys=key_lists)
    def load_of_a_block_not_ready_is_refused(self, keys: list[str]) -> None:
        if all(k in self.ready for k in keys):
            return
        before = self._states(KEYS)
        r = self._post("/v1/load/prepare", {"keys": keys})
        assert r.status_code == 409, r.text
        assert self._states(KEYS) == before

    @rule(lease_id=consumes(load_leases))
    def complete_load(self, lease_id: str) -> None:
        r = self._post("/v1/load/complete", {"lease_id": lease_id})
        assert r.status_code == 200, r.text
        del self.reading[lease_id]

    def _states(self, keys: list[str]) -> list[str]:
        r = self._post("/v1/lookup", {"keys": keys})
        assert r.status_code == 200, r.text
        return list(r.json()["states"])

    @invariant()
    def lookup_matches_the_model(self) -> None:
        written = self._being_written()
        expected = [
            "ready" if k in self.ready else "writing" if k in written else "absent" for k in KEYS
        ]
        assert self._states(KEYS) == expected


HttpBlockStates.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestHttpBlockStates = HttpBlockStates.TestCase
