#!/usr/bin/env bash
# The default run, from a fresh machine: install, build the `moecore` executable only (no CUDA
# backend unless MOE_CUDA=ON: the default run trains on the CPU), prepare the King James Bible
# once (byte-level tokens, held-out validation slice), train with the embedded default config.
# Extra arguments go to `moecore train` (e.g. --set train.steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
MOE_CUDA=${MOE_CUDA:-OFF} scripts/build.sh moecore
if [ ! -f data/kjv/train.bin ]; then
  mkdir -p data/kjv
  bible -f "Gen1:1-Rev22:21" > data/kjv/kjv.txt
  build/moecore prepare --input data/kjv/kjv.txt --out data/kjv
fi
echo "bigram conditional entropy (the bar to beat): $(cat data/kjv/bigram_entropy.txt) nats/token"
OMP_PROC_BIND=close OMP_PLACES=cores exec build/moecore train "$@"
