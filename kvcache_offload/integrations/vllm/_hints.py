"""A request's word that its session ends, carried in vLLM's ``kv_transfer_params``.

vLLM hands every manager call the request's context, and its OpenAI server copies a request's
``kv_transfer_params`` (a JSON object in the request body) into it. A client that knows its
conversation ends with this request (the user closed it, an agent's task is done) sends::

    {"messages": [...], "kv_transfer_params": {"kvcache_offload_session_end": true}}

and the plug-in *releases* the request's blocks as it touches and stores them: when room is
needed they are evicted first, before the policy chooses (``CPUOffloadingManager.release``).
A block another request uses again (any ``touch``) is unmarked, so a shared prefix survives a
wrong or early hint. The policy lab measured what this is worth (``bench.policy_hints``,
``docs/policy-lab.md``): no policy can tell a finished conversation from a paused one.

Soft on purpose: nothing is freed while vLLM may still load or store the request's blocks, so
the hint can come with any call, on every supported vLLM release, without per-request state.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["SESSION_END", "session_ends"]

logger = logging.getLogger(__name__)

SESSION_END = "kvcache_offload_session_end"
"""The ``kv_transfer_params`` key; its value must be JSON ``true`` (or ``false``)."""

_warned: set[str] = set()


def session_ends(req_context: Any) -> bool:
    """Whether the request of ``req_context`` said its session ends with it.

    A value other than a bool is logged (once per request) and ignored: vLLM's scheduler
    thread must not fail a request over a hint."""
    params = getattr(req_context, "kv_transfer_params", None)
    if not params:
        return False
    value = params.get(SESSION_END) if isinstance(params, dict) else None
    if value is None or isinstance(value, bool):
        return bool(value)
    req_id = str(getattr(req_context, "req_id", "?"))
    if req_id not in _warned:
        if len(_warned) > 1024:  # a bound, not a registry: warnings may repeat after it
            _warned.clear()
        _warned.add(req_id)
        logger.warning(
            "request %s: kv_transfer_params[%r] must be true or false, got %r; ignored",
            req_id,
            SESSION_END,
            value,
        )
    return False
