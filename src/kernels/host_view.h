// Host access to a backend tensor outside the training step (initialization, checkpoints,
// evaluation output, exports): the tensor's own memory when the backend's memory is the host's
// (ref, cpu: no copy), else a staged host copy -- downloaded (counted) when reading, uploaded by
// commit() after writing. The training step itself uses Backend::download/upload directly.
#pragma once

#include <cstring>
#include <vector>

#include "kernels/ops.h"

namespace moe {

class HostView {
 public:
  enum Mode { kRead, kWrite };  // kWrite: contents start undefined and are meant to be overwritten
  HostView(Backend& ops, const Tensor& t, Mode mode = kRead) : ops_(ops), t_(t) {
    if (ops.host_addressable() || t.data == nullptr) {
      host_ = t;
      return;
    }
    staged_.resize(t.nbytes());
    host_ = t;
    host_.data = staged_.data();
    host_.device = Device::kCpu;
    if (mode == kRead) {
      ops.download(t, staged_.data());
      ops.synchronize();
    }
  }
  // The host tensor (same dtype and shape).
  const Tensor& tensor() const { return host_; }
  template <class T> T* as() const { return host_.as<T>(); }
  void* data() const { return host_.data; }
  // Writes the host copy back to the backend (no-op when there is none).
  void commit() {
    if (staged_.empty()) return;
    ops_.upload(staged_.data(), t_);
    ops_.synchronize();
  }

 private:
  Backend& ops_;
  Tensor t_, host_;
  std::vector<unsigned char> staged_;
};

}  // namespace moe
