// moecore command line: train, config, prepare, eval, generate, export-hf, import-hf. Every error
// reaches the user as one line
// naming what was wrong; the exit status is non-zero.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <cstring>
#include <filesystem>
#include <memory>
#include <iostream>
#include <string>
#include <vector>

#include "cli/default_config.h"
#include "config/config.h"
#include "core/check.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "data/prepare.h"
#include "model/memory.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "train/bench.h"
#include "train/eval_commands.h"
#include "train/train_loop.h"

// Heap allocation counter for `moecore bench`: every operator new in this binary (scalar, array,
// aligned, nothrow: all funnel through these two) counts one. Direct malloc calls (e.g. inside
// oneDNN) are not counted. A relaxed atomic increment per allocation, in this binary only.
// Sanitizer builds keep their own allocator (replacing it there mismatches new/free pairs).
#if defined(__SANITIZE_ADDRESS__)
#define MOE_COUNT_ALLOCS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOE_COUNT_ALLOCS 0
#endif
#endif
#ifndef MOE_COUNT_ALLOCS
#define MOE_COUNT_ALLOCS 1
#endif

namespace {
std::atomic<uint64_t> g_allocs{0};
// The same count per thread (initial-exec TLS of the executable: a plain increment), read by
// bench to tell oneDNN's internal allocations from ours.
thread_local uint64_t t_allocs = 0;
uint64_t thread_allocs() { return t_allocs; }
}  // namespace

#if MOE_COUNT_ALLOCS
void* operator new(std::size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  ++t_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  ++t_allocs;
  const std::size_t a = static_cast<std::size_t>(al);
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(n, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif

namespace {

const char* kUsage =
    "usage: moecore <command> [options]\n"
    "commands:\n"
    "  train    [--config FILE] [--set section.key=value ...] [--resume]\n"
    "           train (embedded default config); --resume continues from the latest good checkpoint\n"
    "  config   [--config FILE] [--set section.key=value ...]   print the resolved config and sizes\n"
    "  prepare  --input TEXT --out DIR                           byte-level token files + bigram entropy\n"
    "  eval     --checkpoint PATH [--batches N] [--set k=v ...]  validation loss and perplexity\n"
    "  generate --checkpoint PATH --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K]\n"
    "           [--seed S]                                       sample text (byte-level models)\n"
    "  export-hf (--from PARAMS | --checkpoint PATH) --out DIR [--config FILE] [--set k=v ...]\n"
    "           [--dtype f32|bf16]   OlmoeForCausalLM config.json + model.safetensors from a\n"
    "           training checkpoint, or from our parameters (a golden fixture or an import-hf file;\n"
    "           config from --config or the file's metadata)\n"
    "  (PATH: a checkpoint step_N directory, or a checkpoint directory: its latest good one)\n"
    "  import-hf --from DIR --out PARAMS   a Hugging Face OLMoE checkpoint to our parameters\n"
    "  bench    [--config FILE] [--set k=v ...] [--warmup N] [--steps N]\n"
    "           full training steps on random ids: tokens/s, model TFLOP/s, MFU, per-phase\n"
    "           breakdown, heap allocations per step (steps 3-10), peak RSS\n"
    "  help\n";

struct Args {
  std::string command, config_path, input, out, from, dtype = "f32", checkpoint, prompt;
  std::vector<std::string> overrides;
  bool resume = false;
  int64_t warmup = 3, bench_steps = 10;
  int64_t batches = 0, max_tokens = 200, top_k = 40;
  double temperature = 0.8;
  uint64_t seed = 0;
};

Args parse_args(int argc, char** argv) {
  Args a;
  MOE_CHECK(argc >= 2, "missing command\n", kUsage);
  a.command = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      MOE_CHECK(i + 1 < argc, "option ", flag, " needs a value");
      return argv[++i];
    };
    if (flag == "--config") a.config_path = value();
    else if (flag == "--set") a.overrides.push_back(value());
    else if (flag == "--input") a.input = value();
    else if (flag == "--out") a.out = value();
    else if (flag == "--from") a.from = value();
    else if (flag == "--dtype") a.dtype = value();
    else if (flag == "--resume") a.resume = true;
    else if (flag == "--checkpoint") a.checkpoint = value();
    else if (flag == "--prompt") a.prompt = value();
    else if (flag == "--batches") a.batches = std::stoll(value());
    else if (flag == "--max-tokens") a.max_tokens = std::stoll(value());
    else if (flag == "--top-k") a.top_k = std::stoll(value());
    else if (flag == "--temperature") a.temperature = std::stod(value());
    else if (flag == "--seed") a.seed = std::stoull(value());
    else if (flag == "--warmup") a.warmup = std::stoll(value());
    else if (flag == "--steps") a.bench_steps = std::stoll(value());
    else MOE_FAIL("unknown option '", flag, "' (allowed: --config, --set, --input, --out, --from, --dtype, --resume, "
                  "--checkpoint, --prompt, --batches, --max-tokens, --temperature, --top-k, --seed, --warmup, --steps)\n", kUsage);
  }
  return a;
}

moe::Config resolve(const Args& a) {
  if (a.config_path.empty()) return moe::parse_config(moe::kDefaultConfigToml, a.overrides, "embedded default config");
  return moe::load_config(a.config_path, a.overrides);
}

// A model restored from a checkpoint: PATH is a step directory or a checkpoint directory (its
// latest checkpoint that verifies is used). The config is the checkpoint's, with --set overrides.
struct Restored {
  std::unique_ptr<moe::Backend> ops;
  std::unique_ptr<moe::Trainer> trainer;
};

Restored restore(const Args& a, std::vector<std::string> extra_overrides = {}) {
  MOE_CHECK(!a.checkpoint.empty(), a.command, " needs --checkpoint PATH");
  std::string path = a.checkpoint;
  if (!std::filesystem::exists(path + "/manifest.json")) {
    path = moe::latest_checkpoint(a.checkpoint);
    MOE_CHECK(!path.empty(), "no checkpoint in '", a.checkpoint, "'");
  }
  std::vector<std::string> overrides = a.overrides;
  overrides.insert(overrides.end(), extra_overrides.begin(), extra_overrides.end());
  moe::Config c = moe::parse_config(moe::verify_checkpoint(path).config_toml, overrides, path + "/manifest.json");
  c.parallel = moe::ParallelConfig{};  // one process reads a checkpoint of any layout
  Restored r;
  r.ops = moe::make_backend(c.train.backend);
  r.trainer = std::make_unique<moe::Trainer>(c, *r.ops, moe::DType::kF32);
  moe::load_checkpoint(path, *r.trainer);
  return r;
}

int run(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  if (a.command == "help" || a.command == "--help") {
    std::cout << kUsage;
    return 0;
  }
  if (a.command == "config") {
    moe::Config c = resolve(a);
    const auto& m = c.model;
    std::cout << moe::config_to_toml(c) << "\n# parameters: " << m.num_params()
              << "\n# active matmul parameters per token: " << m.num_active_matmul_params()
              << "\n# training FLOPs per token (causal attention): " << m.train_flops_per_token(c.train.seq_len)
              << "\n# training FLOPs per token (non-causal convention, 12*L*H*hd*S): "
              << m.train_flops_per_token_noncausal(c.train.seq_len) << "\n"
              << "# memory estimate (closed form, src/model/memory.cpp; micro-batch of "
              << c.train.micro_batch_size << " x " << c.train.seq_len << " tokens, " << c.train.precision
              << (c.train.recompute ? ", block recompute" : "") << "):\n"
              << moe::format_memory(moe::estimate_memory(c));
    return 0;
  }
  if (a.command == "prepare") {
    MOE_CHECK(!a.input.empty() && !a.out.empty(), "prepare needs --input TEXT and --out DIR");
    moe::PrepareResult r = moe::prepare_text(a.input, a.out);
    std::cout << "prepared " << a.out << ": " << r.train_tokens << " training and " << r.valid_tokens
              << " validation byte tokens\nunigram entropy " << r.unigram_entropy_nats
              << " nats/token\nbigram conditional entropy " << r.bigram_entropy_nats
              << " nats/token (the bar a trained model must beat on validation)\n";
    return 0;
  }
  if (a.command == "train") {
    moe::TrainSummary s = moe::run_training(resolve(a), std::cout, a.resume);
    if (moe::launch_rank() != 0) return 0;  // rank 0 reports for the run
    std::cout << "done: " << s.steps << " steps in " << s.seconds << " s, " << s.tokens_per_s
              << " tok/s, final train ce " << s.final_train_loss;
    if (s.final_valid_loss >= 0) std::cout << ", validation ce " << s.final_valid_loss;
    std::cout << "\n";
    return 0;
  }
  if (a.command == "bench") {
    const moe::Config c = resolve(a);
    moe::BenchOptions o;
    o.warmup = a.warmup;
    o.steps = a.bench_steps;
    o.alloc_counter = MOE_COUNT_ALLOCS ? &g_allocs : nullptr;
    o.thread_alloc_reader = MOE_COUNT_ALLOCS ? &thread_allocs : nullptr;
    const moe::BenchResult result = moe::run_bench(c, o);
    if (moe::launch_rank() == 0) moe::print_bench(c, result, std::cout);
    return 0;
  }
  if (a.command == "eval") {
    Restored r = restore(a);
    moe::run_eval_command(*r.trainer, a.batches, std::cout);
    return 0;
  }
  if (a.command == "generate") {
    MOE_CHECK(!a.prompt.empty(), "generate needs --prompt TEXT");
    // One sequence per forward: the batch shape does not change the parameters.
    Restored r = restore(a, {"train.batch_size=1", "train.micro_batch_size=1"});
    moe::GenerateOptions o;
    o.max_new_tokens = a.max_tokens;
    o.temperature = a.temperature;
    o.top_k = a.top_k;
    o.seed = a.seed;
    moe::run_generate_command(*r.trainer, a.prompt, o, std::cout);
    return 0;
  }
  if (a.command == "export-hf" && !a.checkpoint.empty()) {
    MOE_CHECK(!a.out.empty(), "export-hf needs --out DIR");
    Restored r = restore(a);
    moe::export_hf(r.trainer->model(), a.out, a.dtype);
    std::cout << "exported " << a.out << "/config.json and " << a.out << "/model.safetensors (" << a.dtype << ")\n";
    return 0;
  }
  if (a.command == "export-hf") {
    MOE_CHECK(!a.from.empty() && !a.out.empty(), "export-hf needs --from PARAMS (or --checkpoint PATH) and --out DIR");
    // The config: --config FILE, else the one embedded in PARAMS; --set overrides apply to either.
    const moe::ModelConfig model =
        a.config_path.empty()
            ? moe::parse_config(moe::config_to_toml(moe::config_from_json(moe::SafetensorsFile(a.from).meta("config"))),
                                a.overrides, a.from + " (embedded config)").model
            : resolve(a).model;
    const std::vector<float> params = moe::load_our_params(a.from, model);
    moe::export_hf(model, params.data(), a.out, a.dtype);
    std::cout << "exported " << a.out << "/config.json and " << a.out << "/model.safetensors (" << a.dtype << ")\n";
    return 0;
  }
  if (a.command == "import-hf") {
    MOE_CHECK(!a.from.empty() && !a.out.empty(), "import-hf needs --from DIR and --out PARAMS");
    const moe::HfModel m = moe::import_hf(a.from);
    moe::save_our_params(a.out, m.config, m.params.data());
    std::cout << "imported " << a.from << " into " << a.out << " (" << m.params.size() << " floats)\n";
    return 0;
  }
  MOE_FAIL("unknown command '", a.command, "'\n", kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    if (moe::launched_by_mpi()) {
      // One rank's error ends every rank now (peers may be blocked in a collective), with this
      // rank's message; mpirun reports the abort.
      moe::mpi_abort("moecore: error on rank " + std::to_string(moe::launch_rank()) + ": " + e.what(), 1);
    }
    std::fprintf(stderr, "moecore: error: %s\n", e.what());
    return 1;
  }
}
