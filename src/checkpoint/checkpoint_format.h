// What saving (checkpoint.cpp) and loading (checkpoint_load.cpp) a checkpoint share: the format's
// name and version, the dtype and checksum spellings, and the training state on the host.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "kernels/host_view.h"
#include "model/transformer.h"
#include "optim/adamw.h"

namespace moe::checkpoint_format {

constexpr int kFormatVersion = 2;  // 2: pieces in whole-model coordinates, any layout
constexpr const char* kFormat = "moecore-checkpoint";

inline std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

inline const char* st_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kE4M3: return "F8_E4M3";
    case DType::kE5M2: return "F8_E5M2";
    case DType::kE8M0: return "F8_E8M0";
  }
  return "?";
}

// The training state on the host: the backend's own memory (ref, cpu) or staged copies, kept
// alive while the pieces pointing into them are written (save) or filled (load, then commit).
struct HostState {
  HostState(const TrainingState& run, HostView::Mode mode)
      : params(run.model.ops(), run.model.params().flat, mode),
        exp_avg(run.model.ops(), run.optimizer.exp_avg(), mode),
        exp_avg_sq(run.model.ops(), run.optimizer.exp_avg_sq(), mode) {
    // Biases of layers another stage holds are not loaded: keep their contents (kRead).
    for (const OwnedTensor& b : run.model.router_bias()) router_bias.emplace_back(run.model.ops(), b.t);
  }
  void commit() {
    for (HostView* v : {&params, &exp_avg, &exp_avg_sq}) v->commit();
    for (HostView& v : router_bias) v.commit();
  }
  HostView params, exp_avg, exp_avg_sq;
  std::vector<HostView> router_bias;
};

}  // namespace moe::checkpoint_format
