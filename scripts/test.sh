#!/usr/bin/env bash
# Set up (if needed) and run every check: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy kvcache_offload api
.venv/bin/python -m pytest -q "$@"
