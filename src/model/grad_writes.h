// Which parameter gradients the step has written so far. A step's first write of a gradient
// overwrites it and later writes add (PyTorch's zero_grad(set_to_none=True)): no pass zero-fills
// the whole gradient buffer before the backward, and the weight-gradient GEMMs of the step's first
// micro-batch write their products instead of reading cold zeros to add them to. Ops that can only
// add (the embedding's scatter, norm weights) zero their gradient at its first write (prepare);
// gradients a step never writes are zeroed before they are read (zero_unwritten).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "model/params.h"

namespace moe {

class GradWrites {
 public:
  // grad_flat: the layout's gradient buffer; zero-filled here once (its padding between the
  // regions is never written by a step, and device memory starts undefined).
  GradWrites(const ParamLayout& layout, const Tensor& grad_flat, Backend& ops);

  void start_step();  // nothing written yet
  // For an op with an accumulate flag: false at the gradient's first write this step (the op
  // overwrites), true after. grad: a whole parameter's gradient view.
  bool accumulate(const Tensor& grad);
  // Before an op that adds into grad: zero-fills it at its first write this step.
  void prepare(const Tensor& grad);
  // Zero-fills the gradients not written this step: those of block `layer` (before its reduction
  // starts), or every one (kEvery: before the step's reduction).
  static constexpr int64_t kEvery = -2;
  void zero_unwritten(int64_t layer);

 private:
  size_t entry_of(const Tensor& grad) const;  // checked: grad must be a whole entry's view

  struct Entry {
    int64_t offset, numel, layer;  // the layout entry's (ParamInfo), in increasing offset
    std::string name;
  };
  std::vector<Entry> entries_;
  Tensor flat_;
  Backend& ops_;
  std::vector<uint8_t> written_;  // per entry
  std::vector<std::vector<size_t>> by_layer_;  // entries of block l at l + 1; outside the blocks at 0
};

}  // namespace moe
