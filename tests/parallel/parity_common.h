// Distributed-vs-single-process parity: the same global batches trained by one process (run
// locally on every rank, no communication) and by a layout of ranks, compared per step (loss,
// grad norm) and at the end (every parameter this rank holds against the same slice of the
// single-process parameter).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "config/config.h"
#include "parallel/process_groups.h"

namespace moe {
class Trainer;
struct StepResult;
}

namespace moe::test {

struct RunResult {
  std::vector<double> total, grad_norm;
  std::vector<bool> clipped;
  std::map<std::string, std::vector<double>> params;  // this rank's slice of each parameter
  std::map<std::string, int64_t> global_begin;       // where that slice starts in the whole tensor
  uint64_t dense_hash = 0;                            // FNV-1a of the dense parameter region
};

// Learned routing with the load-balancing loss, router z-loss and loss-free bias on, clipping that
// triggers, micro-batches with unequal loss-token counts; 4 layers (one dense), 8 experts, top-2.
Config parity_config();
// Global batch of step s (batch_size x seq_len ids and labels; labels < 0 vary per row).
void parity_batch(const Config& c, int64_t step, std::vector<int32_t>& ids, std::vector<int32_t>& labels);
// One step of `trainer` on the global parity batch of step `step` (its groups pick the rows).
StepResult parity_step(Trainer& trainer, const Config& c, int64_t step);
// compute: f64 (ref backend) or f32 (cpu backend).
RunResult run_single(const Config& c, DType compute);
// groups: built from world for the layout in c.parallel.
RunResult run_distributed(const Config& c, ProcessGroups& groups, DType compute);
// Steps [from, to) of the parity batches on this trainer (its groups pick the rows), appended.
void train_steps(Trainer& trainer, int64_t from, int64_t to, RunResult& out);
// This rank's parameters and the dense-region hash into out.
void collect_params(Trainer& trainer, RunResult& out);
// Per-step loss and grad norm and every held parameter within rel_tol (max|a-b|/max|b| per
// tensor); bitwise when rel_tol == 0.
void expect_parity(const RunResult& dist, const RunResult& single, double rel_tol);

}  // namespace moe::test
