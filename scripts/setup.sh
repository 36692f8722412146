#!/usr/bin/env bash
# Create .venv and install kvcache-offload with the server, plot and dev extras.
# torch is installed first and pinned for CPU machines (a plain "torch" requirement would pull
# a multi-GB CUDA build); set KVCACHE_OFFLOAD_TORCH to choose another torch spec.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${KVCACHE_OFFLOAD_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[server,plot,dev]"
