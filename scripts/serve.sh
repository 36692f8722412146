#!/usr/bin/env bash
# Set up (if needed) and run the service with embedded defaults (no GPU, no other server).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/kvcache-offload serve "$@"
