#!/usr/bin/env bash
# Quick start: install the service and run it with embedded defaults (CPU backend, 1 GiB CPU
# tier, no GPU and no other server) on http://127.0.0.1:8000. Arguments go to
# `kvcache-offload serve`.
#
# The service needs the `server` extra only: it never imports torch (GPU workers copy through
# the shared region or over HTTP), so it installs into its own venv, .venv-serve, without
# torch. The install is redone when a source or build file changes. With ./scripts/setup.sh
# already run, KVCACHE_OFFLOAD_SERVE_VENV=.venv reuses the development venv instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCACHE_OFFLOAD_SERVE_VENV:-.venv-serve}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.kvcache-offload-serve"
wanted=$(find pyproject.toml setup.py mypyc.ini kvcache_offload api -type f \
  \( -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.toml' -o -name '*.ini' \
     -o -name '*.jsonl' -o -name '*.md' \) -not -path '*/__pycache__/*' | LC_ALL=C sort |
  xargs cat | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  if [ "$VENV" = ".venv" ]; then
    ./scripts/setup.sh
  else
    echo "installing kvcache-offload[server] into $VENV (no torch) ..." >&2
    "$VENV/bin/python" -m pip install -q ".[server]"
  fi
  echo "$wanted" > "$stamp"
fi
exec "$VENV/bin/kvcache-offload" serve "$@"
