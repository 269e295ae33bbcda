// moecore command line: train, config, plan, prepare, eval, generate, export-hf, import-hf, bench.
// Every error reaches the user as one line naming what was wrong; the exit status is non-zero.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <cstring>
#include <filesystem>
#include <memory>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/default_config.h"
#include "config/config.h"
#include "config/config_reference.h"
#include "core/build_info.h"
#include "core/check.h"
#include "core/user_path.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "data/prepare.h"
#include "plan/memory.h"
#include "plan/plan_command.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "train/bench.h"
#include "plan/calibrate.h"
#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif
#include "train/eval_commands.h"
#include "train/train_loop.h"
#include "report/report_html.h"

#include "cli/alloc_counter.h"

namespace {

struct Args {
  std::string command, config_path, input, out, from, dtype = "f32", checkpoint, prompt, hf_format;
  int64_t max_shard_bytes = 5'000'000'000;
  bool no_carry = false;
  std::vector<std::string> overrides, run_dirs, versus;
  bool resume = false, kernels = false, json = false, reference = false;
  std::string layout, cluster, overlap_ep;
  bool sweep = false, calibrate = false, power_capped = false, ops = false, alone = false;
  int64_t ranks_per_node = 0, plan_step = 1, interleave = 0;
  int64_t warmup = 3, bench_steps = 10;
  int64_t batches = 0, max_tokens = 200, top_k = 40;
  double temperature = 0.8;
  uint64_t seed = 0;
};

// The command line (CLI11): one subcommand per command, each with its own --help/-h (usage and
// options, exit 0); an unknown option, a missing value or a bad number is an error naming it.
struct CommandLine {
  CLI::App app{"moecore: train mixture-of-experts language models (CPU; MPI for several processes)", "moecore"};
  Args a;

  CommandLine() {
    app.set_version_flag("--version", moe::build_description(), "print the version and git commit, then exit");
    app.require_subcommand(0, 1);
    app.fallthrough(false);
    app.footer("Run 'moecore <command> --help' for a command's options. PATH (--checkpoint): a checkpoint step_N\n"
               "directory, or a checkpoint directory (its newest checkpoint that verifies).");
    add_train_and_config();
    add_plan();
    add_prepare_eval_generate();
    add_hf();
    add_bench();
    add_report();
    app.add_subcommand("help", "print this help");
  }

  void add_config_option(CLI::App* c) {
    c->add_option("--config", a.config_path, "TOML config file (default: the embedded configs/default.toml)")
        ->type_name("FILE");
  }
  void add_set_option(CLI::App* c) {
    c->add_option("--set", a.overrides, "override one config key; repeat for more")
        ->type_name("SECTION.KEY=VALUE")
        ->expected(1)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  }

  void add_train_and_config() {
    CLI::App* train = app.add_subcommand("train", "train a model; writes metrics.jsonl, events.jsonl and checkpoints");
    add_config_option(train);
    add_set_option(train);
    train->add_flag("--resume", a.resume, "continue from the latest checkpoint that verifies");

    CLI::App* cfg = app.add_subcommand("config", "print the resolved config, parameter count, FLOPs and memory estimate");
    add_config_option(cfg);
    add_set_option(cfg);
    cfg->add_flag("--reference", a.reference, "print every config key with its type, default, allowed values and "
                                              "meaning (markdown: docs/CONFIG.md's table)")
        ->excludes(cfg->get_option("--config"))
        ->excludes(cfg->get_option("--set"));
  }

  void add_plan() {
    CLI::App* plan = app.add_subcommand("plan", "memory per stage and communication per step of a parallel layout, "
                                                "before the run");
    add_config_option(plan);
    add_set_option(plan);
    plan->add_option("--layout", a.layout, "the layout to plan instead of [parallel]'s (e.g. dp=4,ep=2,pp=2)")
        ->type_name("dp=N,ep=N,pp=N");
    plan->add_option("--ranks-per-node", a.ranks_per_node, "ranks sharing one node's links (0 = all in one node)")
        ->check(CLI::NonNegativeNumber)->capture_default_str();
    plan->add_option("--step", a.plan_step, "the optimizer step whose traffic is predicted (uniform routing)")
        ->check(CLI::PositiveNumber)->capture_default_str();
    plan->add_option("--cluster", a.cluster, "a preset (cpu, cpu-core, h100, h200, b200, b300, gb200; NAMExN for N ranks) "
                     "or a cluster file (configs/clusters/): adds the step time")->type_name("NAME|FILE");
    plan->add_flag("--sweep", a.sweep, "every layout of the cluster's ranks, best first, with why the others do not fit")
        ->needs(plan->get_option("--cluster"));
    plan->add_option("--overlap-ep", a.overlap_ep, "expert exchange overlapped with compute (not in the trainer): "
                     "hidden fraction and grouped-GEMM slowdown, e.g. 0.72,0.25")->type_name("HIDDEN,SLOWDOWN");
    plan->add_option("--interleave", a.interleave, "model chunks per pipeline stage: the interleaved 1F1B schedule "
                     "(sets parallel.pp_interleave)")->check(CLI::PositiveNumber);
    plan->add_flag("--power-capped", a.power_capped, "GEMMs at the device's power-capped rate (where the cluster file gives one)");
    plan->add_flag("--json", a.json, "JSON for scripts (every number at full precision)");
  }

  void add_prepare_eval_generate() {
    CLI::App* prep = app.add_subcommand("prepare", "byte-level token files (train.bin, valid.bin) and the bigram entropy");
    prep->add_option("--input", a.input, "plain text file")->type_name("TEXT")->required();
    prep->add_option("--out", a.out, "output directory")->type_name("DIR")->required();

    CLI::App* eval = app.add_subcommand("eval", "validation loss and perplexity of a checkpoint");
    eval->add_option("--checkpoint", a.checkpoint, "checkpoint to evaluate")->type_name("PATH")->required();
    eval->add_option("--batches", a.batches, "validation micro-batches (0 = the whole validation set)")
        ->check(CLI::NonNegativeNumber);
    add_set_option(eval);

    CLI::App* gen = app.add_subcommand("generate", "sample text from a checkpoint (byte-level models)");
    gen->add_option("--checkpoint", a.checkpoint, "checkpoint to sample from")->type_name("PATH")->required();
    gen->add_option("--prompt", a.prompt, "text to continue")->type_name("TEXT")->required();
    gen->add_option("--max-tokens", a.max_tokens, "tokens to generate")->check(CLI::PositiveNumber)->capture_default_str();
    gen->add_option("--temperature", a.temperature, "sampling temperature (0 = greedy)")
        ->check(CLI::NonNegativeNumber)->capture_default_str();
    gen->add_option("--top-k", a.top_k, "sample among the k most likely tokens (0 = all)")
        ->check(CLI::NonNegativeNumber)->capture_default_str();
    gen->add_option("--seed", a.seed, "sampling seed")->capture_default_str();
    add_set_option(gen);
  }

  void add_hf() {
    CLI::App* exp = app.add_subcommand("export-hf", "write a Hugging Face folder, OlmoeForCausalLM or Olmo-core 3's "
                                                     "Olmo3MoeForCausalLM (config.json, generation_config.json, "
                                                     "model.safetensors or shards with an index, carried tokenizer files)");
    CLI::Option* from = exp->add_option("--from", a.from, "our parameters (an import-hf file or a golden fixture)")
                            ->type_name("PARAMS");
    CLI::Option* ckpt = exp->add_option("--checkpoint", a.checkpoint, "a training checkpoint")->type_name("PATH");
    from->excludes(ckpt);
    exp->add_option("--out", a.out, "output directory")->type_name("DIR")->required();
    exp->add_option("--dtype", a.dtype, "weight dtype")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
    exp->add_option("--format", a.hf_format, "olmoe or olmo3moe (default: the format an import-hf file came from, "
                    "else olmoe)")->check(CLI::IsMember({"olmoe", "olmo3moe"}));
    exp->add_flag("--no-carry", a.no_carry, "write config.json from moecore's settings alone, without the imported "
                  "file's other fields and tokenizer files");
    exp->add_option("--max-shard-bytes", a.max_shard_bytes, "largest shard; a larger export is sharded with "
                    "model.safetensors.index.json")->check(CLI::PositiveNumber)->capture_default_str();
    add_config_option(exp);
    add_set_option(exp);

    CLI::App* imp = app.add_subcommand("import-hf", "read a Hugging Face folder (model_type olmoe or olmo3moe) into our "
                                                     "parameter file, carrying its config.json and tokenizer files");
    imp->add_option("--from", a.from, "folder with config.json and model.safetensors (or a sharded index)")
        ->type_name("DIR")->required();
    imp->add_option("--out", a.out, "parameter file to write (use with train.init_from)")->type_name("PARAMS")->required();
  }

  void add_bench() {
    CLI::App* bench = app.add_subcommand("bench", "timed training steps on random ids: tokens/s, TFLOP/s, MFU, phases, "
                                                  "allocations, peak RSS");
    add_config_option(bench);
    add_set_option(bench);
    bench->add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::NonNegativeNumber)->capture_default_str();
    bench->add_option("--steps", a.bench_steps, "timed steps")->check(CLI::PositiveNumber)->capture_default_str();
    bench->add_flag("--ops", a.ops, "also the wall time inside each op of the timed steps (cpu backend)");
    bench->add_flag("--alone", a.alone, "also each phase's GEMMs and attention kernels timed alone at the step's "
                    "shapes after the steps: the rate each phase would reach on its kernels alone (cpu backend)");
    bench->add_option("--versus", a.versus, "also the same configuration with this key changed (KEY=VALUE, repeat for "
                      "more), its steps alternated with the first's in this process: B against A step by step (with --ops, op by op)")
        ->type_name("KEY=VALUE");
    bench->add_flag("--kernels", a.kernels, "instead: the GPU's dense, grouped and attention kernel rates (cuda build)");
    bench->add_flag("--calibrate", a.calibrate, "instead: measure this machine (GEMMs, grouped GEMMs, attention, memory, "
                    "all-reduces across the ranks) and write a cluster file for moecore plan --cluster");
    bench->add_option("--cluster", a.cluster, "with --calibrate: the preset or file whose other numbers are kept "
                      "(default: cpu, or cpu-core under mpirun)")->type_name("NAME|FILE");
    bench->add_option("--out", a.out, "with --calibrate: the cluster file to write (default calibration.toml)")->type_name("FILE");
  }

  void add_report() {
    CLI::App* report = app.add_subcommand("report", "one self-contained HTML page of plots for one or more runs "
                                                    "(their train.out_dir folders, overlaid)");
    report->add_option("RUN_DIR", a.run_dirs, "run directories (metrics.jsonl, events.jsonl, config.toml)")->required();
    report->add_option("--out", a.out, "the page to write (default: report.html in the first run directory)")
        ->type_name("FILE");
  }

  // Parses argv; returns an exit code when the command line is fully handled (--help,
  // --version: 0), or -1 to run a.command. Errors throw moe::Error naming the option.
  int parse(int argc, char** argv) {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      std::cout << app.help();  // the selected command's help
      return 0;
    } catch (const CLI::CallForAllHelp&) {
      std::cout << app.help("", CLI::AppFormatMode::All);
      return 0;
    } catch (const CLI::CallForVersion&) {
      std::cout << moe::build_description() << "\n";
      return 0;
    } catch (const CLI::ParseError& e) {
      const std::vector<CLI::App*> chosen = app.get_subcommands();
      const std::string cmd = chosen.empty() ? std::string() : chosen.front()->get_name();
      // An unknown first word is an unknown command, not an extra argument.
      if (chosen.empty() && argc >= 2 && argv[1][0] != '-')
        MOE_FAIL("unknown command '", std::string(argv[1]), "' (commands: train, config, plan, prepare, eval, generate, "
                 "export-hf, import-hf, bench, report, help; run 'moecore --help')");
      MOE_FAIL(std::string(e.what()), " (run 'moecore ", cmd.empty() ? std::string() : cmd + " ", "--help')");
    }
    const std::vector<CLI::App*> chosen = app.get_subcommands();
    if (chosen.empty() || chosen.front()->get_name() == "help") {
      std::cout << app.get_formatter()->make_help(&app, "moecore", CLI::AppFormatMode::Normal);
      return chosen.empty() ? 1 : 0;  // no command at all is a usage error
    }
    a.command = chosen.front()->get_name();
    return -1;
  }
};

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
  moe::check_input_dir(a.checkpoint, "--checkpoint");
  std::string path = a.checkpoint;
  if (!moe::path_entry_exists(path + "/manifest.json")) {
    path = moe::latest_checkpoint(a.checkpoint);
    MOE_CHECK(!path.empty(), "no checkpoint in '", a.checkpoint, "' (--checkpoint: a step_N directory or a folder of them)");
  }
  std::vector<std::string> overrides = a.overrides;
  overrides.insert(overrides.end(), extra_overrides.begin(), extra_overrides.end());
  moe::Config c = moe::parse_config(moe::verify_checkpoint(path).config_toml, overrides, path + "/manifest.json");
  c.parallel = moe::ParallelConfig{};  // one process reads a checkpoint of any layout
  Restored r;
  r.ops = moe::make_backend(c.train.backend);
  r.trainer = std::make_unique<moe::Trainer>(c, *r.ops, moe::DType::kF32);
  moe::load_checkpoint(path, r.trainer->state());
  return r;
}

// moecore config: the resolved config with its sizes and memory estimate, or (--reference) the
// reference of every key (docs/CONFIG.md's generated table).
int config_command(const Args& a) {
  if (a.reference) {
    std::cout << moe::config_reference_markdown();
    return 0;
  }
  moe::Config c = resolve(a);
  const auto& m = c.model;
  std::cout << moe::config_to_toml(c) << "\n# parameters: " << m.num_params()
            << "\n# active matmul parameters per token: " << m.num_active_matmul_params()
            << "\n# training FLOPs per token (causal attention): " << m.train_flops_per_token(c.train.seq_len)
            << "\n# training FLOPs per token (non-causal convention, 12*L*H*hd*S): "
            << m.train_flops_per_token_noncausal(c.train.seq_len) << "\n";
  if (!m.attention_windows().empty()) {
    std::cout << "# attention window per layer (keys a query sees; full = causal):";
    for (int64_t l = 0; l < m.n_layers; ++l) {
      const int64_t w = m.attention_window(l);
      std::cout << (l ? ", " : " ") << (w > 0 ? std::to_string(w) : std::string("full"));
    }
    std::cout << "\n";
  }
  std::cout << "# memory estimate (the trainer's own plans measured, src/plan/memory.cpp; micro-batch of "
            << c.train.micro_batch_size << " x " << c.train.seq_len << " tokens, " << c.train.precision
            << (c.train.recompute ? ", block recompute" : "") << "):\n"
            << moe::format_memory(moe::estimate_memory(c));
  return 0;
}

int report_command(const Args& a) {
  std::vector<moe::report::RunReport> reports;
  for (const std::string& dir : a.run_dirs) reports.push_back(moe::report::read_run(dir));
  std::vector<const moe::report::RunReport*> runs;
  for (const auto& r : reports) runs.push_back(&r);
  const std::string out = a.out.empty() ? a.run_dirs.front() + "/report.html" : a.out;
  const size_t bytes = moe::report::write_report(out, runs);
  std::cout << "wrote " << out << " (" << bytes << " bytes, " << runs.size() << " run" << (runs.size() > 1 ? "s" : "")
            << ")\n";
  for (const auto& r : reports)
    for (const std::string& n : r.notices()) std::cout << "  " << r.dir() << ": " << n << "\n";
  return 0;
}

// --overlap-ep HIDDEN,SLOWDOWN into the time model's overlap.
void parse_overlap_ep(const std::string& arg, moe::OverlapModel& overlap) {
  const size_t comma = arg.find(',');
  try {
    MOE_CHECK(comma != std::string::npos, "");
    size_t u1 = 0, u2 = 0;
    const std::string h = arg.substr(0, comma), d = arg.substr(comma + 1);
    overlap.exchange_hidden = std::stod(h, &u1);
    overlap.grouped_slowdown = std::stod(d, &u2);
    MOE_CHECK(u1 == h.size() && u2 == d.size(), "");
  } catch (const std::exception&) {
    MOE_FAIL("--overlap-ep ", arg, ": expected HIDDEN,SLOWDOWN (two numbers, e.g. 0.72,0.25)");
  }
}

int plan_command(const Args& a) {
  moe::PlanRequest r;
  r.layout = a.layout;
  r.cluster = a.cluster;
  r.ranks_per_node = a.ranks_per_node;
  r.step = a.plan_step;
  r.sweep = a.sweep;
  r.interleave = a.interleave;
  r.time.power_capped = a.power_capped;
  if (!a.overlap_ep.empty()) parse_overlap_ep(a.overlap_ep, r.time.overlap);
  const moe::PlanReport report = moe::run_plan(resolve(a), r);
  std::cout << (a.json ? report.json() : report.text());
  return 0;
}

int prepare_command(const Args& a) {
  moe::PrepareResult r = moe::prepare_text(a.input, a.out);
  std::cout << "prepared " << a.out << ": " << r.train_tokens << " training and " << r.valid_tokens
            << " validation byte tokens (every 20th block of " << r.block << " bytes held out)\n";
  for (const std::string& w : r.warnings) std::cout << "warning: " << w << "\n";
  std::cout << "unigram entropy " << r.unigram_entropy_nats
            << " nats/token\nbigram conditional entropy " << r.bigram_entropy_nats
            << " nats/token (the bar a trained model must beat on validation)\n";
  return 0;
}

int train_command(const Args& a) {
  moe::TrainSummary s = moe::run_training(resolve(a), std::cout, a.resume);
  if (moe::launch_rank() != 0) return 0;  // rank 0 reports for the run
  // Losses with every digit (they round-trip): runs are compared on them.
  std::cout << std::fixed << std::setprecision(1) << "done: " << s.steps << " steps in " << s.seconds << " s, "
            << s.tokens_per_s << " tok/s" << std::defaultfloat
            << std::setprecision(std::numeric_limits<double>::max_digits10) << ", final train ce "
            << s.final_train_loss;
  if (s.final_valid_loss >= 0) std::cout << ", validation ce " << s.final_valid_loss;
  std::cout << "\n";
  return 0;
}

// moecore bench: the kernel rates (--kernels), this machine measured (--calibrate), or timed steps.
int bench_command(const Args& a) {
  if (a.kernels) {
#ifdef MOE_WITH_CUDA
    moe::cuda_kernel_bench(std::cout);
    return 0;
#else
    MOE_FAIL("bench --kernels: this moecore was built without CUDA (configure with -DMOE_CUDA=ON)");
#endif
  }
  if (a.calibrate) {
    const moe::Config c = resolve(a);
    moe::CalibrateOptions o;
    o.base = a.cluster;
    std::ostringstream log;
    const std::string text = moe::calibrate_machine(c, o, log);
    if (moe::launch_rank() == 0) {
      const std::string out = a.out.empty() ? "calibration.toml" : a.out;
      std::ofstream f(out);
      f << text;
      MOE_CHECK(f.good(), "bench --calibrate: cannot write ", out);
      std::cout << log.str() << "wrote " << out << " (moecore plan --cluster " << out << ")\n";
    }
    return 0;
  }
  MOE_CHECK(a.cluster.empty() && a.out.empty(), "bench: --cluster and --out go with --calibrate");
  const moe::Config c = resolve(a);
  moe::BenchOptions o;
  o.warmup = a.warmup;
  o.steps = a.bench_steps;
  o.alloc_counter = moe::cli::alloc_counter();
  o.thread_alloc_reader = moe::cli::thread_alloc_reader();
  o.ops = a.ops;
  o.alone = a.alone;
  if (!a.versus.empty()) {
    Args b = a;
    b.overrides.insert(b.overrides.end(), a.versus.begin(), a.versus.end());
    std::string b_is;
    for (const std::string& kv : a.versus) b_is += (b_is.empty() ? "" : ", ") + kv;
    const moe::Config cb = resolve(b);
    const moe::VersusResult result = moe::run_bench_versus(c, cb, o);
    moe::print_versus(c, cb, b_is, result, std::cout);
    return 0;
  }
  const moe::BenchResult result = moe::run_bench(c, o);
  if (moe::launch_rank() == 0) moe::print_bench(c, result, std::cout);
  return 0;
}

int generate_command(const Args& a) {
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

// moecore export-hf: a training checkpoint's model (--checkpoint), or a parameter file (--from).
int export_hf_command(const Args& a) {
  if (!a.checkpoint.empty()) {
    Restored r = restore(a);
    moe::HfExportOptions o;
    o.format = moe::hf_format_from_name(a.hf_format.empty() ? "olmoe" : a.hf_format);
    o.dtype = a.dtype;
    o.max_shard_bytes = a.max_shard_bytes;
    moe::export_hf(r.trainer->model(), r.trainer->config(), a.out, o);
    std::cout << "exported " << a.out << " (" << moe::hf_format_name(o.format) << ", " << a.dtype << ")\n";
    return 0;
  }
  MOE_CHECK(!a.from.empty(), "export-hf needs --from PARAMS or --checkpoint PATH");
  // The config: --config FILE, else the one stored in PARAMS; --set overrides apply to either.
  const moe::Config config =
      a.config_path.empty()
          ? moe::parse_config(moe::config_to_toml(moe::config_from_json(
                                  moe::SafetensorsFile(a.from, "export-hf --from").meta("config"))),
                              a.overrides, a.from + " (stored config)")
          : resolve(a);
  const moe::SafetensorsFile file(a.from, "export-hf --from");
  const std::vector<float> params = moe::load_our_params(file, config.model);
  const moe::HfCarried carried = moe::load_hf_carried(file);  // config.json and tokenizer of an import
  moe::HfExportOptions o;
  o.format = moe::hf_format_from_name(!a.hf_format.empty() ? a.hf_format : !carried.format.empty() ? carried.format : "olmoe");
  o.dtype = a.dtype;
  o.max_shard_bytes = a.max_shard_bytes;
  if (!a.no_carry) o.carried = &carried;
  moe::export_hf(config, params.data(), a.out, o);
  std::cout << "exported " << a.out << " (" << moe::hf_format_name(o.format) << ", " << a.dtype << ")";
  if (o.carried && carried.format == moe::hf_format_name(o.format) && !carried.files.empty())
    std::cout << " with " << carried.files.size() << " carried tokenizer file(s)";
  std::cout << "\n";
  return 0;
}

int import_hf_command(const Args& a) {
  const moe::HfModel m = moe::import_hf(a.from);
  for (const std::string& n : m.notes) std::cout << "note: " << n << "\n";
  moe::save_our_params(a.out, m.config, m.params.data(), &m.carried);
  std::cout << "imported " << a.from << " into " << a.out << " (" << m.params.size() << " floats)\n";
  return 0;
}

int run(int argc, char** argv) {
  CommandLine cli;
  if (const int code = cli.parse(argc, argv); code >= 0) return code;
  const Args& a = cli.a;
  if (a.command == "config") return config_command(a);
  if (a.command == "report") return report_command(a);
  if (a.command == "plan") return plan_command(a);
  if (a.command == "prepare") return prepare_command(a);
  if (a.command == "train") return train_command(a);
  if (a.command == "bench") return bench_command(a);
  if (a.command == "eval") {
    Restored r = restore(a);
    moe::run_eval_command(*r.trainer, a.batches, std::cout);
    return 0;
  }
  if (a.command == "generate") return generate_command(a);
  if (a.command == "export-hf") return export_hf_command(a);
  if (a.command == "import-hf") return import_hf_command(a);
  MOE_FAIL("unknown command '", a.command, "'");
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
