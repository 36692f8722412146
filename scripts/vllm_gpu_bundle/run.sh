#!/usr/bin/env bash
# vLLM 0.21's own tests/v1/kv_offload/cpu/test_gpu_worker.py, run through kvcache-offload's vLLM
# adapter (KVCacheOffloadSpec(...).get_handlers(...)) and its CUDA handlers, on a CUDA machine
# with no network. See README.md beside this file.
#
# Run from the kvcache-offload repository root (its sources are imported from there):
#     bash <this bundle>/run.sh
# Environment: OUT (results folder; default <bundle>/out), PYTHON (default python3, the one
# holding CUDA torch), WHEELS (default <bundle>/wheels; cp312 wheels), REPO (default $PWD);
# for a rehearsal without a GPU: EXPECT_DEVICE=cpu and EXTRA_PYTHONPATH naming a vLLM platform
# plugin that returns vLLM's CPU platform (our CPU-backend handlers then do the copies).
# Writes to $OUT: env.txt, pytest.log, junit.xml, reshape.log, reshape-junit.xml, summary.txt.
set -uo pipefail
BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "${REPO:-$PWD}" && pwd)
OUT=${OUT:-$BUNDLE/out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$BUNDLE/wheels}
EXPECT_DEVICE=${EXPECT_DEVICE:-cuda}
mkdir -p "$OUT"
if [ ! -d "$REPO/kvcache_offload/integrations/vllm" ]; then
  echo "run.sh: $REPO is not a kvcache-offload checkout with the vLLM plug-in (set REPO=...)" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-gpu-bundle-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "== install into $WORK (no network: bundle wheels, vLLM 0.21.0 python sources, _C stubs)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$WORK/site" "$WHEELS"/*.whl || exit 3
tar xJf "$BUNDLE/vllm-0.21.0-py.tar.xz" -C "$WORK/site" || exit 3
cp "$BUNDLE"/stubs/vllm/*.py "$WORK/site/vllm/"
cp -r "$BUNDLE/tests" "$WORK/tests"
rm -rf "$WORK/tests/__pycache__"
# The bundle's packages first (the image has no pydantic), then the repo, then the tests' shim.
export PYTHONPATH="$WORK/site:$REPO:$WORK/tests${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}

{
  echo "== environment"
  date -u
  "$PY" - <<'EOF'
import importlib.metadata as md
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0))
import kvcache_offload
import vllm
from vllm.platforms import current_platform

print("vllm", vllm.__version__, "(metadata:", md.version("vllm") + ")", "from", vllm.__file__)
print("kvcache_offload", kvcache_offload.__version__, "from", kvcache_offload.__file__)
print("vLLM platform:", type(current_platform).__name__, "device_type:", current_platform.device_type)
from kvcache_offload.integrations.vllm import KVCacheOffloadSpec

print("adapter:", KVCacheOffloadSpec.__module__)
for name in ("triton", "cupy"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:  # reported, not fatal: the handlers pick what is there
        print(name, "unavailable:", exc)
EOF
} 2>&1 | tee "$OUT/env.txt"
if ! grep -q "device_type: $EXPECT_DEVICE\$" "$OUT/env.txt"; then
  echo "run.sh: vLLM did not find the $EXPECT_DEVICE platform (see $OUT/env.txt); the tests would skip" \
    "or run on the wrong device, so they are not run" | tee -a "$OUT/env.txt"
  exit 4
fi

cd "$WORK/tests"
echo "== vLLM's test_gpu_worker.py (one import changed: adaptation.diff)"
"$PY" -m pytest -v -p no:cacheprovider -rfE --junitxml="$OUT/junit.xml" test_gpu_worker.py \
  2>&1 | tee "$OUT/pytest.log"
main_rc=${PIPESTATUS[0]}
echo "== the same file reading the CPU side with reshape instead of view (reshape-variant.diff)"
"$PY" -m pytest -v -p no:cacheprovider -rfE --junitxml="$OUT/reshape-junit.xml" \
  test_gpu_worker_reshape.py -k multi_group 2>&1 | tee "$OUT/reshape.log"
reshape_rc=${PIPESTATUS[0]}

{
  echo "test_gpu_worker.py: $(tail -n 1 "$OUT/pytest.log")"
  echo "failed (expected: the 4 test_transfer_multi_group cases with block_size_factor 3):"
  grep '^FAILED' "$OUT/pytest.log" | sed 's/^/  /'
  echo "test_gpu_worker_reshape.py -k multi_group: $(tail -n 1 "$OUT/reshape.log")"
} | tee "$OUT/summary.txt"
# Exit 0 only when the outcome is the expected one: 20 passed with exactly the 4 layout probes
# failed, and all 8 multi-group cases passed once they read the CPU side layout-neutrally.
expected_failures=$(grep -c '^FAILED test_gpu_worker.py::test_transfer_multi_group\[.*-3-.*\]' "$OUT/pytest.log")
if grep -q '20 passed' "$OUT/pytest.log" && [ "$expected_failures" -eq 4 ] \
  && [ "$main_rc" -eq 1 ] && [ "$reshape_rc" -eq 0 ]; then
  echo "run.sh: outcome as expected" | tee -a "$OUT/summary.txt"
  exit 0
fi
echo "run.sh: outcome differs from the expected one (see summary.txt)" | tee -a "$OUT/summary.txt"
exit 1
