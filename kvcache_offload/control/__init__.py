"""The control plane: manager, reuse filter, eviction policies, spec factory.

Plain synchronous Python, no torch (a test enforces it), called only from the event loop.
"""
