"""A request's word that its session ends, carried in vLLM's ``kv_transfer_params``.

vLLM hands every manager call the request's context, and its OpenAI server copies a request's
``kv_transfer_params`` (a JSON object in the request body) into it. A client that knows its
conversation ends with this request (the user closed it, an agent's task is done) sends::

    {"messages": [...], "kv_transfer_params": {"kvcache_offload_session_end": true}}

and the plug-in *releases* the request's blocks as it touches and stores them: when room is
needed they are evicted first, before the policy chooses (``CPUOffloadingManager.release``).
A block another request uses again (any ``touch``) is unmarked, so a shared prefix survives a
wrong or early hint. The policy lab measured what this is worth (``research.policy_hints``,
``docs/policy-lab.md``): no policy can tell a finished conversation from a paused one.

From vLLM 0.33 an orchestrator can also attach structured hints to a request
(``kv_hints``: a ``KvHintsEnvelope`` of ``KvHintAction`` s, passed through ``AsyncLLM``), whose
action types the component that implements them defines. This one is::

    KvHintAction(action_id=..., action_type="kvcache_offload.session_end",
                 action_version="1", payload={})

Soft on purpose: nothing is freed while vLLM may still load or store the request's blocks, so
the hint can come with any call, on every supported vLLM release, without per-request state.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["SESSION_END", "SESSION_END_ACTION", "session_ends"]

logger = logging.getLogger(__name__)

SESSION_END = "kvcache_offload_session_end"
"""The ``kv_transfer_params`` key; its value must be JSON ``true`` (or ``false``)."""

SESSION_END_ACTION = "kvcache_offload.session_end"
"""The ``KvHintAction.action_type`` of the same hint (vLLM 0.33's ``kv_hints``), version "1"."""
_ACTION_VERSIONS = ("1",)

_warned: set[str] = set()


def session_ends(req_context: Any) -> bool:
    """Whether the request of ``req_context`` said its session ends with it, in its
    ``kv_transfer_params`` or its ``kv_hints``.

    A malformed hint (a value other than a bool, an action version we do not know) is logged
    (once per request) and ignored: vLLM's scheduler thread must not fail a request over a
    hint."""
    return _in_params(req_context) or _in_actions(req_context)


def _in_params(req_context: Any) -> bool:
    params = getattr(req_context, "kv_transfer_params", None)
    if not params:
        return False
    value = params.get(SESSION_END) if isinstance(params, dict) else None
    if value is None or isinstance(value, bool):
        return bool(value)
    _warn(req_context, f"kv_transfer_params[{SESSION_END!r}] must be true or false, got {value!r}")
    return False


def _in_actions(req_context: Any) -> bool:
    envelope = getattr(req_context, "kv_hints", None)
    for action in getattr(envelope, "actions", None) or ():
        if getattr(action, "action_type", None) != SESSION_END_ACTION:
            continue
        version = getattr(action, "action_version", None)
        if version in _ACTION_VERSIONS:
            return True
        _warn(req_context, f"kv_hints action {SESSION_END_ACTION!r} version {version!r} is not "
              f"one of {list(_ACTION_VERSIONS)}")  # fmt: skip
    return False


def _warn(req_context: Any, what: str) -> None:
    req_id = str(getattr(req_context, "req_id", "?"))
    if req_id not in _warned:
        if len(_warned) > 1024:  # a bound, not a registry: warnings may repeat after it
            _warned.clear()
        _warned.add(req_id)
        logger.warning("request %s: %s; ignored", req_id, what)
