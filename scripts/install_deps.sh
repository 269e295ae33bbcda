#!/usr/bin/env bash
# Debian packages moecore needs to build, test and run its default training. Idempotent.
set -euo pipefail
PKGS=(cmake ninja-build g++ ccache libdnnl-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
      libbenchmark-dev bible-kjv
      openmpi-bin libopenmpi-dev  # the communicator (src/parallel/) and its mpirun tests
      clang libclang-rt-14-dev libomp-dev  # the libFuzzer build (CI's fuzz stage)
      emscripten chromium)  # the planner's guide page (web/) and its browser test
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The CUDA backend's header-only libraries (CUTLASS, cuDNN frontend), when the toolkit is here.
if command -v nvcc >/dev/null 2>&1; then "$(dirname "$0")/cuda_headers.sh"; fi
