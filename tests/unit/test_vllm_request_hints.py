"""The vLLM plug-in's per-request helpers, without vLLM: the session-end hint read from
``kv_transfer_params`` and the keys a request used, touched at its end (vLLM 0.33+)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcache_offload.integrations.vllm import _request_keys as request_keys
from kvcache_offload.integrations.vllm._hints import SESSION_END, session_ends
from tests.unit._keys import key


@dataclass
class Context:
    """vLLM 0.33's ``ReqContext`` as far as the plug-in reads it."""

    req_id: str = "r"
    kv_transfer_params: dict[str, Any] | None = None
    positions: dict[Any, int] = field(default_factory=dict)
    _state: dict[type, Any] = field(default_factory=dict)

    def get_state(self, kind: type) -> Any:
        return self._state.get(kind)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_offload_key_position(self, k: Any) -> int | None:
        return self.positions.get(k)


@pytest.mark.parametrize(
    ("params", "ends"),
    [(None, False), ({}, False), ({"do_remote_decode": True}, False),
     ({SESSION_END: True}, True), ({SESSION_END: False}, False)],
)  # fmt: skip
def test_only_a_true_session_end_counts(params: dict[str, Any] | None, ends: bool) -> None:
    assert session_ends(Context(kv_transfer_params=params)) is ends


def test_a_malformed_hint_is_ignored_with_one_warning_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = Context(req_id="bad-1", kv_transfer_params={SESSION_END: "yes"})
    with caplog.at_level(logging.WARNING):
        assert session_ends(context) is False
        assert session_ends(context) is False
    (record,) = [r for r in caplog.records if "bad-1" in r.getMessage()]
    assert SESSION_END in record.getMessage() and "'yes'" in record.getMessage()


def test_a_context_without_params_or_scratch_space_is_fine() -> None:
    assert session_ends(object()) is False
    request_keys.record(object(), [key(1)])  # nothing to record in: no error
    assert request_keys.finish(object()) == []


def test_the_keys_come_back_once_in_prompt_order_each_once() -> None:
    context = Context(positions={key(1): 16, key(2): 32, key(3): 48})
    request_keys.record(context, [key(2), key(3)])  # loaded later blocks first
    request_keys.record(context, [key(1), key(2)])
    assert request_keys.finish(context) == [key(1), key(2), key(3)]
    assert request_keys.finish(context) == []  # a second end answers nothing
    request_keys.record(context, [key(4)])  # after the end: not recorded
    assert request_keys.finish(context) == []


def test_without_every_position_the_order_is_first_use() -> None:
    context = Context(positions={key(1): 16})
    request_keys.record(context, [key(3), key(1)])
    assert request_keys.finish(context) == [key(3), key(1)]
