"""vLLM's ``kv_offload/base.py`` names, re-exported from :mod:`kvcache_offload.contracts`.

Engineers coming from vLLM look for ``base``; the definitions live in one module per
concept under ``contracts/``.
"""

from kvcache_offload.contracts import *  # noqa: F403
from kvcache_offload.contracts import __all__ as __all__
from kvcache_offload.contracts.offload_key import validate_offload_key  # noqa: F401
