"""Adapters that plug this library into inference engines (vLLM: ``integrations.vllm``).

Each adapter lives in its own subpackage and imports its engine only when imported itself.
"""

__all__: list[str] = []
