// Communication over backend tensors. When the communicator's buffers live where the backend's
// do -- host memory with MPI on ref and cpu, device memory with NCCL on cuda -- tensors go to it as
// they are; otherwise (strict, cuda over MPI) each buffer is staged through a host copy --
// download, wait, communicate, upload -- and the staged bytes are counted here, apart from the
// step's own reads of the device.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "parallel/communicator.h"

namespace moe {

class StagedComm {
 public:
  explicit StagedComm(Backend& ops) : ops_(ops) {}
  Backend& ops() { return ops_; }
  // True when c takes this backend's tensors as they are: host memory to a host communicator, or
  // device memory to a device communicator (NCCL on cuda); otherwise buffers are staged.
  bool direct(const Communicator& c) const { return ops_.device() == c.buffer_device(); }

  void all_reduce_sum(Communicator& c, const Tensor& t);
  // src (size * n) -> dst (n), the sum of this rank's chunk; dst may lie inside src.
  void reduce_scatter_sum(Communicator& c, const Tensor& src, const Tensor& dst);
  // src (n) -> dst (size * n); src may lie inside dst.
  void all_gather(Communicator& c, const Tensor& src, const Tensor& dst);
  // src (size * n) -> dst (size * n): chunk q of src goes to rank q, chunk q of dst came from it
  // (a fixed-size all-to-all; counted as all_to_all_v). src and dst do not overlap.
  void all_to_all(Communicator& c, const Tensor& src, const Tensor& dst);
  void send(Communicator& c, const Tensor& t, int peer, int tag);
  void recv(Communicator& c, const Tensor& t, int peer, int tag);
  // Non-blocking send; `host` holds the staged bytes until the request completes (the caller
  // keeps it alive and untouched as long as the request).
  Request isend(Communicator& c, const Tensor& t, int peer, int tag, std::vector<unsigned char>& host);
  void broadcast(Communicator& c, const Tensor& t, int root);

  // What staging moved so far (to_host: downloads before sending, to_device: uploads after).
  const TransferStats& staged() const { return staged_; }

  // Host copy of t (download + wait), in buf.
  void* to_host(const Tensor& t, std::vector<unsigned char>& buf);
  // t <- host bytes (upload).
  void to_device(const void* host, const Tensor& t);

 private:
  Backend& ops_;
  std::vector<unsigned char> a_, b_;  // reused: no allocation once grown
  std::vector<int64_t> counts_, displs_;
  TransferStats staged_;
};

}  // namespace moe
