#!/usr/bin/env bash
# One script for a GPU machine: build the CUDA backend there, run the gpu tests and the benchmarks,
# print one table. Works offline on a machine with nvcc 13, g++, CMake, ninja and CUDA libraries
# (the toolkit's, or PyTorch's nvidia-* wheels) but none of our Debian packages: it takes from the
# working tree the header wheels (.cache/wheels: scripts/cuda_headers.sh) and the Debian packages
# (.cache/debs: scripts/gpu_debs.sh), unpacked into .cache/sysroot. Carry .cache/wheels,
# .cache/debs and data/kjv (about 45 MiB). The build folder build-gpu/ is reused by a second run.
#
#   scripts/gpu_check.sh            build, tests, bench, table
#   scripts/gpu_check.sh --tests    build, the gpu tests only
#   scripts/gpu_check.sh --bench    build, the benchmarks only
#   scripts/gpu_check.sh --dry-run  build only, no GPU needed (checks the script on any machine)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=all
for a in "$@"; do
  case "$a" in
    --tests) mode=tests ;;
    --bench) mode=bench ;;
    --dry-run) mode=dry ;;
    *) echo "usage: scripts/gpu_check.sh [--tests | --bench | --dry-run]" >&2; exit 2 ;;
  esac
done
t_start=$(date +%s)
jobs=$(nproc)
log=build-gpu/gpu_check.log
mkdir -p build-gpu
: > "$log"
say() { echo "$@" | tee -a "$log"; }
elapsed() { echo "$(( $(date +%s) - t_start )) s"; }

# ---------------------------------------------------------------- what this machine has
say "== versions"
have() { command -v "$1" >/dev/null 2>&1; }
have nvcc || { say "no nvcc on PATH: nothing to build"; exit 1; }
say "nvcc: $(nvcc --version | tail -n 1)"
say "g++: $(g++ --version | head -n 1)"
say "cmake: $(cmake --version | head -n 1), ninja $(ninja --version 2>/dev/null || echo missing)"
cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
# Library folders: the toolkit's, then PyTorch's nvidia-* wheels.
nv_py=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0] if hasattr(nvidia, "__path__") else nvidia.__file__) + "/nvidia")' 2>/dev/null || true)
find_lib() {  # $1 = library stem (cublasLt), prints the path of lib$1.so* or nothing
  for d in "$cuda_root/lib64" "$cuda_root/targets/x86_64-linux/lib" /usr/lib/x86_64-linux-gnu ${nv_py:+$nv_py/*/lib}; do
    for f in "$d"/lib"$1".so "$d"/lib"$1".so.[0-9]*; do [ -e "$f" ] && { echo "$f"; return; }; done
  done
}
find_header() {  # $1 = header name, prints its folder or nothing
  for d in "$cuda_root/include" "$cuda_root/targets/x86_64-linux/include" /usr/include ${nv_py:+$nv_py/*/include}; do
    [ -e "$d/$1" ] && { echo "$d"; return; }
  done
}
header_version() {  # $1 header path, $2.. macro names -> "a.b.c"
  local h=$1; shift; local out=""
  for m in "$@"; do out+="$(grep -m1 -E "#define $m " "$h" | awk '{print $3}')."; done
  echo "${out%.}"
}
lt_lib=$(find_lib cublasLt); lt_inc=$(find_header cublasLt.h)
nccl_lib=$(find_lib nccl); nccl_inc=$(find_header nccl.h)
cudnn_inc=$(find_header cudnn_version.h); cudnn_lib=$(find_lib cudnn)
rt_lib=$(find_lib cudart)
cupti_lib=$(find_lib cupti); cupti_inc=$(find_header cupti.h)
[ -z "$cupti_lib" ] && for d in "$cuda_root/extras/CUPTI/lib64"; do [ -e "$d/libcupti.so" ] && cupti_lib=$d/libcupti.so; done
[ -z "$cupti_inc" ] && [ -e "$cuda_root/extras/CUPTI/include/cupti.h" ] && cupti_inc=$cuda_root/extras/CUPTI/include
[ -n "$lt_inc" ] && say "cuBLAS: $(header_version "$lt_inc/cublas_api.h" CUBLAS_VER_MAJOR CUBLAS_VER_MINOR CUBLAS_VER_PATCH) ($lt_lib)" || say "cuBLAS: MISSING"
[ -n "$cudnn_inc" ] && say "cuDNN: $(header_version "$cudnn_inc/cudnn_version.h" CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL) (${cudnn_lib:-library not found: attention on our kernel})" || say "cuDNN: missing (attention on our kernel)"
[ -n "$nccl_inc" ] && say "NCCL: $(header_version "$nccl_inc/nccl.h" NCCL_MAJOR NCCL_MINOR NCCL_PATCH) ($nccl_lib)" || say "NCCL: MISSING"
[ -n "$cupti_lib" ] && [ -n "$cupti_inc" ] && say "CUPTI: $cupti_lib" || say "CUPTI: missing (its test reports Skipped)"
have nvidia-smi && say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
if [ -z "$lt_lib" ] || [ -z "$lt_inc" ] || [ -z "$nccl_lib" ] || [ -z "$nccl_inc" ]; then
  say "cuBLASLt or NCCL is missing: the CUDA backend cannot be built here"; exit 1
fi

# ---------------------------------------------------------------- build dependencies
sysroot=$root/.cache/sysroot
need_sysroot=${MOE_GPU_CHECK_SYSROOT:-}  # 1 forces the unpacked packages (to test this path anywhere)
if [ -z "$need_sysroot" ]; then
  need_sysroot=1
  [ -e /usr/include/dnnl.hpp ] && [ -e /usr/include/toml++/toml.h ] && [ -d /usr/lib/x86_64-linux-gnu/openmpi/include ] \
    && [ -d /usr/include/CLI ] && [ -d /usr/include/gtest ] && need_sysroot=0
fi
if [ $need_sysroot = 1 ]; then
  if [ "$(cat "$sysroot/.stamp" 2>/dev/null)" != "$(ls .cache/debs)" ]; then
    ls .cache/debs/*.deb >/dev/null 2>&1 || { say "no .cache/debs: run scripts/gpu_debs.sh on a machine with network and carry it"; exit 1; }
    rm -rf "$sysroot"; mkdir -p "$sysroot"
    for d in .cache/debs/*.deb; do
      if have dpkg-deb; then dpkg-deb -x "$d" "$sysroot"
      else python3 - "$d" "$sysroot" <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n"
pos = 8
while pos < len(data):
    name = data[pos:pos + 16].decode().strip(); size = int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]; pos += 60 + size + (size & 1)
    if name.startswith("data.tar"):
        mode = "r:xz" if name.endswith(".xz") else ("r:zst" if name.endswith(".zst") else "r:*")
        tarfile.open(fileobj=io.BytesIO(body), mode=mode).extractall(sys.argv[2])
PY
      fi
    done
    # Debian's -dev packages link libfoo.so to the versioned runtime with absolute or relative
    # links; relative ones resolve inside the sysroot as they are.
    ls .cache/debs > "$sysroot/.stamp"
  fi
  say "build dependencies: Debian packages unpacked in .cache/sysroot"
  export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  sys_inc="-isystem $sysroot/usr/include"
  sys_lib="$sysroot/usr/lib/x86_64-linux-gnu"
  mpi_hints=(-DMPI_SKIP_COMPILER_WRAPPER=ON -DMPI_C_HEADER_DIR="$sys_lib/openmpi/include" -DMPI_C_LIB_NAMES=mpi
             -DMPI_mpi_LIBRARY="$sys_lib/openmpi/lib/libmpi.so" -DMPIEXEC_EXECUTABLE="$sysroot/usr/bin/orterun")
  export OPAL_PREFIX="$sysroot/usr"  # Open MPI finds its plugins and help files under the sysroot
else
  say "build dependencies: the system's"
  sys_inc=""; sys_lib=""; mpi_hints=()
fi
scripts/cuda_headers.sh .cache/wheels >>"$log" 2>&1 || { say "CUTLASS / cuDNN frontend headers: no wheels in .cache/wheels"; exit 1; }
export LD_LIBRARY_PATH="${sys_lib:+$sys_lib:}$(dirname "$lt_lib"):$(dirname "$nccl_lib"):$(dirname "${rt_lib:-$lt_lib}")${cupti_lib:+:$(dirname "$cupti_lib")}${cudnn_lib:+:$(dirname "$cudnn_lib")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---------------------------------------------------------------- build
say "== build (build-gpu, $jobs jobs)"
t0=$(date +%s)
extra_inc="$sys_inc -isystem $lt_inc -isystem $nccl_inc${cupti_inc:+ -isystem $cupti_inc}"
if [ ! -f build-gpu/build.ninja ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_BUILD_BENCH=OFF \
    -DCMAKE_CXX_FLAGS="$extra_inc" -DCMAKE_CUDA_FLAGS="$extra_inc" -DCUDA_cublasLt_LIBRARY="$lt_lib" \
    ${rt_lib:+-DCUDA_cudart_LIBRARY="$rt_lib"} ${cupti_lib:+-DMOE_CUPTI_LIBRARY="$cupti_lib"} ${cudnn_inc:+-DMOE_CUDNN_INCLUDE="$cudnn_inc"} \
    -DCMAKE_BUILD_RPATH="${sys_lib:+$sys_lib;}$(dirname "$lt_lib");$(dirname "$nccl_lib")" "${mpi_hints[@]}" >>"$log" 2>&1 \
    || { tail -n 30 "$log"; say "configure failed (log: $log)"; exit 1; }
fi
cmake --build build-gpu -j "$jobs" --target moecore kernels_test model_test gpu_test >>"$log" 2>&1 \
  || { grep -E "error|FAILED" "$log" | head -n 30; say "build failed (log: $log)"; exit 1; }
build_s=$(( $(date +%s) - t0 ))
say "built in $build_s s"
[ $mode = dry ] && { say "dry run: built, not run ($(elapsed))"; exit 0; }

# ---------------------------------------------------------------- tests
tests_line="not run"
if [ $mode = all ] || [ $mode = tests ]; then
  say "== gpu tests"
  t0=$(date +%s)
  ctest --test-dir build-gpu -L gpu -j 4 --timeout 900 --output-on-failure > build-gpu/gpu_tests.log 2>&1
  grep -E "tests passed|Failed|\*\*\*Exception|Timeout" build-gpu/gpu_tests.log | tail -n 25 | tee -a "$log"
  tests_line="$(grep -E "tests passed" build-gpu/gpu_tests.log | tail -n 1) in $(( $(date +%s) - t0 )) s"
fi

# ---------------------------------------------------------------- bench
table=()
if [ $mode = all ] || [ $mode = bench ]; then
  say "== kernels"
  build-gpu/moecore bench --kernels > build-gpu/kernels.txt 2>&1
  cat build-gpu/kernels.txt | tee -a "$log"
  while IFS= read -r l; do table+=("$l"); done < <(tail -n +2 build-gpu/kernels.txt)
  # Rows are fixed-width (kernel 28, shape 34, value 9 characters): the cuBLAS-best rate.
  ceiling=$(awk '/cuBLAS best/ {v = substr($0, 63, 9) + 0; if (v > 0) print v}' build-gpu/kernels.txt | head -n 1)
  bench_row() {  # $1 label, $2 config, rest: --set overrides
    local label=$1 cfg=$2; shift 2
    local out; out=$(build-gpu/moecore bench --config "$cfg" --warmup 2 --steps 4 "$@" 2>&1)
    echo "$out" >> "$log"
    local tps mfu mem est
    tps=$(echo "$out" | awk '/tokens\/s \(median\)/ {print $3}')
    mfu=$(echo "$out" | awk '/MFU:/ {for (i=1;i<=NF;i++) if ($i=="MFU:") print $(i+1)}')
    mem=$(echo "$out" | awk '/peak device memory/ {print $4}')
    est=$(echo "$out" | awk '/peak device memory/ {print $7}')
    local gflops; gflops=$(echo "$out" | awk '/model GFLOP\/s/ {print $3}')
    local mfu_ceiling="n/a"
    [ -n "$ceiling" ] && [ -n "$gflops" ] && mfu_ceiling=$(awk -v g="$gflops" -v c="$ceiling" 'BEGIN {printf "%.1f%%", 100 * g / 1000 / c}')
    table+=("$(printf '%-28s %-34s %9s   tokens/s; MFU %s of 989, %s of the measured GEMM ceiling; device %s MiB (estimate %s)' \
      "step $label" "$(basename "$cfg")" "${tps:-failed}" "${mfu:-?}" "$mfu_ceiling" "${mem:-?}" "${est:-?}")")
  }
  say "== steps"
  bench_row "OLMoE-shaped 64x top-8" configs/bench/gpu_olmoe.toml
  bench_row "coarse 8x top-2" configs/bench/gpu_coarse.toml
  say "== expert scaling (top-4, hidden 1024: constant active parameters)"
  base_tps=""
  for e in 8 16 32 64 128; do
    out=$(build-gpu/moecore bench --config configs/bench/gpu_coarse.toml --warmup 1 --steps 3 --set model.num_experts=$e \
          --set model.top_k=4 --set model.expert_hidden=1024 2>&1)
    echo "$out" >> "$log"
    tps=$(echo "$out" | awk '/tokens\/s \(median\)/ {print $3}')
    [ -z "$base_tps" ] && base_tps=$tps
    cost=$(awk -v a="$base_tps" -v b="$tps" 'BEGIN {if (a > 0 && b > 0) printf "%+.1f%%", 100 * (a / b - 1); else print "?"}')
    table+=("$(printf '%-28s %-34s %9s   tokens/s; cost vs 8 experts %s' "expert scaling" "$e experts top-4" "${tps:-failed}" "$cost")")
  done
fi

# ---------------------------------------------------------------- the table
say ""
say "== scripts/gpu_check.sh $* on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) ($(date -u +%F))"
say "build: $build_s s; tests: $tests_line; total $(elapsed)"
printf '%-28s %-34s %9s   %s\n' "measurement" "shape / config" "value" "note" | tee -a "$log"
for l in "${table[@]}"; do say "$l"; done
