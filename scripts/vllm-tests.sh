#!/usr/bin/env bash
# Test the vLLM plug-in (kvcache_offload.integrations.vllm) against vLLM's own code, on a CPU-only
# machine, for every supported vLLM release (default: all of them; or pass versions as arguments).
#
# Per version, in .venv-vllm/<version>/ (inside the repo, git-ignored, reused when present):
#   1. a venv layered over the project's .venv (a .pth adds .venv's site-packages after its own),
#      so the project's CPU torch and the editable kvcache-offload are shared, never reinstalled;
#   2. the vLLM wheel from PyPI with --no-deps (its pins name CUDA torch builds);
#   3. vLLM's own requirements minus the GPU-only ones (torch family, CUDA kernels), with torch
#      constrained to the installed CPU build so pip can never pull a CUDA torch;
#   4. vLLM's source tarball from PyPI, for its OffloadingConnector unit tests (the control).
# Disk: pip keeps no cache, the downloaded wheel is deleted once installed, and Triton (pulled in
# by xgrammar; about 1 GB, useless without a GPU) is removed. KVCACHE_OFFLOAD_VLLM_KEEP=0 (what
# .ci/run sets) deletes each version's venv once its tests ran, so only one exists at a time.
# Then tests/vllm runs in that venv with a made-up model in a local Hugging Face cache
# (HF_HUB_OFFLINE=1) and a test-only platform plugin that returns vLLM's CPU platform.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(0.21.0 0.33.0)
export PIP_NO_CACHE_DIR=1
BASE_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
TORCH_VERSION=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")

install_vllm() {
  local version=$1 venv=.venv-vllm/$1
  local stamp=$venv/.installed
  [ -f "$stamp" ] && return 0
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$BASE_SITE')" > "$site/zz-kvcache-offload-base.pth"
  "$venv/bin/python" -m pip install -q --upgrade pip
  mkdir -p "$venv/dl"
  "$venv/bin/python" -m pip download -q --no-deps -d "$venv/dl" "vllm==$version"
  "$venv/bin/python" -m pip install -q --no-deps "$venv"/dl/vllm-"$version"*.whl
  "$venv/bin/python" scripts/_vllm_requirements.py "$site" > "$venv/requirements.txt"
  echo "torch==$TORCH_VERSION" > "$venv/constraints.txt"
  "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" -c "$venv/constraints.txt"
  rm -rf "$venv/dl"
  "$venv/bin/python" -m pip uninstall -q -y triton 2>/dev/null || true
  "$venv/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('$TORCH_VERSION')"
  # vLLM's unit tests ship in its source tarball only.
  "$venv/bin/python" scripts/_vllm_requirements.py --sdist "$version" "$venv/src"
  touch "$stamp"
}

for version in "${VERSIONS[@]}"; do
  echo "== vLLM $version"
  start=$(date +%s)
  install_vllm "$version"
  echo "installed in $(($(date +%s) - start)) s"
  start=$(date +%s)
  VLLM_SRC=$PWD/.venv-vllm/$version/src \
    .venv-vllm/"$version"/bin/python -m pytest -q -rP -p no:cacheprovider tests/vllm
  echo "tests ran in $(($(date +%s) - start)) s"
  if [ "${KVCACHE_OFFLOAD_VLLM_KEEP:-1}" = "0" ]; then
    rm -rf .venv-vllm/"$version"
  fi
done
