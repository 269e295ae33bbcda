#!/usr/bin/env bash
# Configure and build (Release, Ninja) into build/. With the CUDA toolkit on PATH (nvcc) the CUDA
# backend is built too (-DMOE_CUDA=ON; MOE_CUDA=OFF in the environment turns it off); its
# header-only libraries come from scripts/cuda_headers.sh. Arguments: targets (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${MOE_CUDA:-}
if [ -z "$cuda" ]; then command -v nvcc >/dev/null 2>&1 && cuda=ON || cuda=OFF; fi
if [ ! -f build/build.ninja ]; then
  [ "$cuda" = ON ] && scripts/cuda_headers.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA="$cuda" >/dev/null
fi
cmake --build build -j "$(nproc)" ${1:+--target "$@"}
