"""The data plane: handlers that move bytes, copy paths, CPU memory, KV-cache layouts.

Torch lives here and below; nothing here decides what to keep.
"""
