#!/usr/bin/env bash
# The guide page (web/): the planner compiled to WebAssembly with Debian's emscripten, inlined into
# build-web/moecore-planner.html (one file; open it from disk). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export NODE_PATH=/usr/share/nodejs  # emscripten 3.1.6's JS optimizer with Debian's node modules
[ -f build-web/build.ninja ] || emcmake cmake -S web -B build-web -G Ninja >/dev/null
cmake --build build-web -j "$(nproc)"
echo "page: build-web/moecore-planner.html ($(du -k build-web/moecore-planner.html | cut -f1) KiB)"
