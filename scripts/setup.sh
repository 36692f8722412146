#!/usr/bin/env bash
# Create .venv and install kvcache-offload with the server, plot and dev extras.
# torch is installed first and pinned for CPU machines (a plain "torch" requirement would pull
# a multi-GB CUDA build); set KVCACHE_OFFLOAD_TORCH to choose another torch spec.
# The install compiles the manager and its eviction policies with mypyc (setup.py); it is redone
# whenever those sources or the build files change, so the extensions never go stale.
# KVCACHE_OFFLOAD_COMPILE=0 installs the pure-Python build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "${KVCACHE_OFFLOAD_TORCH:-torch==2.13.0}"
fi
stamp=.venv/.kvcache-offload-install
# Every compiled source: the mypyc modules, and each C extension's source and headers.
sources=$(.venv/bin/python -c "
import runpy
table = runpy.run_path('kvcache_offload/_compiled.py')
paths = [m.replace('.', '/') + '.py' for m in table['COMPILED_MODULES']]
paths += sorted({p for files in table['C_EXTENSIONS'].values() for p in files})
print(' '.join(paths))")
# shellcheck disable=SC2086
wanted="compile=${KVCACHE_OFFLOAD_COMPILE:-1} $(cat pyproject.toml setup.py mypyc.ini $sources | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install -q -e ".[server,plot,dev]"
  echo "$wanted" > "$stamp"
fi
