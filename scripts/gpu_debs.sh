#!/usr/bin/env bash
# The Debian packages of cmake/gpu_debs.txt into .cache/debs (for scripts/gpu_check.sh on a GPU
# machine without network). Idempotent; needs apt's package lists (Debian 12).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache/debs
pkgs=$(grep -v '^#' cmake/gpu_debs.txt | tr '\n' ' ')
cd .cache/debs
missing=()
for p in $pkgs; do ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then apt-get download "${missing[@]}" 2>/dev/null; fi
du -sh . | cut -f1
