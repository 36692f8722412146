#!/usr/bin/env bash
# Build the bundle that runs vLLM 0.21's own tests/v1/kv_offload/cpu/test_gpu_worker.py through
# this library's vLLM adapter and CUDA handlers on a GPU machine without network, where at most
# 64 MiB can be carried (see scripts/vllm_gpu_bundle/README.md; usage: scripts/vllm-gpu-bundle.sh
# [DEST], default ../vllm-gpu-bundle). Needs .venv-vllm/0.21.0 (./scripts/vllm-tests.sh 0.21.0).
#
# The bundle holds: vLLM 0.21.0's Python sources (the installed wheel without its compiled
# modules, xz-compressed), stubs for the two compiled modules the CUDA platform imports, the
# cp312 wheels the device image lacks, vLLM's test file (original and adapted: one import line),
# the shim that builds the handlers through KVCacheOffloadSpec, a conftest with the one vLLM
# fixture used, and run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.21.0
DEST=$(realpath -m "${1:-../vllm-gpu-bundle}")
VENV=.venv-vllm/$VERSION
SRC=scripts/vllm_gpu_bundle
TEST=tests/v1/kv_offload/cpu/test_gpu_worker.py
# What the device image (Python 3.12, CUDA torch, no pydantic) lacks for vLLM's config and
# kv_offload modules and for kvcache-offload's config: found by importing both in a venv that
# holds only the image's packages (docs/vllm-plugin.md).
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4 msgspec==0.23.0 pyzmq==27.3.0
  cbor2==6.3.0 cachetools==8.0.2 pybase64==1.5.1 gguf==0.19.0 sniffio==1.3.1
  openai==3.57.0 openai-harmony==0.0.8 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
[ -f "$VENV/.installed" ] || { echo "missing $VENV: run ./scripts/vllm-tests.sh $VERSION" >&2; exit 2; }
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST"/{tests,original,stubs/vllm,wheels}

echo "== vLLM $VERSION python sources (compiled modules left out)"
mkdir -p "$tmp/src/vllm-$VERSION.dist-info"
(cd "$SITE" && find vllm -type f ! -name '*.so' ! -path '*__pycache__*' -print0 | tar cf - --null -T -) |
  tar xf - -C "$tmp/src"
cp "$SITE/vllm-$VERSION.dist-info/"{METADATA,top_level.txt} "$tmp/src/vllm-$VERSION.dist-info/"
printf 'vllm-%s.dist-info/METADATA,,\n' "$VERSION" > "$tmp/src/vllm-$VERSION.dist-info/RECORD"
tar cJf "$DEST/vllm-$VERSION-py.tar.xz" -C "$tmp/src" vllm "vllm-$VERSION.dist-info"
for name in _C _C_stable_libtorch; do cp "$SRC/stubs/_C.py" "$DEST/stubs/vllm/$name.py"; done

echo "== vLLM's $TEST, adapted"
"$VENV/bin/python" scripts/_vllm_requirements.py --sdist-file "$VERSION" "$TEST" "$tmp/sdist"
cp "$tmp/sdist/$TEST" "$DEST/original/test_gpu_worker.py"
old='from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers'
new='from kvcache_offload_handlers import CpuGpuOffloadingHandlers  # kvcache-offload: our adapter'
[ "$(grep -cx "$old" "$DEST/original/test_gpu_worker.py")" -eq 1 ] ||
  { echo "vLLM's test no longer imports the handlers as expected: adapt by hand" >&2; exit 3; }
sed "s/^$old\$/$new/" "$DEST/original/test_gpu_worker.py" > "$DEST/tests/test_gpu_worker.py"
# The layout-neutral variant: the multi-group check reads the CPU side with reshape, not view.
sed -E 's/^( +)(src_view|dst_view|orig_dst_view) = (src_tensor|dst_tensor|orig_dst_tensor)\.view\(-1, gpu_page_size_bytes\)$/\1\2 = \3.reshape(-1, gpu_page_size_bytes)  # kvcache-offload: layout-neutral/' \
  "$DEST/tests/test_gpu_worker.py" > "$DEST/tests/test_gpu_worker_reshape.py"
[ "$(grep -c 'kvcache-offload: layout-neutral' "$DEST/tests/test_gpu_worker_reshape.py")" -eq 3 ] ||
  { echo "the multi-group check changed: adapt test_gpu_worker_reshape.py by hand" >&2; exit 3; }
(cd "$DEST" && { diff -u original/test_gpu_worker.py tests/test_gpu_worker.py > adaptation.diff || true; }
  diff -u tests/test_gpu_worker.py tests/test_gpu_worker_reshape.py > reshape-variant.diff || true)
cp "$SRC/conftest.py" "$SRC/kvcache_offload_handlers.py" "$DEST/tests/"
cp "$SRC/run.sh" "$SRC/README.md" "$DEST/"
chmod +x "$DEST/run.sh"

echo "== cp312 wheels the device image lacks"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$DEST/wheels" "${WHEELS[@]}"

size=$(du -sm "$DEST" | cut -f1)
echo "bundle: $DEST, ${size} MiB"
[ "$size" -le 60 ] || { echo "the bundle exceeds 60 MiB" >&2; exit 4; }
