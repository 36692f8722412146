#!/usr/bin/env bash
# Set up (if needed) and run every check: lint, format, types, tests. The tests run against the
# compiled manager (what an install gives), then the manager's own tests run again against its
# pure-Python sources (the fallback where no C compiler is available).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy kvcache_offload api
if [ "${KVCACHE_OFFLOAD_COMPILE:-1}" != "0" ]; then
  export KVCACHE_OFFLOAD_EXPECT_COMPILED=1
fi
.venv/bin/python -m pytest -q "$@"
echo "pure-Python manager and policies:"
KVCACHE_OFFLOAD_PURE_PYTHON=1 KVCACHE_OFFLOAD_EXPECT_COMPILED=0 .venv/bin/python -m pytest -q \
  tests/unit/test_compiled.py tests/unit/test_manager.py \
  tests/unit/test_manager_stateful.py tests/unit/test_arc_policy.py \
  tests/unit/test_bad_input.py tests/unit/test_policies_more.py tests/unit/test_reuse_manager.py \
  tests/unit/test_evict_ahead.py
