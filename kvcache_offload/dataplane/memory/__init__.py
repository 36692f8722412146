"""CPU memory behind the CPU tier: the pinned buffer, the shared region, block access."""
