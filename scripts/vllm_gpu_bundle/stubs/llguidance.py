"""Stand-in for llguidance, which the device image lacks.

vLLM 0.21 evaluates ``llguidance.LLMatcher`` in a class annotation while importing its
structured-output backends (reached from ``VllmConfig`` through the connector factory). The
transfer tests never build a grammar, so any name resolves to an empty placeholder class.
"""


def __getattr__(name: str) -> type:
    return type(name, (), {})
