"""The two implementations of alru's weight miniatures, for tests that run against both."""

from __future__ import annotations

import pytest

from kvcache_offload.control.policies import _mini_sim

__all__ = ["DUEL_KINDS", "needs_native_duel"]

needs_native_duel = pytest.mark.skipif(
    _mini_sim._NativeDuel is None, reason="_native_duel is not built"
)
"""Built wherever the compiled build is (test_compiled.py checks that in CI)."""

DUEL_KINDS = [
    pytest.param(False, id="python"),
    pytest.param(True, id="native", marks=needs_native_duel),
]
"""``native`` values of :class:`WeightDuel`: the compiled Python copies and the C ones."""
