#!/usr/bin/env bash
# Configure and build (Release, Ninja) into build/. MOE_CUDA=ON|OFF chooses the CUDA backend
# (-DMOE_CUDA; its header-only libraries come from scripts/cuda_headers.sh); unset, it is built
# when the CUDA toolkit is on PATH (nvcc). A build/ configured the other way is reconfigured.
# Arguments: targets (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${MOE_CUDA:-}
if [ -z "$cuda" ]; then command -v nvcc >/dev/null 2>&1 && cuda=ON || cuda=OFF; fi
cached=""
[ -f build/build.ninja ] && cached=$(sed -n 's/^MOE_CUDA:BOOL=//p' build/CMakeCache.txt)
if [ "$cached" != "$cuda" ]; then
  [ "$cuda" = ON ] && scripts/cuda_headers.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA="$cuda" >/dev/null
fi
cmake --build build -j "$(nproc)" ${1:+--target "$@"}
