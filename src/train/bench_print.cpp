// `moecore bench`'s printed report (bench.h): one configuration's throughput, MFU, phases, ops,
// allocations and memory, and two configurations' steps against each other (--versus).
#include "train/bench.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"

namespace moe {

namespace {
// What the grouped GEMMs were timed on: a router that sends every token to the same top_k
// experts (load num_experts / top_k) leaves them top_k dense GEMMs, which run faster than the
// num_experts smaller ones of an even load. The bench's random ids and a high learning rate head
// there within a few steps (olmoe_compat's default steps: 5-8 of a possible 8; PyTorch's OLMoE on
// the same ids: 7.7-8 by its eighth step).
void print_expert_load(const Config& config, const BenchResult& r, std::ostream& os) {
  if (r.max_load.empty()) return;
  const ModelConfig& m = config.model;
  const double collapsed = static_cast<double>(m.num_experts) / static_cast<double>(m.top_k);
  double worst = 0;
  os << std::setprecision(2) << "expert load (tokens of the busiest expert / the mean, median of the timed steps, "
     << "per MoE layer):";
  for (double l : r.max_load) os << " " << l, worst = std::max(worst, l);
  os << " (1 = even; " << collapsed << " = every token on the same " << m.top_k << " of " << m.num_experts
     << " experts)\n";
  if (worst >= 0.9 * collapsed)
    os << "  a router near collapse: a layer sent nearly every token to the same " << m.top_k
       << " experts, whose grouped GEMMs then run about as " << m.top_k << " dense ones (an even load's "
       << m.num_experts << " smaller ones run slower)\n";
}

// With --ops: every op that ran, longest first (the phases above group several of them).
void print_op_times(const BenchResult& r, std::ostream& os) {
  std::vector<size_t> ran;
  double total = 0;
  for (size_t k = 0; k < OpTimes::kOps; ++k)
    if (r.op_times.calls[k] > 0) ran.push_back(k), total += r.op_times.seconds[k];
  if (ran.empty()) return;
  std::sort(ran.begin(), ran.end(),
            [&](size_t a, size_t b) { return r.op_times.seconds[a] > r.op_times.seconds[b]; });
  os << "ops (mean per timed step, wall time inside each cpu backend call; " << std::setprecision(1)
     << 100 * total / r.mean_step_s << "% of the step):\n";
  os << "  op                           ms/step  calls/step  % of step\n";
  for (const size_t k : ran)
    os << "  " << std::left << std::setw(27) << op_name(static_cast<OpId>(k)) << std::right << std::setw(10)
       << std::setprecision(2) << r.op_times.seconds[k] * 1e3 << std::setw(12) << std::setprecision(1)
       << r.op_times.calls[k] << std::setw(11) << 100 * r.op_times.seconds[k] / r.mean_step_s << "\n";
}
}  // namespace

void print_bench(const Config& config, const BenchResult& r, std::ostream& os) {
  const auto flags = os.flags();
  os << std::fixed;
  os << "precision " << config.train.precision << ", " << r.tokens_per_step << " tokens/step ("
     << config.train.batch_size << " x " << config.train.seq_len << ", micro-batch " << config.train.micro_batch_size
     << "), " << r.step_s.size() << " timed steps\n";
  os << std::setprecision(4) << "step time: median " << r.median_step_s << " s, mean " << r.mean_step_s << " s\n";
  os << std::setprecision(3) << "step times (s):";
  for (double t : r.step_s) os << " " << t;
  // Forward + backward of all micro-batches: each step less its optimizer phase (grad norm,
  // clipping, AdamW, bf16 refresh). Per step, so a noisy machine's best step can be picked.
  os << "\nfwd+bwd times (s):";
  for (double t : r.fwd_bwd_s) os << " " << t;
  // CPU seconds of all threads: robust to other processes on the cores (see phase_timer.h).
  os << "\ncpu times (s):";
  for (double t : r.cpu_s) os << " " << t;
  os << "\ncpu fwd+bwd times (s):";
  for (double t : r.cpu_fwd_bwd_s) os << " " << t;
  // The wait policy moves both: passive wakes a sleeping thread at each parallel region (wall
  // time, ~10% of a fine_grained bf16 step), the default's spinning counts as CPU time.
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  os << "\nOMP_WAIT_POLICY: "
     << (wait && *wait ? wait : "unset (the OpenMP runtime's default: waiting threads spin a while, then sleep)")
     << "\n";
  os << std::setprecision(0) << "tokens/s (median): " << r.tokens_per_s << "\n";
  print_expert_load(config, r, os);
  if (r.ranks > 1)
    os << "ranks: " << r.ranks << " (rank 0's phases; communication = time blocked in collectives), "
       << std::setprecision(2) << r.comm_bytes_per_step / 1e6 << " MB sent per step by rank 0\n";
  if (config.parallel.pp > 1)
    os << std::setprecision(4) << "pipeline bubble (rank 0, blocked in receives): " << r.pp_bubble_s << " s per step\n";
  os << std::setprecision(2) << "model FLOPs/token (causal): " << r.flops_per_token * 1e-6 << " M\n";
  os << std::setprecision(1) << "model GFLOP/s: " << r.tflops * 1e3 << "  MFU: " << r.mfu * 100 << "% of "
     << r.peak.tflops * 1e3 << " GFLOP/s (" << r.peak.source << ": " << r.peak.detail << ")\n";
  if (r.peak_now_tflops > 0)
    os << "MFU against the peak measured right after the timed steps: " << r.mfu_now * 100 << "% of "
       << r.peak_now_tflops * 1e3 << " GFLOP/s (this machine's speed as the steps ran; the line above "
       << "divides by the best measured here)\n";
  os << "phase breakdown (mean per timed step, exclusive):\n";
  double alone_total = 0;
  for (double a : r.alone.seconds) alone_total += a;
  const bool alone = alone_total > 0;
  os << "  phase          ms/step      %  cpu ms/step" << (r.alloc_steps > 0 ? "   allocs/step" : "")
     << (r.ranks == 1 ? "   GFLOP/s  % of peak" : "") << (alone ? "  alone GFLOP/s  of alone" : "") << "\n";
  for (int p = 1; p <= PhaseTimer::kNum; ++p) {
    const int idx = p % PhaseTimer::kNum;  // "other" last
    const double s = r.phase_s[static_cast<size_t>(idx)];
    os << "  " << std::left << std::setw(13) << phase_name(static_cast<Phase>(idx)) << std::right
       << std::setw(9) << std::setprecision(2) << s * 1e3 << std::setw(8) << std::setprecision(1)
       << 100 * s / r.mean_step_s << std::setw(13) << std::setprecision(2)
       << r.phase_cpu_s[static_cast<size_t>(idx)] * 1e3;
    if (r.alloc_steps > 0) os << std::setw(14) << r.phase_allocs[static_cast<size_t>(idx)];
    // Model FLOPs over the phase's time: where the step falls short of the peak (the attention
    // phase's include the causal products).
    const double flops = r.phase_flops[static_cast<size_t>(idx)];
    if (flops > 0 && s > 0)
      os << std::setw(10) << std::setprecision(1) << flops / s * 1e-9 << std::setw(11)
         << (r.peak.tflops > 0 ? 100 * flops / s / (r.peak.tflops * 1e12) : 0.0);
    // The same FLOPs over the time the phase's kernels take alone, and the share of that rate the
    // phase reached.
    const double a = r.alone.seconds[static_cast<size_t>(idx)];
    if (alone && a > 0 && flops > 0 && s > 0)
      os << std::setw(15) << std::setprecision(1) << flops / a * 1e-9 << std::setw(9) << std::setprecision(0)
         << 100 * a / s << "%";
    os << "\n";
  }
  os << std::setprecision(2) << "  sum           " << std::setw(9) << r.phase_sum_s * 1e3 << "  vs step " << r.mean_step_s * 1e3
     << " ms: " << r.phase_error * 100 << "% " << (r.phase_error <= 0.03 ? "(within 3%: ok)" : "(MORE THAN 3%)") << "\n";
  if (alone) {
    double phases = 0;
    for (size_t p = 0; p < r.alone.seconds.size(); ++p)
      if (r.alone.seconds[p] > 0) phases += r.phase_s[p];
    os << std::setprecision(1) << "kernels alone (--alone): each phase's GEMMs and attention kernels at the step's "
       << "shapes and expert loads, after the steps, each the median of 5 rounds: " << alone_total * 1e3
       << " ms per step against those phases' " << phases * 1e3 << " ms (" << std::setprecision(0)
       << 100 * alone_total / phases << "%)\n";
  } else if (!r.alone.not_measured.empty()) {
    os << "kernels alone (--alone): not measured (" << r.alone.not_measured << ")\n";
  }
  print_op_times(r, os);
  if (r.alloc_steps > 0)
    os << std::setprecision(1) << "heap allocations per step (operator new, steps 3-" << 2 + r.alloc_steps
       << "): " << r.allocs_per_step << "\n";
  if (r.alloc_steps > 0 && r.dnnl_allocs_per_step >= 0)
    os << "  inside oneDNN primitive execution: " << r.dnnl_allocs_per_step
       << "\n  outside oneDNN: " << r.allocs_per_step - r.dnnl_allocs_per_step << "\n";
  if (r.alloc_steps == 0)
    os << "heap allocations: not counted (no counter installed)\n";
  os << std::setprecision(1) << "host <-> device transfers per step (" << config.train.backend << " backend): "
     << r.to_host_per_step << " to host (" << std::setprecision(0) << r.to_host_bytes_per_step << " bytes), "
     << std::setprecision(1) << r.to_device_per_step << " to device (" << std::setprecision(0)
     << r.to_device_bytes_per_step << " bytes)\n";
  if (!r.kernel_paths.empty()) os << "kernel paths (calls in the timed steps): " << r.kernel_paths << "\n";
  if (r.setup_s > 0)
    os << std::setprecision(2) << "setup: " << r.setup_s << " s (allocation, parameter init of " << r.params
       << " parameters on " << r.host_threads << (r.host_threads == 1 ? " host thread" : " host threads") << ", plans)\n";
  os << std::setprecision(1) << "peak RSS: " << static_cast<double>(r.peak_rss_bytes) / (1 << 20) << " MiB\n";
  if (r.peak_device_mb > 0)
    os << "peak device memory: " << r.peak_device_mb << " MiB (estimate " << r.estimate_mb << " MiB + the backend's "
       << "fixed scratch and workspace: " << std::setprecision(0) << 100 * r.peak_device_mb / r.estimate_mb << "%)\n";
  os.flags(flags);
}

namespace {
// B's time per token over A's, less one, for each pair of timed steps: the median, min and max.
struct PairedChange {
  double median = 0, min = 0, max = 0;
};
PairedChange paired_change(const std::vector<double>& a, const std::vector<double>& b, double a_tokens, double b_tokens) {
  std::vector<double> change;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) change.push_back((b[i] / b_tokens) / (a[i] / a_tokens) - 1);
  const auto [lo, hi] = std::minmax_element(change.begin(), change.end());
  return {median(change), *lo, *hi};
}

// B - A per token as a share of A's step per token, for a part's mean seconds per step in A and B.
double step_share(const VersusResult& r, double sa, double sb) {
  const double ta = static_cast<double>(r.a.tokens_per_step), tb = static_cast<double>(r.b.tokens_per_step);
  return (sb / tb - sa / ta) / (r.a.mean_step_s / ta);
}

// One row of the by-phase and by-op tables: the name, A's and B's ms per step, the share.
void print_change_row(std::ostream& os, const char* name, int width, double sa, double sb, double share) {
  os << "  " << std::left << std::setw(width) << name << std::right << std::noshowpos << std::setw(9) << sa * 1e3
     << " ->" << std::setw(9) << sb * 1e3 << std::showpos << std::setw(8) << 100 * share << "%\n";
}

// With --ops: each op's row, largest change first; ops that moved less than 0.05% of A's step are
// counted, not listed. Means of the alternated steps: the ops of one pair ran seconds apart.
void print_versus_ops(const VersusResult& r, std::ostream& os) {
  std::vector<std::pair<double, size_t>> moved;  // (step_share, op)
  size_t small = 0;
  for (size_t k = 0; k < OpTimes::kOps; ++k) {
    if (r.a.op_times.calls[k] == 0 && r.b.op_times.calls[k] == 0) continue;
    const double share = step_share(r, r.a.op_times.seconds[k], r.b.op_times.seconds[k]);
    if (std::abs(share) < 5e-4) ++small;
    else moved.emplace_back(share, k);
  }
  if (moved.empty() && small == 0) return;
  std::sort(moved.begin(), moved.end(), [](const auto& x, const auto& y) { return std::abs(x.first) > std::abs(y.first); });
  os << "by op: A -> B, ms per timed step (mean), and B - A per token as % of A's step per token:\n";
  for (const auto& [share, k] : moved)
    print_change_row(os, op_name(static_cast<OpId>(k)), 27, r.a.op_times.seconds[k], r.b.op_times.seconds[k], share);
  if (small > 0) os << std::noshowpos << "  (" << small << " more ops moved less than 0.05% each)\n";
}
}  // namespace

void print_versus(const Config& a, const Config& b, const std::string& b_is, const VersusResult& r, std::ostream& os) {
  os << "== A: the configuration ==\n";
  print_bench(a, r.a, os);
  os << "== B: the configuration with " << b_is << " ==\n";
  print_bench(b, r.b, os);
  const auto flags = os.flags();
  const double ta = static_cast<double>(r.a.tokens_per_step), tb = static_cast<double>(r.b.tokens_per_step);
  os << "versus: B against A, each timed step paired with the other configuration's step of the same number, run "
     << "back to back (A B, B A, A B, ...: a machine whose speed drifts moves both); time per token, B / A - 1, the "
     << "median (min .. max) over " << std::min(r.a.step_s.size(), r.b.step_s.size()) << " pairs:\n"
     << std::fixed << std::showpos << std::setprecision(1);
  const struct {
    const char* name;
    const std::vector<double>& a;
    const std::vector<double>& b;
  } rows[] = {{"step (wall)", r.a.step_s, r.b.step_s},
              {"fwd+bwd (wall)", r.a.fwd_bwd_s, r.b.fwd_bwd_s},
              {"step (cpu)", r.a.cpu_s, r.b.cpu_s},
              {"fwd+bwd (cpu)", r.a.cpu_fwd_bwd_s, r.b.cpu_fwd_bwd_s}};
  for (const auto& row : rows) {
    const PairedChange c = paired_change(row.a, row.b, ta, tb);
    os << "  " << std::left << std::setw(16) << row.name << std::right << std::setw(7) << 100 * c.median << "%  ("
       << 100 * c.min << " .. " << 100 * c.max << ")\n";
  }
  // Where the difference goes: each phase's mean per token (means, not pairs: noisier), its
  // change as a share of A's step per token.
  os << "by phase: A -> B, ms per timed step (mean), and B - A per token as % of A's step per token:\n";
  for (int p = 1; p <= PhaseTimer::kNum; ++p) {
    const size_t idx = static_cast<size_t>(p % PhaseTimer::kNum);  // "other" last
    const double sa = r.a.phase_s[idx], sb = r.b.phase_s[idx];
    if (sa < 5e-5 && sb < 5e-5) continue;  // under 0.05 ms in both: not printed
    print_change_row(os, phase_name(static_cast<Phase>(idx)), 14, sa, sb, step_share(r, sa, sb));
  }
  print_versus_ops(r, os);
  os << std::noshowpos << "peak RSS above: the process's, both configurations together\n";
  os.flags(flags);
}

}  // namespace moe
