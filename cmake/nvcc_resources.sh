#!/usr/bin/env bash
# CMAKE_CUDA_COMPILER_LAUNCHER for the CUDA objects: runs the nvcc command (which has -Xptxas=-v)
# and keeps ptxas's per-kernel report (registers, shared memory, spills) in <object>.ptxas for
# scripts/check_kernels.sh, so the one compile also yields the spill check. Everything else nvcc
# prints (warnings, errors) still reaches the console.
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  prev=$a
done
log=$(mktemp)
"$@" 2> "$log"
rc=$?
grep -v -E '^ptxas info|^    [0-9]+ bytes stack frame' "$log" >&2
if [ -n "$out" ] && [ $rc -eq 0 ]; then mv "$log" "$out.ptxas"; else rm -f "$log"; fi
exit $rc
