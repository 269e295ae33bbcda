// The run's configuration: model, losses, optimizer, training loop, data, parallel layout.
// Every field is declared once in config.cpp's field table with its type, range or allowed
// values and help text; TOML files and --set overrides are parsed against that table, so an
// unknown key, a wrong type or an out-of-range value is an error that names the key.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/layout.h"

namespace moe {

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t d_model = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 8;
  int64_t n_kv_heads = 4;
  int64_t head_dim = 0;  // 0 = d_model / n_heads
  double norm_eps = 1e-5;
  // pre: x + f(norm(x)); peri: x + norm_out(f(norm(x))); reordered: x + norm_out(f(x)) (Olmo-core
  // 3's default block).
  std::string norm_placement = "pre";  // pre | peri | reordered
  bool tie_embeddings = false;
  double rope_theta = 10000.0;
  // Which layers apply RoPE: all; none (Olmo-core 3's rope = None, olmo3moe use_rope = false);
  // windowed: only the sliding-window layers (Olmo-core 3's RoPEConfig.no_global_rope).
  std::string rope = "all";  // all | none | windowed
  std::string qk_norm = "full";  // none | full | per_head
  // q, k and v clamped to [-clip_qkv, clip_qkv] right after their projections (before QK-norm
  // and RoPE; Olmo-core 3's clip_qkv). 0 = off.
  double clip_qkv = 0;
  // Biases on wq, wk, wv and wo (Olmo-core 3's Attention(bias=True), olmo3moe attention_bias):
  // parameters layers.L.bq, bk, bv, bo, initialized to zero.
  bool attention_bias = false;
  // Fraction of each head's dims that RoPE rotates (Olmo-core 3's partial_rotary_factor): the
  // first rotary_dim() = int(hd * rope_partial) dims, paired as rotate-halves within them, with
  // frequencies theta^(-2i/rotary_dim); the rest pass through. 1 = all.
  double rope_partial = 1.0;
  // Sliding-window attention (Olmo-core 3's SlidingWindowAttentionConfig): window sizes repeated
  // over the layers, comma-separated, -1 = full causal ("4096,4096,4096,-1"); "" = every layer
  // full. A window W lets a query see itself and the W-1 keys before it (flash-attn's (W-1, 0)).
  // full_first / full_last force full attention on the first / last layer; with full_first the
  // pattern starts at layer 1.
  std::string sliding_window;
  bool sliding_window_full_first = true;
  bool sliding_window_full_last = true;
  int64_t n_dense_layers = 0;
  // Dense-FFN layers at any indices, comma-separated ("1" or "0,3"; Olmo-core 3's
  // dense_layers_indices); "" = the first n_dense_layers. At most one of the two is set.
  std::string dense_layers;
  int64_t dense_hidden = 0;  // 0 = top_k * expert_hidden + shared_hidden
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t expert_hidden = 256;
  // softmax | sigmoid | topk_softmax (softmax scores; experts chosen on the logits, weights = the
  // softmax over the chosen logits)
  std::string score_func = "softmax";
  double sigmoid_eps = 0;  // added to sigmoid scores (Olmo-core 3's sigmoid_stability_epsilon, 1e-7)
  // Combine weights of the K chosen experts (Olmo-core 3's MoERouterV2, in this order): divided
  // by their p-norm (norm_topk_prob, p = norm_topk_p), times K (restore_weight_scale), times
  // expert_weight_scale, times sqrt(original_top_k / K) (original_top_k > 0).
  bool norm_topk_prob = false;
  double norm_topk_p = 1.0;
  bool restore_weight_scale = false;
  double expert_weight_scale = 1.0;
  int64_t original_top_k = 0;
  int64_t shared_hidden = 0;         // 0 = no shared expert; else each shared expert's width
  std::string shared_merge = "sum";  // sum | v1
  // Several shared experts and their gate (Olmo-core 3's SharedExperts num_experts and
  // shared_experts_router): w = score(x W_s^T + b_s) over the shared_experts experts (softmax, or
  // sigmoid + shared_router_sigmoid_eps), divided by its p-norm when shared_router_norm_p > 0; no
  // top-k, no auxiliary losses; the shared output is sum_e w[t,e] SharedExpert_e(x)[t]. More than
  // one shared expert needs the gate (as in Olmo-core 3).
  int64_t shared_experts = 1;
  bool shared_router = false;
  std::string shared_router_score = "softmax";  // softmax | sigmoid
  double shared_router_sigmoid_eps = 0;
  double shared_router_norm_p = 0;  // 0 = not normalized
  bool shared_router_bias = false;  // learned bias on the shared router's logits
  // Learned bias on the routed router's logits (Olmo-core 3's MoERouterV2 bias = true): trained,
  // unlike the selection-only router bias of loss-free balancing / score_correction_bias.
  bool router_logit_bias = false;
  std::string routing = "learned";   // learned | uniform | random
  double router_bias_gamma = 0.0;    // > 0 enables loss-free balancing
  // The router bias (added to the selection values) also without loss-free balancing: loaded
  // (checkpoint, import) and kept fixed (Olmo-core 3's score_correction_bias, DeepSeek-V3's
  // e_score_correction_bias). With router_bias_gamma > 0 it is the same bias, updated.
  bool score_correction_bias = false;
  // Group-limited routing (Olmo-core 3's n_group / topk_group): the experts form n_group groups
  // of consecutive ids; each token chooses among the topk_group groups whose two best selection
  // values sum highest. 0 = off (both 0).
  int64_t n_group = 0;
  int64_t topk_group = 0;
  double init_std = 0.02;
  // The embedding's output: embed(ids) * embed_scale, then an RMSNorm (weight embed_norm) when
  // embedding_norm (Olmo-core 3's embed_scale, sqrt(d_model) in its MoE scripts, and embedding_norm).
  double embed_scale = 1.0;
  bool embedding_norm = false;
  // Padding token (-1 = none), as transformers' padding_idx: positions whose next token is the
  // pad id carry no label, its embedding row gets no gradient (weight decay still applies) and
  // starts at zero. Hugging Face pad_token_id.
  int64_t pad_id = -1;
  // Longest sequence the model is meant for (0 = train.seq_len): Hugging Face
  // max_position_embeddings, kept through import and export. Metadata only: RoPE has no limit.
  int64_t max_position_embeddings = 0;

  int64_t hd() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  // All shared experts' hidden units (their weights are stacked: one GEMM computes them all).
  int64_t shared_width() const { return shared_experts * shared_hidden; }
  int64_t dense_width() const { return dense_hidden > 0 ? dense_hidden : top_k * expert_hidden + shared_width(); }
  // The head dims RoPE rotates: int(hd * rope_partial), as Python's int() truncates.
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(hd()) * rope_partial); }
  // Dense or MoE FFN per layer (n_dense_layers or dense_layers). MoE layers are numbered 0..M-1
  // in layer order (router biases, step statistics): moe_index(layer) and its inverse moe_layer(m).
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;
  int64_t num_dense_layers() const { return n_layers - num_moe_layers(); }
  int64_t moe_index(int64_t layer) const;
  int64_t moe_layer(int64_t m) const;
  // The routed weights' normalization p (0 = none) and their constant factor (config above).
  double expert_weight_norm_p() const;
  double expert_weight_factor() const;
  // Keys a query of `layer` may see, counting itself: the window, or 0 for full causal attention.
  int64_t attention_window(int64_t layer) const;
  // Whether `layer` applies RoPE (model.rope).
  bool rope_on(int64_t layer) const;
  // The distinct windows of the model's layers, increasing (empty: every layer full).
  std::vector<int64_t> attention_windows() const;
  // Query-key pairs of one layer's attention over a sequence of S tokens: S(S+1)/2 causal, less
  // what the window cuts (Olmo-core 3's _causal_attention_positions).
  double attention_pairs(int64_t layer, int64_t S) const;
  // The router bias takes part in the choice (loss-free balancing or score_correction_bias).
  bool router_bias_selects() const { return router_bias_gamma > 0 || score_correction_bias; }
  // Throws moe::Error naming the inconsistent fields.
  void validate() const;
  int64_t num_params() const;
  // Parameters one token touches: routed experts counted K times out of E; embedding excluded.
  // By part: attention projections, the routed experts' router, the experts (routed, shared and
  // the shared experts' router), dense FFN layers, the LM head.
  struct ActiveParams {
    int64_t attention = 0, router = 0, experts = 0, dense_ffn = 0, lm_head = 0;
    int64_t total() const { return attention + router + experts + dense_ffn + lm_head; }
  };
  ActiveParams active_matmul_params_by_part() const;
  int64_t num_active_matmul_params() const;
  // Training FLOPs per token, causal attention: 6*active + 12*H*hd*sum over layers of
  // attention_pairs / S (= 12*L*H*hd*(S+1)/2 without sliding windows).
  double train_flops_per_token(int64_t seq_len) const;
  // The same split as active_matmul_params_by_part (the bench's phases), the causal products in
  // attention. Sums to train_flops_per_token.
  struct TrainFlops {
    double attention = 0, router = 0, experts = 0, dense_ffn = 0, lm_head = 0;
    double total() const { return attention + router + experts + dense_ffn + lm_head; }
  };
  TrainFlops train_flops_by_part(int64_t seq_len) const;
  // The non-causal convention many published MFU figures use: 6*active + 12*L*H*hd*S (a windowed layer: its window).
  double train_flops_per_token_noncausal(int64_t seq_len) const;
};

// The model's string-valued keys as enums, parsed once (model_choices) so that no step compares
// strings. The strings stay in ModelConfig: they are what TOML, checkpoints and exports carry.
enum class NormPlacement { kPre, kPeri, kReordered };
enum class QkNorm { kNone, kFull, kPerHead };
enum class ScoreFunc { kSoftmax, kSigmoid, kTopkSoftmax };
enum class Routing { kLearned, kUniform, kRandom };
enum class SharedMerge { kSum, kV1 };
struct ModelChoices {
  NormPlacement norm_placement = NormPlacement::kPre;
  QkNorm qk_norm = QkNorm::kFull;
  ScoreFunc score_func = ScoreFunc::kSoftmax;
  Routing routing = Routing::kLearned;
  SharedMerge shared_merge = SharedMerge::kSum;
  ScoreFunc shared_router_score = ScoreFunc::kSoftmax;  // softmax | sigmoid (the shared experts' gate)
  // Sublayer norms: on the input (pre, peri) and on the output (peri, reordered).
  bool input_norm() const { return norm_placement != NormPlacement::kReordered; }
  bool output_norm() const { return norm_placement != NormPlacement::kPre; }
};
// Throws moe::Error naming the key whose value is not one of its allowed strings.
ModelChoices model_choices(const ModelConfig& config);

struct LossConfig {
  double lm_z_coef = 0.0;
  double lbl_coef = 0.01;
  double router_z_coef = 0.001;
  // The load-balancing and router z-losses are sums over the step's micro-batches, each weighted
  // T_m / divisor: "tokens" (all the step's tokens: a token-weighted mean) or "labelled" (the
  // step's labelled positions, as Olmo-core 3's train module divides them).
  std::string aux_divisor = "tokens";
  // What the load-balancing loss balances (Olmo-core 3's lb_loss_granularity and
  // global_load_balancing): "local_batch" each micro-batch's tokens on this rank; "instance" each
  // sequence (the loss is the mean over the micro-batch's sequences); "global" the counts of the
  // micro-batch summed over the data-parallel group and divided by its size (an all-reduce of E
  // integers per MoE layer and micro-batch), against this rank's probabilities.
  std::string lbl_granularity = "local_batch";
};

struct OptimConfig {
  double lr = 3e-3;
  double min_lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool no_decay_embeddings_norms = true;
  double max_grad_norm = 1.0;  // 0 = no clipping
  std::string schedule = "cosine";  // cosine | linear | wsd | constant
  int64_t warmup_steps = 100;
  int64_t decay_steps = 0;  // wsd only
};

struct TrainConfig {
  int64_t steps = 1000;
  int64_t seq_len = 256;
  int64_t batch_size = 16;        // sequences per optimizer step
  int64_t micro_batch_size = 8;   // sequences per forward/backward
  uint64_t seed = 1234;
  std::string precision = "fp32";  // fp32 | bf16 | mxfp8 (bf16, MXFP8 where [mxfp8] says)
  std::string backend = "cpu";     // cpu | ref
  int64_t threads = 0;             // 0 = all cores
  bool recompute = false;          // recompute each block in backward
  bool deterministic_attention = true;  // cuda: cuDNN's deterministic attention backward
  // The host enqueues step n+1 before it reads step n's record (Trainer::submit): the device
  // never waits for the host between steps. Drained before evaluations, checkpoints and the end.
  bool overlap_host = true;
  int64_t log_every = 10;
  int64_t eval_every = 100;
  int64_t eval_batches = 8;
  double time_limit_s = 0;         // stop after this many seconds (0 = no limit)
  std::string out_dir = "runs/default";
  std::string init_from;           // "" = random init; else a parameter file (import-hf output)
  std::string on_nonfinite = "stop";  // stop | skip: NaN/Inf in the loss or gradients
  // Live progress line: auto = only when stdout is a terminal and no launcher (mpirun/srun)
  // started the process (Open MPI forwards output through a terminal even when redirected).
  std::string progress = "auto";  // auto | on | off
};

struct DataConfig {
  // One file, or several comma-separated files concatenated into one stream in the order given.
  std::string train_path = "data/kjv/train.bin";
  std::string valid_path = "data/kjv/valid.bin";
  std::string token_dtype = "uint16";  // uint8 | uint16 | uint32 (a .npy header must match)
  int64_t eos_id = -1;                 // document separator id (-1 = none); HF eos_token_id
  int64_t bos_id = -1;                 // beginning-of-sequence id for the HF export (-1 = none); never inserted
  bool intra_doc_mask = false;         // attention stays within documents (needs eos_id)
};

// Metrics file and warnings (train/metrics.h).
struct MetricsConfig {
  double peak_tflops = 0;          // MFU denominator; 0 = this machine's measured peak for the precision
  int64_t vectors_every = 100;     // steps between per-expert f and P vectors in metrics.jsonl (0 = never)
  int64_t gerrymander_window = 50; // steps in the token-gerrymandering detector's window (0 = off)
  bool report = true;              // train writes out_dir/report.html at every checkpoint and at the end
};

struct CheckpointConfig {
  std::string dir;        // "" = <train.out_dir>/checkpoints
  int64_t every = 0;      // save every N steps (0 = only at the end of the run)
  int64_t keep_last = 3;  // complete checkpoints kept; older ones are pruned after a save is durable
  bool at_end = true;     // save when the run stops
};

// Process layout (src/config/layout.h): world = pp x dp; ep divides dp.
struct ParallelConfig {
  int64_t dp = 1;  // data-parallel replicas per pipeline stage
  int64_t ep = 1;  // expert-parallel group size (divides dp and num_experts)
  int64_t pp = 1;  // pipeline stages (at most n_layers)
  // Interleaved 1F1B (Megatron's virtual stages, Olmo-core 3's production schedule): model chunks
  // per pipeline stage; the layers form pp x pp_interleave chunks, stage s holding chunks s,
  // s + pp, ... (parallel/pipeline_schedule.h). 1 = plain 1F1B.
  int64_t pp_interleave = 1;
  bool zero1 = false;  // shard Adam moments over dp (dense) and edp (experts)
  bool overlap_grad_reduce = false;  // DDP: per-layer all-reduce started during the backward
  // Expert parallelism: each receiving rank keeps at most ceil(cf * top_k * tokens per rank)
  // rows per MoE layer and micro-batch, dropping the tail (local expert, then source rank
  // order). 0 = dropless.
  double ep_capacity_factor = 0;
  // How expert-parallel rows travel (parallel/expert_exchange.h): "p2p" (one message per (rank, local
  // expert) block, sized by the plan: one host read of the counts per plan) or "padded" (fixed
  // per-peer slabs through one all-to-all: nothing read on the host, (ep - 1) whole slabs sent).
  std::string ep_transport = "p2p";
  // Layers per pipeline stage, comma-separated ("1,3"); "" = balanced (config/layout.h).
  std::string stage_layers;
  // What carries tensors between ranks: "mpi" (host buffers; staged on a GPU) or "nccl" (device
  // buffers, train.backend = "cuda"). Host-side agreement checks always use MPI.
  std::string communicator = "mpi";
};

inline Layout layout_from_config(const ParallelConfig& c) { return Layout{c.dp, c.ep, c.pp}; }
// parallel.pp_interleave > 1 against the layout: pp > 1 and micro-batches per step a multiple of
// pp. Throws naming the keys.
struct Config;
void check_interleave(const Config& config);
// The layer chunks of pipeline stage `stage` under parallel.pp, pp_interleave and stage_layers
// (one chunk without interleaving).
inline std::vector<LayerRange> configured_stage_chunks(const ParallelConfig& c, int64_t n_layers, int64_t stage) {
  return stage_chunks(c.stage_layers, c.pp, c.pp_interleave, n_layers, stage);
}

// Where train.precision = "mxfp8" quantizes (core/mxfp8.h; as Olmo-core 3's switches). Everything
// else runs as in bf16 mode.
struct MxConfig {
  bool experts = true;        // the routed experts' GEMMs (forward, data gradient); weight gradients bf16
  bool dispatch = true;       // EP: the experts' input rows cross the wire quantized (needs experts)
  bool attention = false;     // the q/k/v/o projections' GEMMs (forward, data gradient); weight gradients bf16
  std::string scale_rule = "rceil";  // rceil (NVIDIA's recipe) | floor (the OCP rule)
  std::string grad_format = "e4m3";  // e4m3 | e5m2: the output gradients' elements in data gradients
};

struct Config {
  ModelConfig model;
  MxConfig mxfp8;
  LossConfig loss;
  OptimConfig optim;
  TrainConfig train;
  DataConfig data;
  MetricsConfig metrics;
  CheckpointConfig checkpoint;
  ParallelConfig parallel;

  void validate() const;
};

// Parses TOML text (an empty string gives the defaults) and applies "section.key=value"
// overrides in order. Errors name the key, the value and what is allowed.
Config parse_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                    const std::string& source_name = "config");
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
// Loads the config embedded in a fixture or checkpoint (JSON with the same sections/keys).
Config config_from_json(const std::string& json_text);
std::string config_to_toml(const Config& config);
// Every key in table order with its value as config_to_toml writes it: {"model.d_model", "256"}.
std::vector<std::pair<std::string, std::string>> config_entries(const Config& config);
std::string config_to_json(const Config& config);
// The field table's ranges and choices, for configs that were not parsed (built in code, from a
// Hugging Face config.json, ...). section: only that section's keys ("" = all).
void check_ranges(const Config& config, const std::string& section);

}  // namespace moe
