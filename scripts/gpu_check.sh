#!/usr/bin/env bash
# One script for a GPU machine: build the CUDA backend there, run the gpu tests and the benchmarks,
# print one table. Works offline on a machine with nvcc 13, g++, CMake, ninja and CUDA libraries
# (the toolkit's, or PyTorch's nvidia-* wheels) but none of our Debian packages: it takes from the
# working tree the header wheels (.cache/wheels: scripts/cuda_headers.sh) and the Debian packages
# (.cache/debs: scripts/gpu_debs.sh), unpacked into .cache/sysroot. Carry .cache/wheels and
# .cache/debs (about 40 MiB). Each part fits a 5-minute command on one H200 with 16 host cores,
# from an empty build folder (a second machine may be another one):
#
#   scripts/gpu_check.sh --tests    build, the gpu tests (CUTLASS and bench-critical ones first)
#   scripts/gpu_check.sh --bench    build moecore, the kernel rates, training steps, expert scaling
#   scripts/gpu_check.sh            both
#   scripts/gpu_check.sh --profile  build moecore, then Nsight Compute over two steps of the OLMoE
#                                   shape with 2 layers: each kernel's device time, largest first
#                                   (tools/ncu_kernel_table.py)
#   scripts/gpu_check.sh --dry-run  configure and build only, no GPU needed; prints each part's
#                                   estimate (scripts/gpu_dry_run.sh runs it against the sysroot
#                                   alone; --record writes the estimates to cmake/gpu_check_estimates.txt)
#
# --out DIR (default build-gpu): the log (gpu_check.log, written as it goes) and the table
# (table.txt, a row as each is measured) land there, so a command stopped at its time limit still
# returns what it measured. --budget S (default 280): parts that would not finish in what is left
# are skipped, saying so. Every test's time-out is 240 s.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=all
out="build-gpu"
budget=280
record=0
while (($#)); do
  case "$1" in
    --tests) mode=tests ;;
    --bench) mode=bench ;;
    --dry-run) mode=dry ;;
    --profile) mode=profile ;;
    --record) record=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --out=*) out=${1#--out=} ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--tests | --bench | --profile | --dry-run [--record]] [--out DIR] [--budget S]" >&2; exit 2 ;;
  esac
  shift
done
build=${MOE_GPU_BUILD_DIR:-build-gpu}
test_timeout=240
t_start=$(date +%s)
jobs=$(nproc)
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
table=$out/table.txt
: > "$log"
: > "$table"
# shellcheck source=scripts/gpu_check_lib.sh
. scripts/gpu_check_lib.sh
estimates=cmake/gpu_check_estimates.txt
say() { echo "$@" | tee -a "$log"; }
elapsed() { echo $(( $(date +%s) - t_start )); }
left() { echo $(( budget - $(elapsed) )); }
# A row of the table: printed and saved as soon as it is measured.
row() {  # measurement, shape / config, value, note
  local line
  line=$(printf '%-30s | %-34s | %9s | %s' "$1" "$2" "$3" "$4")
  echo "$line" >> "$table"
  say "$line"
}
row "measurement" "shape / config" "value" "note (estimate: from $estimates)"

# ---------------------------------------------------------------- what this machine has
say "== versions"
have() { command -v "$1" >/dev/null 2>&1; }
have nvcc || { say "no nvcc on PATH: nothing to build"; exit 1; }
say "nvcc: $(nvcc --version | tail -n 1)"
say "g++: $(g++ --version | head -n 1)"
say "cmake: $(cmake --version | head -n 1), ninja $(ninja --version 2>/dev/null || echo missing)"
say "host: $jobs cores, $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')"
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
nvrtc_lib=$(find_lib nvrtc)  # cuDNN's runtime-compiled attention engines need it
rt_lib=$(find_lib cudart)
cupti_lib=$(find_lib cupti); cupti_inc=$(find_header cupti.h)
[ -z "$cupti_lib" ] && [ -e "$cuda_root/extras/CUPTI/lib64/libcupti.so" ] && cupti_lib=$cuda_root/extras/CUPTI/lib64/libcupti.so
[ -z "$cupti_inc" ] && [ -e "$cuda_root/extras/CUPTI/include/cupti.h" ] && cupti_inc=$cuda_root/extras/CUPTI/include
[ -n "$lt_inc" ] && say "cuBLAS: $(header_version "$lt_inc/cublas_api.h" CUBLAS_VER_MAJOR CUBLAS_VER_MINOR CUBLAS_VER_PATCH) ($lt_lib)" || say "cuBLAS: MISSING"
[ -n "$cudnn_inc" ] && say "cuDNN: $(header_version "$cudnn_inc/cudnn_version.h" CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL) (${cudnn_lib:-library not found: attention on our kernel})" || say "cuDNN: missing (attention on our kernel)"
say "NVRTC: ${nvrtc_lib:-not found: cuDNN may refuse its attention graphs, then ours runs and the rows say so}"
[ -n "$nccl_inc" ] && say "NCCL: $(header_version "$nccl_inc/nccl.h" NCCL_MAJOR NCCL_MINOR NCCL_PATCH) ($nccl_lib)" || say "NCCL: MISSING"
[ -n "$cupti_lib" ] && [ -n "$cupti_inc" ] && say "CUPTI: $cupti_lib" || say "CUPTI: missing (its test reports Skipped)"
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$gpu" ] && say "GPU: $gpu"
if [ -z "$lt_lib" ] || [ -z "$lt_inc" ] || [ -z "$nccl_lib" ] || [ -z "$nccl_inc" ]; then
  say "cuBLASLt or NCCL is missing: the CUDA backend cannot be built here"; exit 1
fi

# ---------------------------------------------------------------- build dependencies
debs=${MOE_GPU_DEBS:-.cache/debs}           # the packages carried (scripts/gpu_debs.sh)
sysroot=${MOE_GPU_SYSROOT:-$root/.cache/sysroot}
need_sysroot=${MOE_GPU_CHECK_SYSROOT:-}  # 1 forces the unpacked packages (scripts/gpu_dry_run.sh)
if [ -z "$need_sysroot" ]; then
  need_sysroot=1
  [ -e /usr/include/dnnl.hpp ] && [ -e /usr/include/toml++/toml.h ] && [ -d /usr/lib/x86_64-linux-gnu/openmpi/include ] \
    && [ -d /usr/include/CLI ] && [ -d /usr/include/gtest ] && [ -e /usr/include/CL/cl.h ] && need_sysroot=0
fi
if [ "$need_sysroot" = 1 ]; then
  if [ "$(cat "$sysroot/.stamp" 2>/dev/null)" != "$(ls "$debs" 2>/dev/null)" ]; then
    ls "$debs"/*.deb >/dev/null 2>&1 || { say "no $debs: run scripts/gpu_debs.sh on a machine with network and carry it"; exit 1; }
    rm -rf "$sysroot"; mkdir -p "$sysroot"
    for d in "$debs"/*.deb; do
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
    ls "$debs" > "$sysroot/.stamp"
  fi
  say "build dependencies: Debian packages of $debs unpacked in $sysroot ($(ls "$debs" | wc -l) packages)"
  export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  sys_inc="-isystem $sysroot/usr/include"
  sys_lib="$sysroot/usr/lib/x86_64-linux-gnu"
  # (oneDNN's config finds OpenCL, which it requires, through CMAKE_PREFIX_PATH like the rest.)
  mpi_hints=(-DMPI_SKIP_COMPILER_WRAPPER=ON -DMPI_C_HEADER_DIR="$sys_lib/openmpi/include" -DMPI_C_LIB_NAMES=mpi
             -DMPI_mpi_LIBRARY="$sys_lib/openmpi/lib/libmpi.so" -DMPIEXEC_EXECUTABLE="$sysroot/usr/bin/orterun")
  export OPAL_PREFIX="$sysroot/usr"  # Open MPI finds its plugins and help files under the sysroot
else
  say "build dependencies: the system's"
  sys_inc=""; sys_lib=""; mpi_hints=()
fi
"${MOE_CUDA_HEADERS_SCRIPT:-scripts/cuda_headers.sh}" .cache/wheels >>"$log" 2>&1 || { say "CUTLASS / cuDNN frontend headers: no wheels in .cache/wheels"; exit 1; }
lib_dirs=""
for l in "$lt_lib" "$nccl_lib" "$rt_lib" "$cupti_lib" "$cudnn_lib" "$nvrtc_lib"; do
  [ -z "$l" ] && continue
  d=$(dirname "$l")
  [[ ":$lib_dirs:" == *":$d:"* ]] || lib_dirs+="${lib_dirs:+:}$d"
done
export LD_LIBRARY_PATH="${sys_lib:+$sys_lib:}$lib_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---------------------------------------------------------------- estimates (cmake/gpu_check_estimates.txt)
# The margin: the first H200 machines (16-core Xeon hosts) built in 98-128 s what this formula
# with 1.15 put at 91 s (their longest step is slower than this machine's), so 1.4.
est_build() {  # seconds on $jobs cores: the work spread over them, never below the longest step
  local cpu longest
  cpu=$(estimate "$estimates" "build_${1}_cpu_s"); longest=$(estimate "$estimates" "build_${1}_longest_s")
  [ -n "$cpu" ] && awk -v c="$cpu" -v l="$longest" -v j="$jobs" 'BEGIN {v = c / j; if (l > v) v = l; printf "%.0f", v * 1.4}'
}
est_setup() {  # $1 parameters -> seconds of the trainer's setup on $jobs host threads
  local ns
  ns=$(estimate "$estimates" init_ns_per_param_thread)
  [ -n "$ns" ] && [ -n "$1" ] && awk -v n="$ns" -v p="$1" -v j="$jobs" 'BEGIN {printf "%.1f", n * 1e-9 * p / j}'
}

# ---------------------------------------------------------------- build
case $mode in
  tests) targets=(moecore kernels_test model_test gpu_test); est_key=tests ;;
  bench|profile) targets=(moecore); est_key=bench ;;
  *) targets=(moecore kernels_test model_test gpu_test); est_key=tests ;;
esac
say "== build ($build, $jobs jobs: ${targets[*]})"
t0=$(date +%s)
extra_inc="$sys_inc -isystem $lt_inc -isystem $nccl_inc${cupti_inc:+ -isystem $cupti_inc}"
if [ ! -f "$build/build.ninja" ]; then
  # Warnings stay visible but are not errors here: this machine's compiler may be newer than
  # Debian 12's (g++ 13 has warnings ours does not), and the run must not stop on one.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_BUILD_BENCH=OFF -DMOE_WERROR=OFF \
    -DCMAKE_CXX_FLAGS="$extra_inc" -DCMAKE_CUDA_FLAGS="$extra_inc" -DCUDA_cublasLt_LIBRARY="$lt_lib" \
    ${rt_lib:+-DCUDA_cudart_LIBRARY="$rt_lib"} ${cupti_lib:+-DMOE_CUPTI_LIBRARY="$cupti_lib"} ${cudnn_inc:+-DMOE_CUDNN_INCLUDE="$cudnn_inc"} \
    -DCMAKE_BUILD_RPATH="${sys_lib:+$sys_lib;}${lib_dirs//:/;}" "${mpi_hints[@]}" >>"$log" 2>&1 \
    || { tail -n 30 "$log"; say "configure failed (log: $log)"; exit 1; }
fi
say "configured in $(( $(date +%s) - t0 )) s"
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >>"$log" 2>&1 \
  || { grep -E "error|FAILED" "$log" | head -n 30; say "build failed (log: $log)"; exit 1; }
build_s=$(( $(date +%s) - t0 ))
say "compiler warnings: $(grep -cE "warning:" "$log") (in the log)"
row "build (${targets[*]})" "$jobs cores" "$build_s s" "estimate $(est_build "$est_key" || true) s"
if [ $mode = dry ]; then
  read -r work longest < <(ninja_work "$build")
  say "dry run: built in $build_s s on $jobs cores: $work s of compile work, longest step $longest s ($(elapsed) s in all)"
  # The rate of the trainer's setup (allocation, parameter init, plans) per parameter and host
  # thread, on a config large enough (63 M parameters) that the fixed costs do not count.
  setup_out=$("$build/moecore" bench --config configs/bench/olmoe_compat.toml --warmup 0 --steps 1 --set train.backend=cpu 2>&1)
  setup=$(echo "$setup_out" | bench_setup_s)
  params=$(echo "$setup_out" | sed -n 's/^setup: .* init of \([0-9]*\) parameters on \([0-9]*\) host.*/\1 \2/p')
  ns=$(awk -v s="$setup" -v p="${params% *}" -v t="${params#* }" 'BEGIN {if (p > 0) printf "%.1f", s * 1e9 * t / p}')
  say "setup rate here: $setup s for ${params% *} parameters on ${params#* } threads = $ns ns per parameter per thread"
  if [ $record = 1 ]; then
    bench_work=$(ninja_work "$build" 'tests/')
    {
      echo "# scripts/gpu_check.sh --dry-run --record, $(date -u +%F), $jobs cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
      echo "# build_*: seconds of compile work summed over the steps, and the longest step (a fresh build)"
      echo "build_tests_cpu_s=$work"
      echo "build_tests_longest_s=$longest"
      echo "build_bench_cpu_s=${bench_work% *}"
      echo "build_bench_longest_s=${bench_work#* }"
      echo "# the trainer's setup (allocation, parameter init, plans), host seconds per parameter per thread"
      echo "init_ns_per_param_thread=$ns"
    } > "$estimates"
    say "estimates written to $estimates"
  fi
  say "== estimates for a 16-core GPU host"
  jobs=16
  say "build --tests: $(est_build tests) s; build --bench: $(est_build bench) s"
  for cfg in configs/bench/gpu_olmoe.toml configs/bench/gpu_coarse.toml; do
    p=$(config_params "$build/moecore" --config "$cfg")
    say "setup $(basename "$cfg"): $p parameters, $(est_setup "$p") s"
  done
  for e in 8 64 128; do
    p=$(config_params "$build/moecore" --config configs/bench/gpu_coarse.toml --set model.num_experts=$e --set model.top_k=4 \
        --set model.expert_hidden=1024 --set model.n_layers=2)
    say "setup expert scaling E=$e (2 layers): $p parameters, $(est_setup "$p") s"
  done
  exit 0
fi

# ---------------------------------------------------------------- tests
tests_line="not run"
if [ $mode = all ] || [ $mode = tests ]; then
  say "== gpu tests (time-out $test_timeout s each)"
  t0=$(date +%s)
  # The tensor-core grouped GEMMs, attention and whole steps first: what the bench depends on.
  first='Gemm|Attention|GpuTrain|GpuKjv|Cupti|CudaGraph'
  ran=0
  for part in first rest; do
    [ "$(left)" -le 10 ] && { say "tests ($part): skipped, $(left) s of the budget left"; break; }
    if [ $part = first ]; then sel=(-R "$first"); else sel=(-E "$first"); fi
    timeout "$(left)" ctest --test-dir "$build" -L gpu "${sel[@]}" -j 4 --timeout "$test_timeout" --output-on-failure \
      > "$out/gpu_tests_$part.log" 2>&1
    grep -E "tests passed|Failed|\*\*\*Exception|Timeout|Not Run" "$out/gpu_tests_$part.log" | tail -n 25 | tee -a "$log"
    line=$(grep -E "tests passed" "$out/gpu_tests_$part.log" | tail -n 1)
    row "gpu tests ($part)" "ctest -L gpu ${sel[*]}" "${line%%,*}" "${line#*, }"
    ran=1
  done
  [ $ran = 1 ] && tests_line="$(( $(date +%s) - t0 )) s"
fi

# ---------------------------------------------------------------- bench
if [ $mode = all ] || [ $mode = bench ]; then
  say "== kernels"
  kernels=$out/kernels.txt
  : > "$kernels"
  if [ "$(left)" -gt 30 ]; then
    # Each row as it is measured (the kernel bench flushes them).
    timeout "$(( $(left) - 20 ))" "$build/moecore" bench --kernels 2>&1 | while IFS= read -r l; do
      echo "$l" >> "$kernels"
      case "$l" in kernel*) ;; *) echo "$l" >> "$table"; say "$l" ;; esac
    done
  else
    say "kernels: skipped, $(left) s of the budget left"
  fi
  ceiling=$(kernel_ceiling "$kernels")
  bench_tps=""
  bench_row() {  # $1 label, $2 config, rest: --set overrides; sets bench_tps
    local label=$1 cfg=$2; shift 2
    local params est
    bench_tps=""
    params=$(config_params "$build/moecore" --config "$cfg" "$@")
    est=$(est_setup "$params")
    if [ "$(left)" -le 20 ]; then
      row "step $label" "$(basename "$cfg")" "skipped" "$(left) s of the budget left; setup estimate ${est:-?} s"
      return
    fi
    local o
    o=$(timeout "$(( $(left) - 10 ))" "$build/moecore" bench --config "$cfg" --warmup 2 --steps 4 "$@" 2>&1)
    echo "$o" >> "$log"
    local tps mfu gflops mem memest setup paths mfu_ceiling="n/a"
    tps=$(echo "$o" | bench_tokens_per_s); mfu=$(echo "$o" | bench_mfu); gflops=$(echo "$o" | bench_gflops)
    mem=$(echo "$o" | bench_device_mib); memest=$(echo "$o" | bench_estimate_mib); setup=$(echo "$o" | bench_setup_s)
    paths=$(echo "$o" | bench_paths)
    [ -n "$ceiling" ] && [ -n "$gflops" ] && mfu_ceiling=$(awk -v g="$gflops" -v c="$ceiling" 'BEGIN {printf "%.1f%%", 100 * g / 1000 / c}')
    row "step $label" "$(basename "$cfg") $*" "${tps:-failed}" \
      "tokens/s; MFU ${mfu:-?}% of $(echo "$o" | bench_peak), $mfu_ceiling of the measured GEMM ceiling ${ceiling:-?} TFLOP/s; device ${mem:-?} MiB (estimate ${memest:-?}); setup ${setup:-?} s (estimate ${est:-?} s for $params parameters); ${paths:-paths ?}"
    [ -z "$tps" ] && echo "$o" | tail -n 5 | tee -a "$log"
    bench_tps=$tps
  }
  say "== steps"
  bench_row "OLMoE-shaped 64x top-8" configs/bench/gpu_olmoe.toml
  bench_row "coarse 8x top-2" configs/bench/gpu_coarse.toml
  say "== expert scaling (top-4, hidden 1024: constant active parameters; 2 layers)"
  base=""
  for e in 8 64 128; do
    bench_row "expert scaling E=$e" configs/bench/gpu_coarse.toml --set model.num_experts=$e --set model.top_k=4 \
      --set model.expert_hidden=1024 --set model.n_layers=2
    tps=$bench_tps
    [ -z "$base" ] && base=$tps
    cost=$(awk -v a="$base" -v b="$tps" 'BEGIN {if (a > 0 && b > 0) printf "%+.1f%%", 100 * (a / b - 1); else print "?"}')
    row "expert scaling cost" "$e experts vs 8, top-4" "$cost" "step time against 8 experts' (same active parameters)"
  done
fi

# ---------------------------------------------------------------- profile
if [ $mode = profile ]; then
  say "== kernel profile (Nsight Compute, gpu__time_duration.sum; kernels serialized)"
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  if [ -z "$ncu_bin" ]; then
    say "profile: no ncu on this machine"
  else
    prof_args=(--config configs/bench/gpu_olmoe.toml --set model.n_layers=2 --warmup 1 --steps 1)
    say "profile: $ncu_bin over moecore bench ${prof_args[*]}"
    # --clock-control none: the clocks as the card sets them (never changed from here); caches
    # not flushed between kernels, as in a real step.
    timeout "$(( $(left) > 30 ? $(left) - 15 : 15 ))" "$ncu_bin" --clock-control none --cache-control none --metrics gpu__time_duration.sum --launch-count 8000 --csv \
      "$build/moecore" bench "${prof_args[@]}" > "$out/ncu.csv" 2>> "$log"
    say "profile: ncu exit $? after $(elapsed) s"
    python3 tools/ncu_kernel_table.py "$out/ncu.csv" --steps 2 --top 40 2>&1 | tee -a "$log" | tee "$out/kernels_by_time.txt"
  fi
fi

# ---------------------------------------------------------------- the table
say ""
say "== scripts/gpu_check.sh ($mode) on ${gpu:-no GPU} ($(date -u +%F)), $jobs host cores"
say "build: $build_s s; tests: $tests_line; total $(elapsed) s of the $budget s budget"
cat "$table" | tee -a "$log"
