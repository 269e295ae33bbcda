#include "config/config.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <toml++/toml.h>

#include "config/config_fields.h"

#include "core/check.h"
#include "core/mxfp8.h"
#include "core/user_path.h"

namespace moe {
namespace config_fields {
namespace {

// Appends one key to the table: section, key, where it lives in Config, range, allowed strings, help.
struct Adder {
  std::vector<Field>& table;
  void operator()(std::string section, std::string key, std::function<Ref(Config&)> ref, double lo, double hi,
                  std::vector<std::string> choices, std::string help) const {
    table.push_back({std::move(section), std::move(key), std::move(ref), lo, hi, std::move(choices), std::move(help)});
  }
};

void add_model_keys(const Adder& add) {
#define M(name) [](Config& c) -> Ref { return &c.model.name; }
  add("model", "vocab_size", M(vocab_size), 2, 1 << 30, {}, "vocabulary size");
  add("model", "d_model", M(d_model), 1, 1 << 20, {}, "model width D");
  add("model", "n_layers", M(n_layers), 1, 4096, {}, "transformer blocks");
  add("model", "n_heads", M(n_heads), 1, 4096, {}, "query heads H");
  add("model", "n_kv_heads", M(n_kv_heads), 1, 4096, {}, "key/value heads (divides n_heads)");
  add("model", "head_dim", M(head_dim), 0, 4096, {}, "head dim (0 = d_model / n_heads)");
  add("model", "norm_eps", M(norm_eps), 0, 1, {}, "RMSNorm epsilon (OLMoE 1e-5, Olmo-core 1e-6)");
  add("model", "norm_placement", M(norm_placement), 0, 0, {"pre", "peri", "reordered"},
      "block norms: pre x+f(n(x)), peri x+n(f(n(x))), reordered x+n(f(x)) (Olmo-core 3's block)");
  add("model", "tie_embeddings", M(tie_embeddings), 0, 0, {}, "LM head shares the embedding");
  add("model", "rope_theta", M(rope_theta), 1, kInf, {}, "RoPE base");
  add("model", "rope", M(rope), 0, 0, {"all", "none", "windowed"},
      "layers that apply RoPE: all, none (Olmo-core 3's rope = None), or only the sliding-window ones (its no_global_rope)");
  add("model", "qk_norm", M(qk_norm), 0, 0, {"none", "full", "per_head"}, "QK RMSNorm");
  add("model", "clip_qkv", M(clip_qkv), 0, kInf, {},
      "q, k, v clamped to [-c, c] after their projections, before QK-norm and RoPE (Olmo-core 3's clip_qkv; 0 = off)");
  add("model", "attention_bias", M(attention_bias), 0, 0, {}, "biases bq, bk, bv, bo on the attention projections (Olmo-core 3's bias, olmo3moe attention_bias; start at 0, "
      "weight-decayed like the weights)");
  add("model", "rope_partial", M(rope_partial), 1e-9, 1, {},
      "fraction of each head's dims RoPE rotates: the first int(hd * rope_partial), an even count >= 2 (Olmo-core 3's "
      "partial_rotary_factor; 1 = all)");
  add("model", "sliding_window", M(sliding_window), 0, 0, {},
      "window sizes repeated over the layers, -1 = full (\"4096,4096,4096,-1\", Olmo-core 3's pattern; \"\" = all full)");
  add("model", "sliding_window_full_first", M(sliding_window_full_first), 0, 0, {},
      "with sliding_window: layer 0 full, the pattern starting at layer 1");
  add("model", "sliding_window_full_last", M(sliding_window_full_last), 0, 0, {},
      "with sliding_window: the last layer full");
  add("model", "n_dense_layers", M(n_dense_layers), 0, 4096, {}, "leading dense-FFN blocks");
  add("model", "dense_layers", M(dense_layers), 0, 0, {},
      "dense-FFN blocks at these indices, comma-separated, increasing (\"1,3\"; \"\" = the first n_dense_layers)");
  add("model", "dense_hidden", M(dense_hidden), 0, 1 << 24, {}, "dense FFN width (0 = k*expert_hidden + shared_experts*shared_hidden)");
  add("model", "num_experts", M(num_experts), 1, 1 << 16, {}, "routed experts E");
  add("model", "top_k", M(top_k), 1, 1 << 16, {}, "experts per token K");
  add("model", "expert_hidden", M(expert_hidden), 1, 1 << 24, {}, "expert FFN width");
  add("model", "score_func", M(score_func), 0, 0, {"softmax", "sigmoid", "topk_softmax"},
      "router scores (topk_softmax: experts chosen on the logits, weights a softmax over the chosen)");
  add("model", "sigmoid_eps", M(sigmoid_eps), 0, 1, {}, "added to sigmoid scores (Olmo-core 3: 1e-7)");
  add("model", "norm_topk_prob", M(norm_topk_prob), 0, 0, {}, "divide the K weights by their p-norm");
  add("model", "norm_topk_p", M(norm_topk_p), 1e-3, 1e3, {}, "p of norm_topk_prob (1 = sum)");
  add("model", "restore_weight_scale", M(restore_weight_scale), 0, 0, {}, "K weights times K after normalizing");
  add("model", "expert_weight_scale", M(expert_weight_scale), 1e-9, 1e9, {}, "K weights times this");
  add("model", "original_top_k", M(original_top_k), 0, 1 << 16, {},
      "K weights times sqrt(original_top_k / top_k) (0 = top_k)");
  add("model", "shared_hidden", M(shared_hidden), 0, 1 << 24, {}, "shared expert width (0 = none)");
  add("model", "shared_merge", M(shared_merge), 0, 0, {"sum", "v1"}, "shared + routed merge rule");
  add("model", "shared_experts", M(shared_experts), 1, 1024, {}, "shared experts, each shared_hidden wide (> 1 needs shared_router)");
  add("model", "shared_router", M(shared_router), 0, 0, {}, "gate the shared experts (Olmo-core 3's shared_experts_router): output += sum_e w[t,e] SharedExpert_e; no "
      "top-k, no auxiliary losses");
  add("model", "shared_router_score", M(shared_router_score), 0, 0, {"softmax", "sigmoid", "topk_softmax"},
      "shared router scores (topk_softmax is refused: the shared router has no top-k)");
  add("model", "shared_router_sigmoid_eps", M(shared_router_sigmoid_eps), 0, 1, {}, "added to sigmoid shared router scores");
  add("model", "shared_router_norm_p", M(shared_router_norm_p), 0, 1e3, {}, "shared router weights divided by their p-norm (0 = not, else at least 0.001)");
  add("model", "shared_router_bias", M(shared_router_bias), 0, 0, {}, "learned bias on the shared router's logits (starts at 0)");
  add("model", "router_logit_bias", M(router_logit_bias), 0, 0, {}, "learned bias on the router's logits (Olmo-core 3's router bias; starts at 0, trained and decayed)");
  add("model", "routing", M(routing), 0, 0, {"learned", "uniform", "random"}, "expert choice");
  add("model", "router_bias_gamma", M(router_bias_gamma), 0, kInf, {}, "loss-free balancing rate (0 = off)");
  add("model", "score_correction_bias", M(score_correction_bias), 0, 0, {},
      "the router bias selects also without loss-free balancing (loaded, kept fixed)");
  add("model", "n_group", M(n_group), 0, 1 << 16, {}, "expert groups of group-limited routing (0 = off)");
  add("model", "topk_group", M(topk_group), 0, 1 << 16, {}, "groups each token may choose from (0 = off)");
  add("model", "init_std", M(init_std), 0, kInf, {}, "truncated-normal init std");
  add("model", "embed_scale", M(embed_scale), 1e-9, 1e9, {}, "embedding output times this (Olmo-core 3: sqrt(d_model))");
  add("model", "embedding_norm", M(embedding_norm), 0, 0, {}, "RMSNorm (weight embed_norm) after the embedding");
  add("model", "pad_id", M(pad_id), -1, 2147483647, {},
      "padding token id (-1 = none): no label where it is the next token, no gradient for its embedding row, which "
      "starts at zero (transformers' padding_idx)");
  add("model", "max_position_embeddings", M(max_position_embeddings), 0, 1 << 24, {},
      "longest sequence the model is meant for (0 = train.seq_len; Hugging Face max_position_embeddings, kept "
      "through import and export)");
#undef M
}

void add_loss_optim_keys(const Adder& add) {
#define L(name) [](Config& c) -> Ref { return &c.loss.name; }
  add("loss", "lm_z_coef", L(lm_z_coef), 0, kInf, {}, "LM z-loss weight");
  add("loss", "lbl_coef", L(lbl_coef), 0, kInf, {}, "load-balancing loss weight");
  add("loss", "router_z_coef", L(router_z_coef), 0, kInf, {}, "router z-loss weight");
  add("loss", "aux_divisor", L(aux_divisor), 0, 0, {"tokens", "labelled"},
      "auxiliary losses summed over the step's tokens divided by all its tokens, or by its labelled ones "
      "(Olmo-core 3's train module)");
  add("loss", "lbl_granularity", L(lbl_granularity), 0, 0, {"local_batch", "instance", "global"},
      "load-balancing loss over each micro-batch, each sequence, or with counts summed over the data-parallel group "
      "(Olmo-core 3's global_load_balancing)");
#undef L
#define O(name) [](Config& c) -> Ref { return &c.optim.name; }
  add("optim", "lr", O(lr), 0, kInf, {}, "peak learning rate");
  add("optim", "min_lr", O(min_lr), 0, kInf, {}, "final learning rate");
  add("optim", "beta1", O(beta1), 0, 1, {}, "Adam beta1");
  add("optim", "beta2", O(beta2), 0, 1, {}, "Adam beta2");
  add("optim", "eps", O(eps), 0, kInf, {}, "Adam epsilon");
  add("optim", "weight_decay", O(weight_decay), 0, kInf, {}, "decoupled weight decay");
  add("optim", "no_decay_embeddings_norms", O(no_decay_embeddings_norms), 0, 0, {}, "no decay on embeddings and norms");
  add("optim", "max_grad_norm", O(max_grad_norm), 0, kInf, {}, "global grad-norm clip (0 = off)");
  add("optim", "schedule", O(schedule), 0, 0, {"cosine", "linear", "wsd", "constant"}, "LR schedule after warm-up");
  add("optim", "warmup_steps", O(warmup_steps), 0, 1e15, {}, "linear warm-up steps");
  add("optim", "decay_steps", O(decay_steps), 0, 1e15, {}, "WSD final decay steps");
#undef O
}

void add_train_data_keys(const Adder& add) {
#define T(name) [](Config& c) -> Ref { return &c.train.name; }
  add("train", "steps", T(steps), 1, 1e15, {}, "optimizer steps");
  add("train", "seq_len", T(seq_len), 2, 1 << 24, {}, "tokens per sequence");
  add("train", "batch_size", T(batch_size), 1, 1 << 24, {}, "sequences per optimizer step");
  add("train", "micro_batch_size", T(micro_batch_size), 1, 1 << 24, {}, "sequences per forward/backward");
  add("train", "seed", T(seed), 0, 1.8e19, {}, "seed of every random draw");
  add("train", "precision", T(precision), 0, 0, {"fp32", "bf16", "mxfp8"},
      "matrix-product precision: bf16 rounds GEMM and attention operands (fp32 accumulation, fp32 master weights); "
      "mxfp8 is bf16 with MXFP8 GEMMs where the [mxfp8] section says");
  add("train", "backend", T(backend), 0, 0, {"cpu", "ref", "strict", "cuda"},
      "kernel backend (strict: the cpu kernels behind memory the host cannot read, ops released only by waits, "
      "NaN-filled fresh memory: a test of device discipline; cuda: an NVIDIA GPU, in a build with -DMOE_CUDA=ON, "
      "head dim at most 256, at most 1024 experts)");
  add("train", "threads", T(threads), 0, 4096, {}, "CPU threads (0 = all)");
  add("train", "recompute", T(recompute), 0, 0, {}, "recompute each block in backward");
  add("train", "deterministic_attention", T(deterministic_attention), 0, 0, {},
      "cuda: cuDNN's deterministic attention backward (bitwise repeatable steps; on Hopper a B*H*S*S*2-byte "
      "workspace); false: its default backward (atomics, no such workspace), as FlashAttention runs");
  add("train", "overlap_host", T(overlap_host), 0, 0, {},
      "enqueue step n+1 before reading step n's record (the device never waits for the host between steps; the run "
      "is the same bit for bit)");
  add("train", "log_every", T(log_every), 1, 1e15, {}, "steps between log lines");
  add("train", "eval_every", T(eval_every), 0, 1e15, {}, "steps between validations (0 = never)");
  add("train", "eval_batches", T(eval_batches), 1, 1e15, {}, "validation micro-batches");
  add("train", "time_limit_s", T(time_limit_s), 0, kInf, {}, "stop after this many seconds (0 = none)");
  add("train", "out_dir", T(out_dir), 0, 0, {}, "metrics, events and outputs (must not be empty)");
  add("train", "init_from", T(init_from), 0, 0, {}, "start from these parameters (an import-hf file; \"\" = random init)");
  add("train", "on_nonfinite", T(on_nonfinite), 0, 0, {"stop", "skip"}, "NaN/Inf loss or gradients: stop, or skip the update");
  add("train", "progress", T(progress), 0, 0, {"auto", "on", "off"},
      "live progress line (auto = stdout is a terminal and no mpirun/srun)");
#undef T
#define D(name) [](Config& c) -> Ref { return &c.data.name; }
  add("data", "train_path", D(train_path), 0, 0, {}, "training token file(s), comma-separated, concatenated in order (at least one)");
  add("data", "valid_path", D(valid_path), 0, 0, {}, "validation token file(s), comma-separated");
  add("data", "token_dtype", D(token_dtype), 0, 0, {"uint8", "uint16", "uint32"}, "token file element type (.npy descr must match)");
  add("data", "eos_id", D(eos_id), -1, 2147483647, {}, "end-of-document token id (-1 = none; Hugging Face eos_token_id)");
  add("data", "bos_id", D(bos_id), -1, 2147483647, {}, "beginning-of-sequence id for the Hugging Face export (-1 = none; never inserted)");
  add("data", "intra_doc_mask", D(intra_doc_mask), 0, 0, {}, "mask attention across documents (needs data.eos_id)");
#undef D
}

void add_mxfp8_metrics_keys(const Adder& add) {
#define MX(name) [](Config& c) -> Ref { return &c.mxfp8.name; }
  add("mxfp8", "experts", MX(experts), 0, 0, {}, "train.precision = mxfp8: the routed experts' forward and data-gradient GEMMs in MXFP8 (weight gradients "
      "bf16); needs model.d_model and model.expert_hidden multiples of 32");
  add("mxfp8", "dispatch", MX(dispatch), 0, 0, {}, "mxfp8 with EP: send the experts' input rows quantized (33/32 bytes per value; needs mxfp8.experts)");
  add("mxfp8", "attention", MX(attention), 0, 0, {}, "train.precision = mxfp8: the attention q/k/v/o projections' forward and data-gradient GEMMs in MXFP8 "
      "(weight gradients bf16); needs model.d_model, n_heads x head dim and n_kv_heads x head dim multiples of 32");
  add("mxfp8", "scale_rule", MX(scale_rule), 0, 0, {"rceil", "floor"}, "block scale: rceil (round the scale up: nothing saturates; NVIDIA's recipe, torchao's default) or floor (the OCP "
      "rule)");
  add("mxfp8", "grad_format", MX(grad_format), 0, 0, {"e4m3", "e5m2"}, "element format of the output gradients in MXFP8 data gradients");
#undef MX
#define X(name) [](Config& c) -> Ref { return &c.metrics.name; }
  add("metrics", "peak_tflops", X(peak_tflops), 0, kInf, {}, "peak TFLOP/s per rank for MFU (0 = measured on this machine's threads on cpu, strict and ref; on cuda the "
      "GPU's dense datasheet peak: H100/H200 989 bf16 / 67 fp32, B200/B300 2250 / 80)");
  add("metrics", "vectors_every", X(vectors_every), 0, 1e15, {}, "steps between per-expert f/P vectors (0 = never)");
  add("metrics", "gerrymander_window", X(gerrymander_window), 0, 1e9, {}, "token-gerrymandering detector window in steps (0 = off, else at least 8)");
  add("metrics", "report", X(report), 0, 0, {}, "write <train.out_dir>/report.html (moecore report) at every checkpoint and at the end, on rank 0");
#undef X
}

void add_checkpoint_parallel_keys(const Adder& add) {
#define K(name) [](Config& c) -> Ref { return &c.checkpoint.name; }
  add("checkpoint", "dir", K(dir), 0, 0, {}, "checkpoint directory (\"\" = <train.out_dir>/checkpoints)");
  add("checkpoint", "every", K(every), 0, 1e15, {}, "save every N steps (0 = only at the end)");
  add("checkpoint", "keep_last", K(keep_last), 1, 1e6, {}, "complete checkpoints kept");
  add("checkpoint", "at_end", K(at_end), 0, 0, {}, "save when the run stops");
#undef K
#define P(name) [](Config& c) -> Ref { return &c.parallel.name; }
  add("parallel", "dp", P(dp), 1, 65536, {}, "data-parallel replicas per pipeline stage");
  add("parallel", "ep", P(ep), 1, 65536, {}, "expert-parallel group size (divides dp and model.num_experts)");
  add("parallel", "pp", P(pp), 1, 4096, {}, "pipeline stages (at most model.n_layers)");
  add("parallel", "overlap_grad_reduce", P(overlap_grad_reduce), 0, 0, {},
      "DDP: start each layer's gradient all-reduce during the backward (not with zero1)");
  add("parallel", "zero1", P(zero1), 0, 0, {},
      "ZeRO-1: shard the Adam moments over the data-parallel group (experts: expert-data-parallel)");
  add("parallel", "ep_capacity_factor", P(ep_capacity_factor), 0, 1e6, {},
      "expert parallelism: rows each rank's experts keep per MoE layer = ceil(cf x top_k x local tokens), the tail dropped (0 = dropless)");
  add("parallel", "ep_transport", P(ep_transport), 0, 0, {"p2p", "padded"},
      "expert parallelism: p2p (messages sized by the plan, one host read of the counts per plan) or padded (fixed slabs per peer, no host read; sends (ep - 1) whole slabs)");
  add("parallel", "pp_interleave", P(pp_interleave), 1, 64, {},
      "interleaved 1F1B: model chunks per pipeline stage (1 = plain 1F1B; needs pp > 1 and micro-batches per step a "
      "multiple of pp)");
  add("parallel", "stage_layers", P(stage_layers), 0, 0, {},
      "layers per pipeline stage, comma-separated (\"\" = balanced); with pp_interleave, per chunk: pp x pp_interleave counts");
  add("parallel", "communicator", P(communicator), 0, 0, {"mpi", "nccl"},
      "what carries tensors between ranks: mpi (host buffers; staged through the host on a GPU) or nccl (device "
      "buffers, stream-ordered; needs train.backend = \"cuda\"); agreement checks and logs always use MPI");
#undef P
}

}  // namespace

// The single declaration of every config key.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> f;
    const Adder add{f};
    add_model_keys(add);
    add_loss_optim_keys(add);
    add_train_data_keys(add);
    add_mxfp8_metrics_keys(add);
    add_checkpoint_parallel_keys(add);
    return f;
  }();
  return table;
}

// "[0, 1]", "[2, 1073741824]", "[0, 1e15]", "[1, inf)": a range whose upper end is infinite means
// any finite value. Bounds print exactly (%.15g holds every bound of the table), exponents bare.
std::string range_text(const Field& f) {
  auto bound = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.15g", x);
    std::string s(buf);
    const size_t e = s.find('e');
    if (e == std::string::npos) return s;
    size_t digits = e + 1;
    if (s[digits] == '+') s.erase(digits, 1);
    else if (s[digits] == '-') ++digits;
    while (digits + 1 < s.size() && s[digits] == '0') s.erase(digits, 1);
    return s;
  };
  std::string s = "[";
  s.append(bound(f.min)).append(", ");
  if (f.max == kInf) s.append("inf)");
  else s.append(bound(f.max)).append("]");
  return s;
}

}  // namespace config_fields

namespace {
using config_fields::Field;
using config_fields::fields;
using config_fields::range_text;
using config_fields::Ref;

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

std::string keys_of(const std::string& section) {
  std::vector<std::string> keys;
  for (const Field& f : fields())
    if (f.section == section) keys.push_back(f.key);
  return join(keys);
}

std::vector<std::string> sections() { return {"model", "loss", "optim", "train", "data", "metrics", "checkpoint", "parallel"}; }

const Field& find_field(const std::string& section, const std::string& key) {
  bool section_known = false;
  for (const Field& f : fields()) {
    if (f.section == section) section_known = true;
    if (f.section == section && f.key == key) return f;
  }
  if (!section_known)
    MOE_FAIL("unknown config section '", section, "' (allowed: ", join(sections()), ")");
  MOE_FAIL("unknown config key '", section, ".", key, "' (allowed in [", section, "]: ",
           whole(keys_of(section)), ")");
}

// A value as parsed from TOML or from an override string.
using Value = std::variant<int64_t, double, bool, std::string>;

std::string describe(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        std::ostringstream s;
        if constexpr (std::is_same_v<std::decay_t<decltype(x)>, bool>) s << (x ? "true" : "false");
        else if constexpr (std::is_same_v<std::decay_t<decltype(x)>, std::string>) s << '"' << x << '"';
        else s << x;
        return s.str();
      },
      v);
}

// Every number of a config is finite: NaN and +-inf are refused by name (no key means anything
// by them; where a key has no limit, 0 means off).
void check_number(const Field& f, double x, const std::string& shown) {
  const std::string name = f.section + "." + f.key;
  MOE_CHECK(!std::isnan(x), name, " = ", shown, " is not a number (", f.help, ")");
  MOE_CHECK(std::isfinite(x), name, " = ", shown, " must be finite (", f.help, ")");
  MOE_CHECK(x >= f.min && x <= f.max, name, " = ", shown, " is out of range ", range_text(f), " (", f.help, ")");
}

void check_choice(const Field& f, const std::string& s) {
  if (f.choices.empty()) return;
  bool ok = false;
  for (const auto& c : f.choices) ok = ok || c == s;
  MOE_CHECK(ok, f.section, ".", f.key, " = \"", s, "\" is not allowed (allowed: ", join(f.choices), ")");
}

void assign(Config& config, const Field& f, const Value& v) {
  std::string name = f.section + "." + f.key;
  auto range_check = [&](double x) { check_number(f, x, describe(v)); };
  Ref ref = f.ref(config);
  if (auto p = std::get_if<int64_t*>(&ref)) {
    const int64_t* i = std::get_if<int64_t>(&v);
    MOE_CHECK(i, name, " = ", describe(v), ": expected an integer (", f.help, ")");
    range_check(static_cast<double>(*i));
    **p = *i;
  } else if (auto p = std::get_if<uint64_t*>(&ref)) {
    const int64_t* i = std::get_if<int64_t>(&v);
    MOE_CHECK(i && *i >= 0, name, " = ", describe(v), ": expected a non-negative integer");
    **p = static_cast<uint64_t>(*i);
  } else if (auto p = std::get_if<double*>(&ref)) {
    double x;
    if (auto i = std::get_if<int64_t>(&v)) x = static_cast<double>(*i);
    else if (auto d = std::get_if<double>(&v)) x = *d;
    else MOE_FAIL(name, " = ", describe(v), ": expected a number (", f.help, ")");
    range_check(x);
    **p = x;
  } else if (auto p = std::get_if<bool*>(&ref)) {
    const bool* b = std::get_if<bool>(&v);
    MOE_CHECK(b, name, " = ", describe(v), ": expected true or false");
    **p = *b;
  } else if (auto p = std::get_if<std::string*>(&ref)) {
    const std::string* s = std::get_if<std::string>(&v);
    MOE_CHECK(s, name, " = ", describe(v), ": expected a string",
              f.choices.empty() ? "" : " (allowed: " + join(f.choices) + ")");
    check_choice(f, *s);
    **p = *s;
  }
}

Value from_toml(const toml::node& node, const std::string& name) {
  if (auto i = node.as_integer()) return i->get();
  if (auto d = node.as_floating_point()) return d->get();
  if (auto b = node.as_boolean()) return b->get();
  if (auto s = node.as_string()) return s->get();
  MOE_FAIL(name, ": unsupported value type (expected a number, boolean or string)");
}

// Override values are typed by the field they set: "true"/"false" for bools, numbers for
// numbers, anything else for strings (quotes optional).
Value parse_override_value(const Field& f, const std::string& text, Config& config) {
  Ref ref = f.ref(config);
  std::string name = f.section + "." + f.key;
  if (std::holds_alternative<bool*>(ref)) {
    if (text == "true") return true;
    if (text == "false") return false;
    MOE_FAIL(name, " = ", text, ": expected true or false");
  }
  if (std::holds_alternative<std::string*>(ref)) {
    if (text.size() >= 2 && text.front() == '"' && text.back() == '"')
      return text.substr(1, text.size() - 2);
    return text;
  }
  size_t used = 0;
  try {
    if (std::holds_alternative<double*>(ref)) {
      double x = std::stod(text, &used);
      if (used == text.size()) return x;
    } else {
      long long x = std::stoll(text, &used);
      if (used == text.size()) return static_cast<int64_t>(x);
    }
  } catch (const std::exception&) {
  }
  MOE_FAIL(name, " = ", text, ": expected ",
           std::holds_alternative<double*>(ref) ? "a number" : "an integer", " (", f.help, ")");
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                    const std::string& source_name) {
  Config config;
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    MOE_FAIL("config parse error: ", e.description(), " at ", source_name, ":", e.source().begin.line, ":",
             e.source().begin.column);
  }
  for (auto&& [section_key, section_node] : root) {
    std::string section(section_key.str());
    const toml::table* table = section_node.as_table();
    if (!table) {
      bool known = false;
      for (const auto& s : sections()) known = known || s == section;
      MOE_FAIL(source_name, ": '", section, "' must be a [section] (allowed sections: ",
               join(sections()), ")", known ? "" : "; it is not a known section either");
    }
    for (auto&& [key, node] : *table) {
      const std::string name(key.str());
      const Field& f = find_field(section, name);
      assign(config, f, from_toml(node, section + "." + name));
    }
  }
  for (const std::string& o : overrides) {
    size_t eq = o.find('=');
    size_t dot = o.find('.');
    MOE_CHECK(eq != std::string::npos && dot != std::string::npos && dot < eq,
              "override '", o, "' must look like section.key=value");
    const std::string section = o.substr(0, dot), key = o.substr(dot + 1, eq - dot - 1);
    const Field& f = find_field(section, key);
    assign(config, f, parse_override_value(f, o.substr(eq + 1), config));
  }
  config.validate();
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_input_file(path, "config file"), overrides, path);
}

Config config_from_json(const std::string& json_text) {
  Config config;
  nlohmann::json root = nlohmann::json::parse(json_text);
  for (auto& [section, table] : root.items()) {
    MOE_CHECK(table.is_object(), "config JSON: '", section, "' must be an object");
    for (auto& [key, value] : table.items()) {
      const Field& f = find_field(section, key);
      Value v;
      if (value.is_boolean()) v = value.get<bool>();
      else if (value.is_number_integer()) v = value.get<int64_t>();
      else if (value.is_number()) v = value.get<double>();
      else if (value.is_string()) v = value.get<std::string>();
      else MOE_FAIL("config JSON: ", section, ".", key, " has an unsupported type");
      assign(config, f, v);
    }
  }
  config.validate();
  return config;
}

using config_fields::for_each_value;

void check_ranges(const Config& config, const std::string& section) {
  for_each_value(config, [&](const Field& f, Ref ref) {
    if (!section.empty() && f.section != section) return;
    std::visit(
        [&](auto* p) {
          using T = std::decay_t<decltype(*p)>;
          if constexpr (std::is_same_v<T, std::string>) check_choice(f, *p);
          else if constexpr (std::is_same_v<T, bool>) return;
          else {
            std::ostringstream shown;
            shown.precision(17);
            shown << *p;
            check_number(f, static_cast<double>(*p), shown.str());
          }
        },
        ref);
  });
}

void Config::validate() const {
  check_ranges(*this, "");
  model.validate();
  MOE_CHECK(!train.out_dir.empty(), "train.out_dir is empty: name the folder for metrics and checkpoints");
  MOE_CHECK(data.bos_id < model.vocab_size, "data.bos_id = ", data.bos_id, " is not below model.vocab_size = ",
            model.vocab_size);
  MOE_CHECK(model.pad_id < 0 || model.pad_id != data.eos_id, "model.pad_id = data.eos_id = ", model.pad_id,
            ": every document end would lose its label and its embedding would never train (use a distinct pad id)");
  MOE_CHECK(metrics.gerrymander_window == 0 || metrics.gerrymander_window >= 8,
            "metrics.gerrymander_window = ", metrics.gerrymander_window,
            " is too short for a trend (0 = off, else at least 8 steps)");
  MOE_CHECK(train.batch_size % train.micro_batch_size == 0, "train.batch_size = ",
            train.batch_size, " is not a multiple of train.micro_batch_size = ",
            train.micro_batch_size);
  MOE_CHECK(train.batch_size % (train.micro_batch_size * parallel.dp) == 0, "train.batch_size = ", train.batch_size,
            " is not a multiple of train.micro_batch_size x parallel.dp = ", train.micro_batch_size, " x ",
            parallel.dp, " (every data-parallel rank runs whole micro-batches of the global batch)");
  MOE_CHECK(optim.min_lr <= optim.lr, "optim.min_lr = ", optim.min_lr, " exceeds optim.lr = ", optim.lr);
  MOE_CHECK(optim.warmup_steps <= train.steps, "optim.warmup_steps = ", optim.warmup_steps,
            " exceeds train.steps = ", train.steps);
  if (optim.schedule == "wsd")
    MOE_CHECK(optim.decay_steps >= 1 && optim.decay_steps <= train.steps - optim.warmup_steps,
              "optim.decay_steps = ", optim.decay_steps, " must be in [1, steps - warmup_steps = ",
              train.steps - optim.warmup_steps, "] for the wsd schedule");
  if (train.precision == "mxfp8") {
    MOE_CHECK(train.backend != "cuda", "train.precision = \"mxfp8\" runs on the cpu (and strict) backend for now: "
              "the MXFP8 CUDA kernels are not written yet");
    MOE_CHECK(!mxfp8.dispatch || mxfp8.experts, "mxfp8.dispatch = true needs mxfp8.experts = true (the payload is "
              "the expert GEMM's own quantized operand)");
    if (mxfp8.experts && model.num_moe_layers() > 0) {
      MOE_CHECK(model.d_model % mx::kBlock == 0, "model.d_model = ", model.d_model, " is not a multiple of ", mx::kBlock,
                ", the MXFP8 block (train.precision = \"mxfp8\", mxfp8.experts = true)");
      MOE_CHECK(model.expert_hidden % mx::kBlock == 0, "model.expert_hidden = ", model.expert_hidden,
                " is not a multiple of ", mx::kBlock, ", the MXFP8 block (train.precision = \"mxfp8\", mxfp8.experts = true)");
    }
    if (mxfp8.attention) {  // each projection reduces over D forward and over its width backward
      const char* why = ", the MXFP8 block (train.precision = \"mxfp8\", mxfp8.attention = true)";
      MOE_CHECK(model.d_model % mx::kBlock == 0, "model.d_model = ", model.d_model, " is not a multiple of ",
                mx::kBlock, why);
      MOE_CHECK(model.n_heads * model.hd() % mx::kBlock == 0, "the query width model.n_heads x head dim = ",
                model.n_heads, " x ", model.hd(), " (model.head_dim, or model.d_model / model.n_heads) is not a multiple of ",
                mx::kBlock, why);
      MOE_CHECK(model.n_kv_heads * model.hd() % mx::kBlock == 0, "the key/value width model.n_kv_heads x head dim = ",
                model.n_kv_heads, " x ", model.hd(), " (model.head_dim, or model.d_model / model.n_heads) is not a multiple of ",
                mx::kBlock, why);
    }
  }
  if (train.backend == "ref")
    MOE_CHECK(train.precision == "fp32", "train.precision = \"", train.precision,
              "\" needs train.backend = \"cpu\" (the reference backend has no bf16 GEMMs)");
  MOE_CHECK(parallel.communicator != "nccl" || train.backend == "cuda", "parallel.communicator = \"nccl\" needs ",
            "train.backend = \"cuda\" (got \"", train.backend, "\")");
  if (train.backend == "cuda") {
#ifndef MOE_WITH_CUDA
    MOE_FAIL("train.backend = \"cuda\": this moecore was built without CUDA (configure with -DMOE_CUDA=ON)");
#endif
    MOE_CHECK(model.hd() <= 256, "head dim ", model.hd(), " (model.head_dim, or model.d_model / model.n_heads) exceeds 256, ",
              "the largest the cuda attention kernels take");
    MOE_CHECK(model.num_experts <= 1024, "model.num_experts = ", model.num_experts,
              " exceeds 1024, the most the cuda routing kernels take");
  }
  MOE_CHECK(data.eos_id < model.vocab_size, "data.eos_id = ", data.eos_id, " is not below model.vocab_size = ",
            model.vocab_size);
  if (data.intra_doc_mask)
    MOE_CHECK(data.eos_id >= 0, "data.intra_doc_mask = true needs data.eos_id (the document separator)");
  MOE_CHECK(!(parallel.overlap_grad_reduce && parallel.zero1),
            "parallel.overlap_grad_reduce = true is not supported with parallel.zero1 = true (ZeRO-1 reduce-scatters "
            "after the backward)");
  // The world size is only known at launch (checked there, src/config/layout.h).
  validate_layout(layout_from_config(parallel), -1, model.num_experts, model.n_layers);
  configured_stage_chunks(parallel, model.n_layers, 0);  // throws naming a bad parallel.stage_layers
  // pp = 1 passes here: a layout given after the config (moecore plan --layout) may set pp; the
  // trainer and the planner check the layout they run.
  if (parallel.pp > 1) check_interleave(*this);
}

void check_interleave(const Config& c) {
  const ParallelConfig& p = c.parallel;
  if (p.pp_interleave == 1) return;
  MOE_CHECK(p.pp > 1, "parallel.pp_interleave = ", p.pp_interleave, " needs parallel.pp > 1");
  const int64_t micro = c.train.batch_size / (c.train.micro_batch_size * p.dp);
  MOE_CHECK(micro % p.pp == 0, "parallel.pp_interleave = ", p.pp_interleave, " needs the ", micro,
            " micro-batches per step and rank (train.batch_size / (train.micro_batch_size x parallel.dp)) to be a "
            "multiple of parallel.pp = ", p.pp, " (the interleaved schedule takes them in groups of pp)");
}

}  // namespace moe
