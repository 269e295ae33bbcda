// The rows `moecore bench --kernels` prints and scripts/gpu_check.sh reads back
// (scripts/gpu_check_lib.sh): "kernel | shape | TFLOP/s | note", the columns padded for the eye
// and separated by " | " so that a label longer than its column shifts nothing a reader parses.
// Plain C++ (the CUDA kernel bench writes them; a host test parses them with the script).
#pragma once

#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>

namespace moe {

inline void kernel_bench_row(std::ostream& os, const std::string& kernel, const std::string& shape, const std::string& value,
                             const std::string& note) {
  os << std::left << std::setw(30) << kernel << " | " << std::setw(34) << shape << " | " << std::right << std::setw(9)
     << value << " | " << note << std::endl;  // flushed: a time-out keeps the rows measured so far
}

inline void kernel_bench_row(std::ostream& os, const std::string& kernel, const std::string& shape, double tflops,
                             const std::string& note) {
  std::ostringstream v;
  v << std::fixed << std::setprecision(1) << tflops;
  kernel_bench_row(os, kernel, shape, v.str(), note);
}

}  // namespace moe
