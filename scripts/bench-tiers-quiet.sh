#!/usr/bin/env bash
# bench.tiers on a quiet host that has python3 (3.12) but no network and no redis-server or
# redis-py: the device machine. Everything it lacks travels in .devbin/ (git-ignored), filled
# here, on a machine with the OS package redis-server and PyPI, by `prepare`:
#
#   scripts/bench-tiers-quiet.sh prepare        # here: .devbin/redis (server + its libraries,
#                                               #   loader included) and .devbin/wheels
#   scripts/bench-tiers-quiet.sh run [ARGS...]  # there: redis-server pinned to SERVER_CPUS,
#                                               #   bench.tiers pinned to CLIENT_CPUS, ROUNDS runs
#
# The server is started through the carried loader (ld-linux) with the carried libraries, so
# it does not depend on the host's glibc. The two sides never share a core (taskset), so the
# 64-key lookup's p99 is the round trip and the client, not a neighbour's scheduling. The
# client gets four cores (the disk tier's check thread is on from four), the server one. ARGS go
# to bench.tiers (default: --repeat 5 --lookups 2000). Results: bench/out/tiers-*.json, also
# copied to $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=${DEVBIN:-.devbin}
PYVER=${PYVER:-3.12}
# What bench.tiers imports (no torch): the project's dependencies and the Redis client, with
# their own dependencies. All of them are installed from the carried wheels into one folder put
# first on PYTHONPATH, so the run does not depend on what the host's python3 (there itself a
# venv) happens to hold.
WHEELS=(redis pydantic pydantic-settings msgspec pyzmq
  numpy anyio rich typer xxhash mypy_extensions)

prepare() {
  local server lib
  server=$(command -v redis-server) || { echo "install redis-server first" >&2; exit 1; }
  rm -rf "$DEV/redis" "$DEV/wheels"
  mkdir -p "$DEV/redis/lib" "$DEV/wheels"
  cp -L "$server" "$DEV/redis/redis-server"  # a symlink to redis-check-rdb: argv[0] decides
  for lib in $(ldd "$server" | grep -o '/[^ ]*'); do
    cp -L "$lib" "$DEV/redis/lib/"
  done
  "${PYTHON:-.venv/bin/python}" -m pip download -q --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$DEV/wheels" "${WHEELS[@]}"
  du -sh "$DEV"
}

pinned() {  # the taskset prefix for CPUS, or none (and said so) where taskset is refused
  if taskset -c "$1" true 2>/dev/null; then
    echo "taskset -c $1"
  else
    echo "taskset -c $1 refused here: running unpinned" >&2
  fi
}

run() {
  local deps=/tmp/kvo-bench-deps port i args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--repeat 5 --lookups 2000)
  rm -rf "$deps"
  python3 -m pip install -q --no-index --find-links "$DEV/wheels" --target "$deps" "${WHEELS[@]}"
  port=${PORT:-6399}
  # shellcheck disable=SC2046  # the prefix is meant to split into words
  $(pinned "${SERVER_CPUS:-2}") "$DEV"/redis/lib/ld-linux-x86-64.so.2 \
    --library-path "$DEV/redis/lib" "$DEV/redis/redis-server" --port "$port" \
    --bind 127.0.0.1 --save "" --appendonly no --dir /tmp --maxmemory 2gb \
    --maxmemory-policy allkeys-lru >/tmp/kvo-bench-redis.log 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
  python3 - "$port" <<'PY'
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(open("/tmp/kvo-bench-redis.log").read()[-2000:] or "redis did not start")
        time.sleep(0.05)
PY
  kill -0 "$SERVER_PID" || { echo "port $port is taken by another server" >&2; exit 1; }
  nproc
  for i in $(seq "${ROUNDS:-3}"); do
    echo "== run $i, load: $(cut -d' ' -f1-3 /proc/loadavg)"
    # shellcheck disable=SC2046
    $(pinned "${CLIENT_CPUS:-4-7}") env PYTHONPATH="$deps:." python3 -m bench.tiers \
      --redis-url "redis://127.0.0.1:$port/0" --dir /tmp "${args[@]}"
  done
  if [ -n "${OUT:-}" ]; then
    cp bench/out/tiers-*.json "$OUT/" 2>/dev/null || true
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare | run [bench.tiers args...]" >&2; exit 2 ;;
esac
