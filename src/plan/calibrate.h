// `moecore bench --calibrate`: this machine measured with micro-benchmarks only (no training
// step): dense GEMMs by size (forward, data and weight gradient), grouped expert GEMMs by rows
// per expert, attention forward + backward at the config's shape, a streaming elementwise op, and
// all-reduces by size across the ranks it runs on. The result is a cluster file (plan/hardware.h)
// whose measured numbers cite this run; `moecore plan --cluster FILE` then predicts from it.
#pragma once

#include <ostream>
#include <string>

#include "config/config.h"
#include "kernels/cpu/fma_peak.h"
#include "parallel/communicator.h"

namespace moe {

struct CalibrateOptions {
  std::string base;         // preset or file whose other numbers are kept ("" = cpu, or cpu-core with ranks)
  double min_seconds = 0.1;  // each measurement repeats until it lasts this long, then twice more: the fastest round counts
};

// The host backends' measured peaks (kernels/cpu/fma_peak.h) on the run's threads (train.threads,
// or all), summed over the world's ranks, all measuring at once (uncached when several: each
// measures its share of shared cores). Collective when world has several ranks.
cpu::FmaPeak ranks_fma_peak(const Config& config, Communicator* world);

// Collective under mpirun (every rank measures at once, so shared memory bandwidth and cores are
// contended as in training); returns the cluster file's text (the same on every rank).
std::string calibrate_machine(const Config& config, const CalibrateOptions& options, std::ostream& log);

}  // namespace moe
