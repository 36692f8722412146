#!/usr/bin/env bash
# The release install, as a user gets it. `pip wheel .` builds a wheel. Installed alone, its
# command line works for everything but `serve`, which names the extra it needs in one line.
# Installed with the `server` extra (no torch) into a fresh venv, outside the source tree,
# `kvcache-offload serve` stores and returns a block byte-exact: the service needs no torch.
# Then torch==2.13.0 goes in and the README's embedded example must run. The version is
# checked on the wheel, `--version` and the OpenAPI document.
# KVCACHE_OFFLOAD_TORCH overrides the torch spec; RELEASE_CHECK_DIR keeps the work folder.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=${RELEASE_CHECK_DIR:-$(mktemp -d /tmp/kvcache-offload-release.XXXXXX)}
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  if [ -z "${RELEASE_CHECK_DIR:-}" ]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT
step() { echo "release-check: $*" >&2; }

step "building the wheel"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT"
WHEEL=$(ls "$WORK"/dist/kvcache_offload-*.whl)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")
case "$(basename "$WHEEL")" in
  kvcache_offload-"$VERSION"-*) ;;
  *) echo "release-check: wheel $(basename "$WHEEL") is not version $VERSION" >&2; exit 1 ;;
esac

step "the base install (no extras): help and replay work, serve names its extra in one line"
"$PY" -m venv "$WORK/base"
"$WORK/base/bin/python" -m pip install -q "$WHEEL"
(
  cd "$WORK"
  "$WORK/base/bin/kvcache-offload" --help >/dev/null
  "$WORK/base/bin/kvcache-offload" serve --help >/dev/null
  "$WORK/base/bin/kvcache-offload" replay --capacity 10 --policy lru >/dev/null
  if "$WORK/base/bin/kvcache-offload" serve >"$WORK/base-serve.out" 2>&1; then
    echo "release-check: serve ran without the server extra" >&2; exit 1
  fi
  grep -q "pip install 'kvcache-offload\[server\]'" "$WORK/base-serve.out"
  [ "$(wc -l <"$WORK/base-serve.out")" -eq 1 ] || { cat "$WORK/base-serve.out" >&2; exit 1; }
)

step "installing $(basename "$WHEEL") with the server extra into a fresh venv (no torch)"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$WHEEL[server]"
cd "$WORK"  # outside the source tree from here on
if "$VPY" -c "import torch" 2>/dev/null; then
  echo "release-check: the server extra pulled in torch" >&2; exit 1
fi
got=$("$WORK/venv/bin/kvcache-offload" --version)
[ "$got" = "kvcache-offload $VERSION" ] || { echo "release-check: --version said '$got'" >&2; exit 1; }

serve_round_trip() {
  local port log
  port=$("$VPY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  log="$WORK/serve-$1.log"
  KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK=4096 "$WORK/venv/bin/kvcache-offload" serve \
    --port "$port" --cpu-bytes 1MiB >"$log" 2>&1 &
  SERVER_PID=$!
  "$VPY" - "$port" "$VERSION" <<'PY' || { cat "$log" >&2; exit 1; }
import os, sys, time
import httpx
port, version = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 60
while True:
    try:
        if httpx.get(f"{url}/readyz").status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the service did not get ready within 60 s")
    time.sleep(0.1)
block = os.urandom(4096)
key = "0123456789abcdef00000000"
put = httpx.put(f"{url}/v1/blocks", params={"keys": key}, content=block)
assert put.status_code == 200, put.text
got = httpx.get(f"{url}/v1/blocks/{key}")
assert got.status_code == 200 and got.content == block, "block bytes differ"
assert httpx.get(f"{url}/openapi.json").json()["info"]["version"] == version
PY
  kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
  grep -q "serving: policy" "$log" || { echo "release-check: no startup line" >&2; cat "$log" >&2; exit 1; }
}

step "serve without torch: a block stored and read back byte-exact"
serve_round_trip no-torch

step "installing ${KVCACHE_OFFLOAD_TORCH:-torch==2.13.0}"
"$VPY" -m pip install -q "${KVCACHE_OFFLOAD_TORCH:-torch==2.13.0}"
serve_round_trip torch

step "the README's embedded example"
"$VPY" - "$ROOT/README.md" <<'PY'
import re, subprocess, sys
text = open(sys.argv[1]).read()
examples = re.findall(
    r"<!-- readme-example:start -->\s*```python\n(.*?)```\s*<!-- readme-example:end -->", text, re.S
)
assert examples, "README.md has no marked example"
for i, code in enumerate(examples):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"README example {i} failed:\n{result.stderr}")
    print(result.stdout, end="")
PY
step "ok: $(basename "$WHEEL")"
