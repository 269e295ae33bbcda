#include "parallel/parallelize.h"

#include <algorithm>

#include "parallel/p2p_transport.h"
#include "parallel/padded_transport.h"
#include "parallel/pipeline_schedule.h"

namespace moe {

namespace {
ExchangeTransportKind transport_kind(const ParallelConfig& p) {
  return p.ep_transport == "padded" ? ExchangeTransportKind::kPadded : ExchangeTransportKind::kP2p;
}
}  // namespace

ModelOptions model_options(const Config& config, DType compute, const ProcessGroups* groups) {
  ModelOptions o;
  o.compute = compute;
  // mxfp8: bf16 operands around the MXFP8 expert GEMMs (the f64 reference path keeps f64).
  o.bf16_operands = config.train.precision == "bf16" || (config.train.precision == "mxfp8" && compute == DType::kF32);
  o.mx = mx_mode(config);
  o.recompute = config.train.recompute;
  o.batch = config.train.micro_batch_size;
  o.seq_len = config.train.seq_len;
  o.seed = config.train.seed;
  if (!groups) return o;
  const Layout& layout = groups->layout;
  o.shard.chunks = configured_stage_chunks(config.parallel, config.model.n_layers, groups->coords.pp);
  // 1F1B: this stage holds at most min(pp - stage, micro-batches) micro-batches of activations;
  // interleaved, each chunk what its schedule keeps in flight.
  const int64_t micro_batches = config.train.batch_size / layout.dp / o.batch;
  o.chunk_slots = stage_chunk_slots(layout.pp, groups->coords.pp, micro_batches, config.parallel.pp_interleave);
  o.shard.num_local_experts = config.model.num_experts / layout.ep;
  o.shard.expert_begin = groups->coords.ep * o.shard.num_local_experts;
  if (config.parallel.zero1) {
    o.dense_chunks = layout.dp;
    o.expert_chunks = layout.edp();
  }
  o.ep = layout.ep;
  o.ep_capacity_factor = config.parallel.ep_capacity_factor;
  o.ep_transport = transport_kind(config.parallel);
  return o;
}

std::unique_ptr<ExpertExchange> make_expert_exchange(const Transformer& model, Communicator& ep,
                                                     ExchangeTransportKind transport_kind, double capacity_factor,
                                                     Backend& ops) {
  const ModelConfig& c = model.config();
  const ModelShard& shard = model.layout().shard();
  MOE_CHECK(shard.expert_begin == ep.rank() * shard.num_local_experts, "expert shard [", shard.expert_begin, ", ",
            shard.expert_begin + shard.num_local_experts, ") does not match EP rank ", ep.rank(), " of ", ep.size(),
            " over ", c.num_experts, " experts");
  MOE_CHECK((transport_kind == ExchangeTransportKind::kPadded) == (model.dims().slab_rows > 0),
            "the model's activation plan was made for the other expert transport");
  std::unique_ptr<ExpertTransport> transport;
  if (transport_kind == ExchangeTransportKind::kPadded)
    transport = std::make_unique<PaddedExpertTransport>(ep, ops, c.num_experts, model.dims().slab_rows);
  else
    transport = std::make_unique<P2pExpertTransport>(ep, ops, c.num_experts);
  int64_t slots = 0;
  for (int64_t k = 0; k < model.pipeline_chunks(); ++k) slots = std::max(slots, model.pipeline_slots(k));
  return std::make_unique<ExpertExchange>(std::move(transport), ops, c.num_experts,
                                          expert_capacity(model.dims().T, c.top_k, capacity_factor), slots,
                                          c.num_moe_layers());
}

ParallelModel parallelize(Transformer& model, const Config& config, ProcessGroups* groups, GradSync& sync,
                          Backend& ops) {
  ParallelModel p;
  if (model.ep_size() > 1) {
    MOE_CHECK(groups != nullptr && groups->ep && groups->ep->size() == model.ep_size(), "a model built for ep = ",
              model.ep_size(), " needs its expert-parallel group");
    p.exchange = make_expert_exchange(model, *groups->ep, transport_kind(config.parallel),
                                      config.parallel.ep_capacity_factor, ops);
    model.set_expert_dispatch(p.exchange.get());
  }
  if (sync.overlapping()) model.set_layer_grads_hook([&sync](int64_t layer) { sync.layer_done(layer); });
  if (config.loss.lbl_granularity == "global")  // Olmo-core 3's global_load_balancing
    model.set_count_sum(CountSum{[&sync](const Tensor& counts) { sync.sum_over_dp(counts); }, sync.dp_size()});
  return p;
}

}  // namespace moe
