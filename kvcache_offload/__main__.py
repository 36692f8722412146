"""``python -m kvcache_offload`` runs the command line, like ``kvcache-offload``."""

from kvcache_offload.cli import main

main()
