"""Stand-in for vLLM's compiled ops (not carried to the device; the offload tests need none)."""
