// A layout applied to a built model. The model (src/model/) is the maths of one rank's share and
// crosses no ranks; what does is installed here, after it is built:
//   model_options   the one place a config becomes ModelOptions: this rank's layers and experts,
//                   its activation slots (the pipeline schedule's), ZeRO-1 chunks, the EP sizes;
//   parallelize     the expert exchange over the EP group (its transport by parallel.ep_transport),
//                   overlapped DDP's per-layer gradient hook, and global load balancing's count sum
//                   over the data-parallel group.
#pragma once

#include <memory>

#include "config/config.h"
#include "model/transformer.h"
#include "parallel/expert_exchange.h"
#include "parallel/grad_sync.h"
#include "parallel/process_groups.h"

namespace moe {

// groups == nullptr: one process holding the whole model.
ModelOptions model_options(const Config& config, DType compute, const ProcessGroups* groups);

// What parallelize installed and the model refers to; keep it as long as the model runs.
struct ParallelModel {
  std::unique_ptr<ExpertExchange> exchange;  // nullptr without expert parallelism
};

// The expert exchange of a model built with options.ep = ep.size() (rank r holding the r-th share
// of the experts), over its EP group; install it with model.set_expert_dispatch.
std::unique_ptr<ExpertExchange> make_expert_exchange(const Transformer& model, Communicator& ep,
                                                     ExchangeTransportKind transport, double capacity_factor,
                                                     Backend& ops);

// model must have been built from model_options(config, ..., groups); sync over its layout.
ParallelModel parallelize(Transformer& model, const Config& config, ProcessGroups* groups, GradSync& sync,
                          Backend& ops);

}  // namespace moe
