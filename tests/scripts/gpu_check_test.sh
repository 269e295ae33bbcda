#!/usr/bin/env bash
# scripts/gpu_check.sh without a GPU: nvcc, nvidia-smi, cmake, ctest and the built moecore are
# stand-ins that print what the real ones print (the kernel list is tests/golden/gpu_kernels.txt,
# which tests/kernels/bench_rows_test.cpp holds to the real rows), so the script's own logic is
# checked here: the ceiling parse, a row as each is measured, --out, each test's time-out, the
# budget, and what is left when the command is killed.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
fail=0
check() {  # description, then a command that must succeed
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fail=1; fi
}

# ---------------------------------------------------------------- the stand-ins
fake=$work/cuda
mkdir -p "$fake/bin" "$fake/lib64" "$fake/include"
for l in cublasLt nccl cudart nvrtc; do : > "$fake/lib64/lib$l.so"; done
printf '#define CUBLAS_VER_MAJOR 13\n#define CUBLAS_VER_MINOR 1\n#define CUBLAS_VER_PATCH 0\n' > "$fake/include/cublas_api.h"
: > "$fake/include/cublasLt.h"
printf '#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 3\n' > "$fake/include/nccl.h"
cat > "$fake/bin/nvcc" <<'EOF'
#!/bin/sh
echo "Cuda compilation tools, release 13.0, V13.0.48"
EOF
cat > "$fake/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo "NVIDIA H200, 143771 MiB, 580.159.03"
EOF
# cmake: configure writes build.ninja and a one-step .ninja_log; --build puts moecore in place.
cat > "$fake/bin/cmake" <<EOF
#!/bin/bash
if [ "\$1" = --version ]; then echo "cmake version 3.31.6"; exit 0; fi
if [ "\$1" = --build ]; then cp "$work/moecore" "\$2/moecore"; echo "[1/1] fake build"; exit 0; fi
while (( \$# )); do [ "\$1" = -B ] && { mkdir -p "\$2"; : > "\$2/build.ninja"; }; shift; done
EOF
cat > "$fake/bin/ctest" <<EOF
#!/bin/bash
echo "\$*" >> "$work/ctest.args"
sleep "\${FAKE_TEST_S:-0}"
echo "100% tests passed, 0 tests failed out of 7"
EOF
cat > "$work/moecore" <<EOF
#!/bin/bash
sleep "\${FAKE_SLOW_S:-0}"
case "\$1 \$2" in
  "bench --kernels") while IFS= read -r l; do echo "\$l"; sleep "\${FAKE_ROW_S:-0}"; done < "$repo/tests/golden/gpu_kernels.txt" ;;
  config*) echo "# parameters: 3562604544" ;;
  bench*) cat <<'OUT'
precision bf16, 32768 tokens/step (8 x 4096, micro-batch 2), 4 timed steps
tokens/s (median): 72818
model GFLOP/s: 309400.0  MFU: 31.3% of 989400.0 GFLOP/s (datasheet: dense bf16 989.4 TFLOP/s)
kernel paths (calls in the timed steps): grouped GEMM: 96 CUTLASS, 0 SIMT; attention: 64 cuDNN, 0 ours
setup: 12.50 s (allocation, parameter init of 3562604544 parameters on 16 host threads, plans)
peak device memory: 81234.5 MiB (estimate 80012.2 MiB + the backend's fixed scratch and workspace: 102%)
OUT
  ;;
esac
EOF
chmod +x "$fake/bin/"* "$work/moecore"
export PATH="$fake/bin:$PATH" MOE_GPU_BUILD_DIR=$work/build MOE_GPU_CHECK_SYSROOT=0 MOE_CUDA_HEADERS_SCRIPT=true

# ---------------------------------------------------------------- the reader
. "$repo/scripts/gpu_check_lib.sh"
check "the ceiling keeps its decimals (a 29-character label)" test "$(kernel_ceiling "$repo/tests/golden/gpu_kernels.txt")" = 650.3
printf '%s\n' "dense bf16 GEMM (cuBLAS best), a label past its column | 8192 x 8192 x 8192 | 650.3 | n" > "$work/long.txt"
check "a label longer than its column moves no field" test "$(kernel_ceiling "$work/long.txt")" = 650.3

# ---------------------------------------------------------------- a whole run
"$repo/scripts/gpu_check.sh" --out "$work/out" > "$work/run.txt" 2>&1
rc=$?
check "the run succeeds" test $rc = 0
check "the log is in --out" test -s "$work/out/gpu_check.log"
check "the table is in --out" test -s "$work/out/table.txt"
check "kernel rows are labelled by their path" grep -q "grouped bf16 fwd (CUTLASS)" "$work/out/table.txt"
check "a step row's MFU against the measured ceiling" grep -q "47.6% of the measured GEMM ceiling 650.3 TFLOP/s" "$work/out/table.txt"
check "a step row names the kernel paths" grep -q "grouped GEMM: 96 CUTLASS" "$work/out/table.txt"
check "a step row names its peak's source" grep -q "MFU 31.3% of 989400.0 GFLOP/s (datasheet" "$work/out/table.txt"
check "the expert-scaling cost" grep -q "expert scaling cost .* +0.0%" "$work/out/table.txt"
check "tests run in two parts, bench-critical first" test "$(grep -c . "$work/ctest.args")" = 2
check "the first part is the CUTLASS and bench-critical tests" grep -q -- "-R Gemm|Attention" <(head -n 1 "$work/ctest.args")
check "every test's time-out is at most 240 s" awk '{for (i = 1; i < NF; i++) if ($i == "--timeout" && ($(i + 1) + 0 > 240 || $(i + 1) + 0 <= 0)) bad = 1} END {exit bad}' "$work/ctest.args"
check "every ctest call has a time-out" test "$(grep -c -- --timeout "$work/ctest.args")" = 2

# ---------------------------------------------------------------- the budget
rm -f "$work/ctest.args"
t0=$(date +%s)
FAKE_SLOW_S=2 "$repo/scripts/gpu_check.sh" --bench --budget 30 --out "$work/budget" > "$work/budget.txt" 2>&1
took=$(( $(date +%s) - t0 ))
check "a run out of budget ends within it ($took s)" test "$took" -le 32
check "parts past the budget say they were skipped" grep -q "skipped" "$work/budget/table.txt"

# ---------------------------------------------------------------- killed mid-run
FAKE_ROW_S=1 timeout -s KILL 4 "$repo/scripts/gpu_check.sh" --bench --out "$work/killed" > /dev/null 2>&1
check "rows measured before a kill are in the table" grep -q "dense bf16 GEMM (linear_fwd)" "$work/killed/table.txt"
check "and in the log" grep -q "dense bf16 GEMM (linear_fwd)" "$work/killed/gpu_check.log"

# ---------------------------------------------------------------- the profile's kernel table
# Nsight Compute's CSV as the first H200 run wrote it (ncu's own lines around it, units per row).
cat > "$work/ncu.csv" <<'EOF'
==PROF== Connected to process 1 (moecore)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","moecore","h","void moe::cuda::<unnamed>::adamw_by_control_kernel(float *, const float *, float *, float *, long, const double *, double, double, double, double)","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","863.70"
"1","1","moecore","h","void moe::cuda::<unnamed>::convert_kernel<float, moe::cuda::bf16>(const float *, moe::cuda::bf16 *, long)","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","100.00"
"2","1","moecore","h","void moe::cuda::<unnamed>::convert_kernel<moe::cuda::bf16, float>(const moe::cuda::bf16 *, float *, long)","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","50,000"
"3","1","moecore","h","void moe::cuda::<unnamed>::adamw_by_control_kernel(float *, const float *, float *, float *, long, const double *, double, double, double, double)","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","0.8637"
==PROF== Disconnected from process 1
EOF
python3 "$repo/tools/ncu_kernel_table.py" "$work/ncu.csv" --steps 2 > "$work/ncu_table.txt" 2>&1
check "the kernel table reads ncu's CSV" grep -q "^4 kernel launches, 0.94 ms of kernel time per step" "$work/ncu_table.txt"
check "kernels are folded by name, templates too, largest first" \
  test "$(sed -n 3p "$work/ncu_table.txt" | cut -d'|' -f1 | sed 's/ *$//')" = "moe::cuda::<...>::adamw_by_control_kernel"
check "units are converted (us, ns with a thousands comma, ms)" grep -qE "convert_kernel<...> +\| +1.0 \| +0.07 \| +75.0 \| +8.0%" "$work/ncu_table.txt"

if [ $fail != 0 ]; then echo "--- the run's output:"; cat "$work/run.txt"; exit 1; fi
echo "gpu_check.sh: all checks passed"
