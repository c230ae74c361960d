#!/usr/bin/env bash
# Build llama-server, the bench's anchor, from the llama.cpp that hydra-trio runs:
# the one vendored in the llama-cpp-python sdist that dev.sh builds, with the same
# CPU flags (./dev.sh cmake-args), a Release build of shared libraries like the
# wheel's, and only the llama-server target.  No network beyond the package
# registry (the web UI is not fetched: LLAMA_USE_PREBUILT_UI=OFF).
#
#   bench/build_llama_server.sh          build once, print the binary's path
#
# Cached per (llama-cpp-python version, CMake flags) under
# ${XDG_CACHE_HOME:-~/.cache}/hydra-trio/llama-server/<key>/; about 10 minutes
# on 2 cores the first time, instant afterwards.  Only benches need it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=//p' "$ROOT/dev.sh")"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
ARGS="$("$ROOT/dev.sh" cmake-args)"
KEY="$(echo "$VERSION $ARGS" | sha256sum | cut -c1-16)"
CACHE="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hydra-trio"
DIR="$CACHE/llama-server/$KEY"
BIN="$DIR/build/bin/llama-server"

if [ -x "$BIN" ] && [ -f "$DIR/.done" ]; then
  echo "$BIN"
  exit 0
fi

SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "==> downloading the llama-cpp-python $VERSION sdist" >&2
  mkdir -p "$CACHE/sdist"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION" >&2
fi

rm -rf "$DIR"
mkdir -p "$DIR"
echo "==> unpacking vendor/llama.cpp" >&2
tar -xzf "$SDIST" -C "$DIR" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
echo "==> configuring: $ARGS" >&2
# shellcheck disable=SC2086
cmake -S "$DIR" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  $ARGS >&2
echo "==> building llama-server (about 10 minutes on 2 cores)" >&2
cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >&2
touch "$DIR/.done"
echo "$BIN"
