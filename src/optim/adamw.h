// AdamW over the model's flat parameter buffer. The first and second moments cover the element
// ranges of the flat buffer this rank owns: all of it in a single process or plain DDP, or one
// 1/dp chunk of the dense region and one 1/edp chunk of the expert region with ZeRO-1
// (src/parallel/grad_sync.h decides the ranges). The moments are one buffer each, laid out as
// the owned ranges back to back; `slices()` maps them to parameters (checkpoints use it).
#pragma once

#include <utility>
#include <vector>

#include "config/config.h"
#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/params.h"

namespace moe {

// The part of one parameter whose optimizer state this rank holds.
struct StateSlice {
  const ParamInfo* param = nullptr;
  int64_t param_begin = 0;   // first element inside the (local) parameter
  int64_t count = 0;
  int64_t state_offset = 0;  // where it sits in exp_avg() / exp_avg_sq()
  int64_t flat_offset() const { return param->offset + param_begin; }  // in the local flat buffer
};

class AdamW {
 public:
  // owned: sorted, disjoint [begin, end) ranges of the flat buffer; empty = all of it.
  // The moments live in the backend's memory, zeroed here.
  AdamW(Backend& ops, const ParamLayout& layout, const OptimConfig& config, DType dtype,
        std::vector<std::pair<int64_t, int64_t>> owned = {});
  // One update of the owned elements, reading gradients at the same flat offsets, with the
  // learning rate and step from a device control tensor (the step_control op), applied by the
  // backend only when control says the step is finite; the host sets its counter
  // (set_steps_taken) once it has read the step's outcome. The gradients are read clipped by
  // control's coefficient (they are left as they are). copies, when given (the bf16 operand
  // weights, laid out like params), receive bf16 of the updated owned elements in the same pass.
  void step_by_control(Backend& ops, const Weights& params, const Weights& grads, const Tensor& control,
                       const Weights* copies = nullptr) const;
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }
  const Tensor& exp_avg() const { return m_.t; }
  const Tensor& exp_avg_sq() const { return v_.t; }
  const std::vector<StateSlice>& slices() const { return slices_; }
  // Bytes of optimizer state on this rank (both moments).
  size_t state_bytes() const { return m_.t.nbytes() + v_.t.nbytes(); }

 private:
  OptimConfig config_;
  std::vector<StateSlice> slices_;
  OwnedTensor m_, v_;
  int64_t step_ = 0;
};

}  // namespace moe
