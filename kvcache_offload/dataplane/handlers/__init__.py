"""Handlers: the CUDA pair, the CPU backend, and the router that picks one per job."""
