// The rows an expert-parallel exchange moves, predicted from the config alone: per rank, per
// micro-batch, per MoE layer. Exact for model.routing = "uniform" (the router_assign op: token g
// takes experts (g K + j) mod E, so every count is a closed form of the token's global index)
// run through the trainer's own plan arithmetic (ep_plan_arrays: rank-wide capacity, drops in
// local-expert then source-rank order); for learned and random routing the expectation under
// balanced routing, with the capacity drops of a normal approximation (stated as such).
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"

namespace moe {

// One EP rank's share of one exchange (one MoE layer, one micro-batch).
struct ExchangeRows {
  double dispatched = 0;  // kept rows of my tokens that go to other ranks' experts
  double returned = 0;    // rows my experts computed for other ranks' tokens (they go back)
  double received = 0;    // rows my experts compute (my own tokens' included)
  double routed = 0;      // routes of the whole EP group's tokens (T K ep)
  double dropped = 0;     // of which dropped by the capacity (whole EP group)
  int64_t send_blocks = 0;  // p2p: messages to other ranks toward the experts (one per non-empty block)
  int64_t return_blocks = 0;  // p2p: messages back
};

// Global index of the first token of micro-batch m on data-parallel rank dp_rank in optimizer
// step `step` (1-based), as the trainer numbers them (Trainer: MicroBatchScales::token_base).
int64_t micro_batch_token_base(const Config& c, int64_t step, int64_t dp_rank, int64_t micro);

// Tokens per expert of one micro-batch of T tokens starting at global token `base` under
// uniform routing: (E) counts.
std::vector<int32_t> uniform_expert_counts(int64_t base, int64_t tokens, int64_t top_k, int64_t num_experts);

// Every EP rank of the group whose first data-parallel rank is group_dp_begin, for micro-batch
// m of optimizer step `step`: exact under uniform routing, the expectation otherwise.
std::vector<ExchangeRows> exchange_rows(const Config& c, int64_t step, int64_t group_dp_begin, int64_t micro);

// Expected fraction of routes dropped at the configured capacity factor when each token picks
// K distinct experts uniformly at random (random routing; a balanced learned router's best
// case): rows a rank receives ~ normal with the hypergeometric mean and variance. 0 if dropless.
double expected_drop_fraction_random(const Config& c);

// The same under skewed routing: each token picks K distinct experts with weights (e + 1)^-skew
// (expert 0 the most popular; experts sit on ranks in id order, so the hottest share rank 0, the
// worst placement). Each expert's chance to be among a token's K is approximated by
// 1 - exp(-lambda w_e) with lambda making them sum to K; a rank's rows are normal with those means
// and variances (scaled to the hypergeometric at skew 0, where this is the random case exactly).
double expected_drop_fraction_skewed(const Config& c, double skew);

}  // namespace moe
