# shellcheck shell=bash
# Readers of moecore's output for scripts/gpu_check.sh (sourced), kept apart so a host test
# (tests/scripts/gpu_check_test.sh) checks them on saved output without a GPU.

# The cuBLAS-best dense rate (TFLOP/s) of a `moecore bench --kernels` list: rows are
# "kernel | shape | TFLOP/s | note" (src/kernels/cuda/bench_rows.h), so a label longer than its column
# moves no field.
kernel_ceiling() {  # $1 = the list's file
  awk -F' [|] ' '$1 ~ /cuBLAS best/ {v = $3 + 0; if (v > 0) {print v; exit}}' "$1"
}

# Fields of one `moecore bench` run's output (read from stdin).
bench_tokens_per_s() { awk '/^tokens\/s \(median\):/ {print $3; exit}'; }
bench_gflops() { awk '/^model GFLOP\/s:/ {print $3; exit}'; }
bench_mfu() { sed -n 's/.*  MFU: \([0-9.]*\)% of .*/\1/p' | head -n 1; }
bench_peak() { sed -n 's/.*  MFU: [0-9.]*% of \(.*\)$/\1/p' | head -n 1; }  # "989400.0 GFLOP/s (datasheet: ...)"
bench_device_mib() { awk '/^peak device memory:/ {print $4; exit}'; }
bench_estimate_mib() { awk '/^peak device memory:/ {print $7; exit}'; }
bench_paths() { sed -n 's/^kernel paths (calls in the timed steps): //p' | head -n 1; }
bench_setup_s() { sed -n 's/^setup: \([0-9.]*\) s .*/\1/p' | head -n 1; }

# Parameters of a config, from `moecore config` (runs anywhere: no backend is made).
config_params() {  # $1 = moecore binary, then the config's arguments
  local bin=$1; shift
  "$bin" config "$@" 2>/dev/null | sed -n 's/^# parameters: //p' | head -n 1
}

# The build's compile times from ninja's log: "<sum of the steps' seconds> <longest step's seconds>",
# each output's last build only (the log keeps every build): the sum is the work, the longest the
# floor on any core count. $2: an awk regex of outputs to leave out (e.g. tests/).
ninja_work() {  # $1 = build folder
  awk -F'\t' -v skip="${2:-^$}" 'NR > 1 && $4 !~ skip {d[$4] = ($2 - $1) / 1000}
    END {for (o in d) {s += d[o]; if (d[o] > m) m = d[o]} printf "%.0f %.0f\n", s, m}' "$1/.ninja_log"
}

# key=value lines of a file (cmake/gpu_check_estimates.txt): the value of $2, or nothing.
estimate() { sed -n "s/^$2=//p" "$1" 2>/dev/null | head -n 1; }
