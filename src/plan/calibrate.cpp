#include "plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <unistd.h>
#include <fstream>
#include <string>
#include <iomanip>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kernels/random_tensor.h"
#include "parallel/communicator.h"
#include "plan/hardware.h"
#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moe {

namespace {

// Seconds per call of f: repeated (doubling) until the repetitions last min_s, then that many
// repetitions twice more, and the fastest of the three rounds kept (a shared machine only ever
// slows a round down; moecore bench's fastest step is compared with the plan the same way). Every
// rank starts each round together and takes the same decisions from the slowest rank's time
// (which sets the pace, as in a step), so all of them run the same collectives.
template <class F> double seconds_per_call(Backend& ops, Communicator& world, double min_s, std::vector<double>& spreads, F&& f) {
  f();  // warm-up: plans, packing buffers
  ops.synchronize();
  std::vector<double> all(static_cast<size_t>(world.size()));
  const auto round = [&](int64_t reps) {
    world.barrier();
    const Event a = ops.record();
    for (int64_t r = 0; r < reps; ++r) f();
    const Event b = ops.record();
    ops.wait(b);
    const double mine = ops.elapsed_seconds(a, b);
    world.all_gather(&mine, all.data(), 1, DType::kF64);
    return *std::max_element(all.begin(), all.end());
  };
  int64_t reps = 1;
  double best = round(reps);
  while (best < min_s && reps < (int64_t{1} << 20)) best = round(reps *= 2);
  double worst = best;
  for (int i = 0; i < 2; ++i) {
    const double t = round(reps);
    best = std::min(best, t);
    worst = std::max(worst, t);
  }
  spreads.push_back(worst / best - 1);  // for the error bars
  return best / static_cast<double>(reps);
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

// One calibration: the machine it measures through, the cluster it fills in (each number citing
// the run by tag), each measurement's spread, and the buffers of the one being taken.
struct Calibration {
  Backend& ops;
  Communicator& world;
  double min_seconds;
  std::ostream& log;
  Cluster c;
  std::string tag;
  bool talk = false;  // rank 0 writes the log
  std::vector<Buffer> keep;
  std::vector<double> spreads;  // (slowest - fastest) / fastest of each measurement's three rounds
  template <class F> double seconds(double min_s, F&& f) { return seconds_per_call(ops, world, min_s, spreads, f); }
};

// The peaks every efficiency below is a fraction of: on the host backends the FMA loops on each
// rank's threads, every rank at once (a rank's share of shared cores), averaged over the ranks;
// on a GPU its datasheet's. The base cluster's own peaks (another machine's) would clip every
// efficiency at 1 on a faster CPU.
void measure_peaks(Calibration& k, const Config& config) {
  Cluster& c = k.c;
  const int n = k.world.size();
#ifdef MOE_WITH_CUDA
  if (config.train.backend == "cuda") {
    c.device.fp32_flops = cuda_peak_tflops(false) * 1e12;
    c.device.bf16_flops = cuda_peak_tflops(true) * 1e12;
    MOE_CHECK(c.device.bf16_flops > 0, "bench --calibrate: no datasheet peak for this GPU (kernels/cuda/cuda_backend.cpp)");
    c.sources["device.fp32_tflops"] = c.sources["device.bf16_tflops"] = "datasheet: dense peak of this GPU (cuda_peak_tflops)";
  } else
#endif
  {
    const cpu::FmaPeak m = ranks_fma_peak(config, &k.world);
    c.device.fp32_flops = m.fp32_flops / n;
    c.device.bf16_flops = m.bf16_flops / n;
    const std::string how = std::to_string(m.threads) + " thread(s) per rank, " + std::to_string(n) + " rank(s) at once, mean";
    c.sources["device.fp32_tflops"] = k.tag + ": " + m.fp32_kernel + " register loop, " + how;
    c.sources["device.bf16_tflops"] = k.tag + ": " + m.bf16_kernel + " register loop, " + how;
  }
  if (k.talk) k.log << "peak: fp32 " << c.device.fp32_flops / 1e9 << " GFLOP/s, bf16 " << c.device.bf16_flops / 1e9
                    << " GFLOP/s per rank (" << c.sources["device.bf16_tflops"] << ")\n";
}

// What this process holds besides the model once its runtime is warm (code, libraries, OpenMP
// threads, oneDNN initialized, the communicator's buffers): measured after the first, smallest
// GEMM (its buffers are 0.3 MB), before larger kernels grow their scratch.
void measure_process_memory(Calibration& k) {
  double kib = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) kib = std::stod(line.substr(6));
  std::vector<double> all(static_cast<size_t>(k.world.size()));
  k.world.all_gather(&kib, all.data(), 1, DType::kF64);
  if (k.c.device.backend == "cpu" && kib > 0) {
    k.c.device.process_bytes = *std::max_element(all.begin(), all.end()) * 1024;
    k.c.sources["device.process_mib"] = k.tag + ": resident memory of a rank after one 64x256x256 GEMM (the largest of the ranks)";
  }
}

// Dense GEMMs: forward, data and weight gradient of one (M, N, K), as every linear layer runs.
void measure_gemm(Calibration& k, DType adt, double peak) {
  Backend& ops = k.ops;
  std::vector<Buffer>& keep = k.keep;
  Curve gemm;
  for (const auto& [M, N, K] : std::vector<std::array<int64_t, 3>>{{64, 256, 256}, {256, 512, 512}, {1024, 1024, 512},
                                                                   {2048, 2048, 1024}}) {
    const Tensor x = random_tensor(ops, keep, adt, {M, K}, 1), w = random_tensor(ops, keep, adt, {N, K}, 2);
    const Tensor dy = random_tensor(ops, keep, adt, {M, N}, 3);
    const Tensor y = random_tensor(ops, keep, DType::kF32, {M, N}, 4), dx = random_tensor(ops, keep, DType::kF32, {M, K}, 5);
    const Tensor dw = random_tensor(ops, keep, DType::kF32, {N, K}, 6);
    const double t = k.seconds(k.min_seconds, [&] {
      ops.linear_fwd(x, w, y, false);
      ops.linear_bwd_data(dy, w, dx, false);
      ops.linear_bwd_weight(dy, x, dw, true);
    });
    const double flops = 2.0 * static_cast<double>(M * N * K);
    const double eff = std::min(1.0, 3 * flops / t / peak);
    gemm.points.emplace_back(flops, eff);
    if (gemm.points.size() == 1) measure_process_memory(k);
    if (k.talk) k.log << "gemm " << M << "x" << N << "x" << K << ": " << 3 * flops / t / 1e9 << " GFLOP/s (" << 100 * eff << "% of peak)\n";
  }
  k.c.device.gemm_efficiency = gemm;
  k.c.sources["device.gemm_efficiency"] = k.tag + ": linear_fwd + bwd_data + bwd_weight at 64x256x256 .. 2048x2048x1024";
}

// Grouped expert GEMMs: 8 experts of the config's shape, by rows per expert, against the dense
// rate of a GEMM of the same total size (the curve measure_gemm took).
void measure_grouped(Calibration& k, const Config& config, DType adt, double peak) {
  Backend& ops = k.ops;
  std::vector<Buffer>& keep = k.keep;
  const Curve& gemm = k.c.device.gemm_efficiency;
  const int64_t D = config.model.d_model, F = config.model.expert_hidden, G = 8;
  Curve grouped;
  for (int64_t rows : {16, 64, 256, 1024}) {
    keep.clear();
    const int64_t R = G * rows;
    const Tensor x = random_tensor(ops, keep, adt, {R, D}, 7), w = random_tensor(ops, keep, adt, {G, F, D}, 8);
    const Tensor dy = random_tensor(ops, keep, adt, {R, F}, 9), y = random_tensor(ops, keep, DType::kF32, {R, F}, 10);
    const Tensor dx = random_tensor(ops, keep, DType::kF32, {R, D}, 11), dw = random_tensor(ops, keep, DType::kF32, {G, F, D}, 12);
    std::vector<int32_t> off(static_cast<size_t>(G + 1));
    for (int64_t e = 0; e <= G; ++e) off[static_cast<size_t>(e)] = static_cast<int32_t>(e * rows);
    keep.emplace_back(ops, off.size() * sizeof(int32_t));
    const Tensor offsets = keep.back().view(DType::kI32, {G + 1});
    ops.upload(off.data(), offsets);
    const double t = k.seconds(k.min_seconds, [&] {
      ops.grouped_linear_fwd(x, w, offsets, y);
      ops.grouped_linear_bwd_data(dy, w, offsets, dx);
      ops.grouped_linear_bwd_weight(dy, x, offsets, dw, true);
    });
    const double per = 2.0 * static_cast<double>(rows * F * D);
    const double rate = 3 * static_cast<double>(G) * per / t;
    const double eff = std::min(1.0, rate / (peak * gemm.at(static_cast<double>(G) * per)));
    grouped.points.emplace_back(static_cast<double>(rows), eff);
    if (k.talk) k.log << "grouped 8 x " << rows << " rows x " << F << "x" << D << ": " << rate / 1e9 << " GFLOP/s (" << 100 * eff << "% of dense)\n";
  }
  k.c.device.grouped_efficiency = grouped;
  k.c.sources["device.grouped_efficiency"] = k.tag + ": grouped_linear fwd + bwd_data + bwd_weight, 8 experts of " +
                                             std::to_string(F) + "x" + std::to_string(D) + ", 16 .. 1024 rows each";
}

// Attention at the config's shape: forward + backward against 3.5 x the forward's FLOPs.
void measure_attention(Calibration& k, const Config& config, bool bf16, double peak) {
  Backend& ops = k.ops;
  std::vector<Buffer>& keep = k.keep;
  Cluster& c = k.c;
  keep.clear();
  const int64_t B = config.train.micro_batch_size, S = config.train.seq_len, H = config.model.n_heads;
  const int64_t Gk = config.model.n_kv_heads, hd = config.model.hd();
  const Tensor q = random_tensor(ops, keep, DType::kF32, {B, S, H, hd}, 13), kt = random_tensor(ops, keep, DType::kF32, {B, S, Gk, hd}, 14);
  const Tensor v = random_tensor(ops, keep, DType::kF32, {B, S, Gk, hd}, 15), o = random_tensor(ops, keep, DType::kF32, {B, S, H, hd}, 16);
  const Tensor lse = random_tensor(ops, keep, DType::kF32, {B, H, S}, 17), dout = random_tensor(ops, keep, DType::kF32, {B, S, H, hd}, 18);
  const Tensor dq = random_tensor(ops, keep, DType::kF32, {B, S, H, hd}, 19), dk = random_tensor(ops, keep, DType::kF32, {B, S, Gk, hd}, 20);
  const Tensor dv = random_tensor(ops, keep, DType::kF32, {B, S, Gk, hd}, 21);
  ops.attention_fwd(q, kt, v, o, lse, Tensor(), bf16);
  const double t = k.seconds(k.min_seconds, [&] {
    ops.attention_fwd(q, kt, v, o, lse, Tensor(), bf16);
    ops.attention_bwd(dout, q, kt, v, o, lse, dq, dk, dv, Tensor(), bf16);
  });
  const double fwd = 4.0 * static_cast<double>(B * H * hd) * static_cast<double>(S) * static_cast<double>(S + 1) / 2;
  const double eff = std::min(1.0, 3.5 * fwd / t / peak);
  (bf16 ? c.device.attention_efficiency : c.device.attention_efficiency_fp32) = eff;
  c.sources[bf16 ? "device.attention_efficiency" : "device.attention_efficiency_fp32"] =
      k.tag + ": attention_fwd + attention_bwd at B " + std::to_string(B) + ", S " + std::to_string(S) + ", H " +
      std::to_string(H) + ", G " + std::to_string(Gk) + ", hd " + std::to_string(hd);
  if (k.talk) k.log << "attention: " << 3.5 * fwd / t / 1e9 << " GFLOP/s (" << 100 * eff << "% of peak)\n";
}

// Memory-bound: a streaming y += a x over 64 MiB per operand.
void measure_memory_rate(Calibration& k) {
  Cluster& c = k.c;
  k.keep.clear();
  const int64_t N = 16 << 20;
  const Tensor x = random_tensor(k.ops, k.keep, DType::kF32, {N}, 22), y = random_tensor(k.ops, k.keep, DType::kF32, {N}, 23);
  const double t = k.seconds(k.min_seconds, [&] { k.ops.axpy(1e-3, x, y); });
  c.device.memory_bytes_per_s = 12.0 * static_cast<double>(N) / t;
  c.device.memory_efficiency = 1;
  c.sources["device.memory_gbps"] = k.tag + ": axpy over 2 x 64 MiB (read x, read and write y)";
  c.sources["device.memory_efficiency"] = k.tag + ": 1 (memory_gbps is the measured streaming rate)";
  if (k.talk) k.log << "axpy: " << c.device.memory_bytes_per_s / 1e9 << " GB/s\n";
}

// Checkpoint writes: 128 MiB per rank, all ranks at once, fsync'd (as a save does), in the
// current directory.
void measure_storage(Calibration& k) {
  Communicator& world = k.world;
  const std::string path = ".moecore-calibrate-" + std::to_string(world.rank()) + ".tmp";
  std::vector<char> data(size_t{128} << 20, 'x');
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    MOE_CHECK(f, "bench --calibrate: cannot write ", path, " in the current directory");
    const bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size() && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
    std::fclose(f);
    std::remove(path.c_str());
    MOE_CHECK(ok, "bench --calibrate: writing ", path, " failed");
  }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<double> all(static_cast<size_t>(world.size()));
  world.all_gather(&t, all.data(), 1, DType::kF64);
  t = *std::max_element(all.begin(), all.end());
  k.c.device.storage_bytes_per_s = static_cast<double>(data.size()) / t;
  k.c.sources["device.storage_gbps"] = k.tag + ": 128 MiB written and fsync'd per rank, all ranks at once, in the current directory";
  if (k.talk) k.log << "storage: " << k.c.device.storage_bytes_per_s / 1e9 << " GB/s per rank\n";
}

// All-reduces across the ranks (one node): latency from one float, rate by size.
void measure_all_reduce(Calibration& k) {
  Communicator& world = k.world;
  const int n = world.size();
  Cluster& c = k.c;
  std::vector<float> buf(size_t{16} << 20, 1.0f);
  std::vector<std::pair<double, double>> rates;
  double latency = 0;
  for (size_t count : {size_t{1}, size_t{16} << 10, size_t{256} << 10, size_t{1} << 20, size_t{4} << 20, size_t{16} << 20}) {
    const double t = k.seconds(k.min_seconds / 2, [&] {
      world.all_reduce_sum(buf.data(), count, DType::kF32);
    });
    if (count == 1) {
      latency = t;
      continue;
    }
    const double wire = 4.0 * static_cast<double>(count) * 2 * (n - 1) / n;
    rates.emplace_back(wire, wire / std::max(t - latency, 1e-12));
    if (k.talk) k.log << "all_reduce " << 4 * count << " bytes: " << wire / t / 1e9 << " GB/s on the wire\n";
  }
  double best = 0;
  for (const auto& [b, r] : rates) best = std::max(best, r);
  c.intra.bytes_per_s = best;
  c.intra.latency_s = latency;
  c.intra.efficiency.points.clear();
  for (const auto& [b, r] : rates) c.intra.efficiency.points.emplace_back(b, r / best);
  c.sources["network.intra_gbps"] = k.tag + ": the fastest all-reduce rate on the wire (2 (n-1)/n of the payload)";
  c.sources["network.intra_latency_us"] = k.tag + ": an all-reduce of one float";
  c.sources["network.intra_efficiency"] = k.tag + ": all-reduce of 64 KiB .. 64 MiB, rate / the fastest";
}

}  // namespace

cpu::FmaPeak ranks_fma_peak(const Config& config, Communicator* world) {
  const int ranks = world ? world->size() : 1;
  const int threads = config.train.threads > 0 ? static_cast<int>(config.train.threads) : cpu::num_threads();
  if (ranks > 1) world->barrier();  // every rank measures at the same moment
  cpu::FmaPeak m = cpu::fma_peak(threads, /*cached=*/ranks == 1);
  if (ranks > 1) {
    double flops[2] = {m.fp32_flops, m.bf16_flops};
    world->all_reduce_sum(flops, 2, DType::kF64);
    m.fp32_flops = flops[0];
    m.bf16_flops = flops[1];
  }
  return m;
}

std::string calibrate_machine(const Config& config, const CalibrateOptions& opt, std::ostream& log) {
  // The kernels run on the threads the peaks are measured at (train.threads, or all).
  if (config.train.threads > 0) cpu::set_num_threads(static_cast<int>(config.train.threads));
  std::unique_ptr<Communicator> world = launch_world();
  const int n = world->size();
  Cluster base = load_cluster(opt.base.empty() ? (n > 1 ? "cpu-core" : "cpu") : opt.base);
  std::unique_ptr<Backend> ops = make_backend(config.train.backend);
  const bool bf16 = config.train.precision == "bf16";
  const DType adt = bf16 ? DType::kBF16 : DType::kF32;
  const std::string tag = "calibration: moecore bench --calibrate, " + utc_now() + ", " + std::to_string(n) + " rank(s), " +
                          config.train.backend + " backend, " + config.train.precision;
  Calibration k{*ops, *world, opt.min_seconds, log, std::move(base), tag, world->rank() == 0, {}, {}};
  Cluster& c = k.c;
  measure_peaks(k, config);
  const double peak = bf16 ? c.device.bf16_flops : c.device.fp32_flops;
  log << std::fixed << std::setprecision(3);
  measure_gemm(k, adt, peak);
  measure_grouped(k, config, adt, peak);
  measure_attention(k, config, bf16, peak);
  measure_memory_rate(k);
  measure_storage(k);
  if (n > 1) measure_all_reduce(k);
  k.keep.clear();
  // The median measurement's spread: one noisy measurement should not set every error bar.
  std::vector<double>& spreads = k.spreads;
  std::sort(spreads.begin(), spreads.end());
  c.device.timing_spread = spreads.empty() ? 0 : spreads[spreads.size() / 2];
  c.sources["device.timing_spread"] = k.tag + ": the median over the measurements of (slowest - fastest) / fastest of its three rounds";
  if (k.talk) log << "spread of the rounds (median): " << 100 * c.device.timing_spread << "%\n";
  c.name += "-calibrated";
  return cluster_to_toml(c);
}

}  // namespace moe
