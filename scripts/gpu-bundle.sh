#!/usr/bin/env bash
# Run this tree's GPU tests and benchmarks on a GPU machine without network whose image has
# Python 3.12 with CUDA torch, Triton and numpy but not this library's other dependencies.
#
#   scripts/gpu-bundle.sh prepare [DEST]   # here: DEST (default .gpu-bundle, git-ignored) gets
#                                          # the cp312 wheels the image lacks and a cp312 build
#                                          # of the compiled manager and the C extensions
#   DEST/run.sh 'CMD' ['CMD' ...]          # there, from the tree's root (DEST travels with it):
#                                          # installs the wheels into /tmp/site, puts the
#                                          # extensions into the tree, runs each CMD in turn,
#                                          # its output also in $OUT/stepN.log when OUT is set
#
# prepare needs pip and a Python 3.12 here (PYTHON312, else python3.12 on PATH) to build the
# extensions; without one the bundle has only the wheels and the tree runs its sources.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = prepare ] || { sed -n '2,14p' "$0" >&2; exit 2; }
DEST=$(realpath -m "${2:-.gpu-bundle}")
# The library's dependencies that the image lacks, plus the test plugins it runs with; the
# versions the development venv holds (keep one version of each: two stop the install).
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4 msgspec==0.23.0 pyzmq==27.3.0
  fastapi==0.165.0 starlette==1.10.0 sse-starlette==3.7.1 orjson==3.13.0 pytest-asyncio==1.5.0
)
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/ext"

echo "== cp312 wheels"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$DEST/wheels" "${WHEELS[@]}"

echo "== cp312 build of the extensions"
PY312=${PYTHON312:-$(command -v python3.12 || true)}
if [ -z "$PY312" ]; then
  echo "no Python 3.12 here (set PYTHON312): the bundle runs the tree's sources" >&2
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY312" -m venv "$tmp/venv"
  mypy_version=$(python3 -c 'import mypy.version; print(mypy.version.__version__)' 2>/dev/null ||
    .venv/bin/python -c 'import mypy.version; print(mypy.version.__version__)')
  "$tmp/venv/bin/pip" install -q "mypy==$mypy_version" mypy_extensions setuptools numpy
  git ls-files -co --exclude-standard -- kvcache_offload api setup.py pyproject.toml \
    MANIFEST.in mypyc.ini README.md | tar -cf - -T - | (mkdir "$tmp/src" && tar -xf - -C "$tmp/src")
  (cd "$tmp/src" && "$tmp/venv/bin/python" setup.py build_ext --inplace > "$tmp/build.log" 2>&1) ||
    { tail -20 "$tmp/build.log" >&2; exit 3; }
  (cd "$tmp/src" && find kvcache_offload api -name '*.so' -exec cp --parents {} "$DEST/ext/" \; &&
    cp ./*__mypyc*.so "$DEST/ext/")
  echo "$(find "$DEST/ext" -name '*.so' | wc -l) extensions"
fi

cat > "$DEST/run.sh" <<'EOF'
#!/usr/bin/env bash
# Made by scripts/gpu-bundle.sh prepare: run from the tree's root on the GPU machine.
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$here"/wheels/*.whl > /dev/null || { echo "installing the wheels failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(cd "$here/ext" && find . -name '*.so' -exec cp --parents {} "$OLDPWD" \;)
python3 -c "import kvcache_offload.control.manager as m; print('manager compiled:', m.__file__.endswith('.so'))"
i=0
for step in "$@"; do
  i=$((i + 1))
  echo "=== step $i: $step ($(date -u +%H:%M:%S))"
  if [ -n "${OUT:-}" ]; then bash -c "$step" 2>&1 | tee "$OUT/step$i.log"; else bash -c "$step"; fi
done
EOF
chmod +x "$DEST/run.sh"
echo "wrote $DEST ($(du -sh "$DEST" | cut -f1)); there: $(basename "$DEST")/run.sh 'python3 -m pytest -q tests/gpu'"
