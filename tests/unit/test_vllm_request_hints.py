"""The vLLM plug-in's per-request helpers, without vLLM: the session-end hint read from
``kv_transfer_params`` and the touches replayed from the keys a request used (vLLM 0.33+)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcache_offload.integrations.vllm import _request_keys as request_keys
from kvcache_offload.integrations.vllm._hints import SESSION_END, SESSION_END_ACTION, session_ends
from tests.unit._keys import key


@dataclass
class Context:
    """vLLM 0.33's ``ReqContext`` as far as the plug-in reads it."""

    req_id: str = "r"
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict)

    def get_state(self, kind: type) -> Any:
        return self._state.get(kind)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value


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
    touched: list[list[Any]] = []
    request_keys.loaded(object(), [key(1)])  # nothing to record in: no error
    assert request_keys.storing(object(), [key(2)], lambda k, c: touched.append(k), lambda: 7) == 7
    request_keys.finished(object(), lambda k, c: touched.append(k))
    assert touched == []


@dataclass
class Stored:
    keys_to_store: list[Any]


def test_touches_come_as_vllm_021s_scheduler_makes_them() -> None:
    context = Context()
    touched: list[list[Any]] = []

    def touch(keys: list[Any], _context: Any) -> None:
        touched.append(list(keys))

    request_keys.loaded(context, [key(1), key(2)])
    assert touched == []  # the first touch waits for the whole request (its first store)
    out = request_keys.storing(context, [key(2), key(3)], touch, lambda: Stored([key(3)]))
    assert out == Stored([key(3)])
    # first touch (all keys so far, before the store), then the one after the store
    assert touched == [[key(1), key(2), key(3)]] * 2
    request_keys.storing(context, [key(4)], touch, lambda: None)  # refused: no touch after
    request_keys.storing(context, [key(5)], touch, lambda: Stored([key(5)]))
    assert touched[2:] == [[key(1), key(2), key(3), key(4), key(5)]]
    request_keys.finished(context, touch)  # touched already: nothing more
    assert len(touched) == 3
    request_keys.loaded(context, [key(6)])  # after the end: not recorded
    assert request_keys.of(context) is None


def test_a_request_that_only_loaded_is_touched_once_at_its_end() -> None:
    context = Context()
    touched: list[list[Any]] = []
    request_keys.loaded(context, [key(1), key(2)])
    request_keys.finished(context, lambda k, c: touched.append(list(k)))
    request_keys.finished(context, lambda k, c: touched.append(list(k)))  # once
    assert touched == [[key(1), key(2)]]


@dataclass
class Action:
    action_type: str
    action_version: str
    action_id: str = "a1"
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class Envelope:
    actions: list[Action]
    protocol_version: str = "1"
    message_id: str = "m1"


@dataclass
class HintedContext(Context):
    kv_hints: Envelope | None = None


def test_the_hint_also_comes_as_a_kv_hints_action(caplog: pytest.LogCaptureFixture) -> None:
    assert session_ends(HintedContext(kv_hints=Envelope([Action(SESSION_END_ACTION, "1")])))
    other = Envelope([Action("router.prefetch", "1")])
    assert not session_ends(HintedContext(kv_hints=other))
    assert not session_ends(HintedContext(kv_hints=Envelope([])))
    with caplog.at_level(logging.WARNING):
        unknown = Envelope([Action(SESSION_END_ACTION, "9")])
        assert not session_ends(HintedContext(req_id="v9", kv_hints=unknown))
    assert any("v9" in r.getMessage() and "'9'" in r.getMessage() for r in caplog.records)
