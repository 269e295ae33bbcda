#include "parallel/staged_comm.h"

#include <cstring>

namespace moe {

namespace {
// A device communicator (NCCL) takes a chunk buffer that is this rank's chunk of the whole buffer
// (in place) or apart from it; any other overlap is refused.
void check_device_overlap(const Communicator& c, const Tensor& whole, const Tensor& chunk, const char* op) {
  const char* w = static_cast<const char*>(whole.data);
  const char* p = static_cast<const char*>(chunk.data);
  const bool apart = p + chunk.nbytes() <= w || p >= w + whole.nbytes();
  const bool in_place = p == w + static_cast<size_t>(c.rank()) * chunk.nbytes();
  MOE_CHECK(apart || in_place, op, ": on a device communicator the rank's chunk must be its own slot of the whole "
            "buffer or lie outside it");
}
}  // namespace

void* StagedComm::to_host(const Tensor& t, std::vector<unsigned char>& buf) {
  if (buf.size() < t.nbytes()) buf.resize(t.nbytes());
  ops_.download(t, buf.data());
  ops_.wait(ops_.record());
  ++staged_.to_host;
  staged_.to_host_bytes += t.nbytes();
  return buf.data();
}

void StagedComm::to_device(const void* host, const Tensor& t) {
  ops_.upload(host, t);
  ++staged_.to_device;
  staged_.to_device_bytes += t.nbytes();
}

void StagedComm::all_reduce_sum(Communicator& c, const Tensor& t) {
  if (direct(c)) return c.all_reduce_sum(t.data, static_cast<size_t>(t.numel()), t.dtype);
  void* h = to_host(t, a_);
  c.all_reduce_sum(h, static_cast<size_t>(t.numel()), t.dtype);
  to_device(h, t);
}

void StagedComm::reduce_scatter_sum(Communicator& c, const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel() * c.size(), "reduce_scatter: ", src.shape_str(),
            " over ", c.size(), " ranks does not give ", dst.shape_str());
  const size_t n = static_cast<size_t>(dst.numel());
  if (direct(c) && c.buffer_device() != Device::kCpu) {  // device: NCCL's in-place form, or disjoint buffers
    check_device_overlap(c, src, dst, "reduce_scatter");
    return c.reduce_scatter_sum(src.data, dst.data, n, src.dtype);
  }
  if (b_.size() < dst.nbytes()) b_.resize(dst.nbytes());  // MPI send and receive buffers must not alias
  if (direct(c)) {
    c.reduce_scatter_sum(src.data, b_.data(), n, src.dtype);
    std::memcpy(dst.data, b_.data(), dst.nbytes());
    return;
  }
  void* h = to_host(src, a_);
  c.reduce_scatter_sum(h, b_.data(), n, src.dtype);
  to_device(b_.data(), dst);
}

void StagedComm::all_gather(Communicator& c, const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.dtype == dst.dtype && dst.numel() == src.numel() * c.size(), "all_gather: ", src.shape_str(), " over ",
            c.size(), " ranks does not give ", dst.shape_str());
  const size_t n = static_cast<size_t>(src.numel());
  if (direct(c) && c.buffer_device() != Device::kCpu) {
    check_device_overlap(c, dst, src, "all_gather");
    return c.all_gather(src.data, dst.data, n, src.dtype);
  }
  if (direct(c)) {
    if (b_.size() < src.nbytes()) b_.resize(src.nbytes());
    std::memcpy(b_.data(), src.data, src.nbytes());
    c.all_gather(b_.data(), dst.data, n, src.dtype);
    return;
  }
  void* h = to_host(src, b_);
  if (a_.size() < dst.nbytes()) a_.resize(dst.nbytes());
  c.all_gather(h, a_.data(), n, src.dtype);
  to_device(a_.data(), dst);
}

void StagedComm::all_to_all(Communicator& c, const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel() && src.numel() % c.size() == 0, "all_to_all: ",
            src.shape_str(), " -> ", dst.shape_str(), " is not size x chunk over ", c.size(), " ranks");
  const auto n = static_cast<size_t>(c.size());
  const int64_t chunk = src.numel() / c.size();
  counts_.assign(n, chunk);
  displs_.resize(n);
  for (size_t q = 0; q < n; ++q) displs_[q] = static_cast<int64_t>(q) * chunk;
  const char *a = static_cast<const char*>(src.data), *b = static_cast<const char*>(dst.data);
  MOE_CHECK(a + src.nbytes() <= b || b + dst.nbytes() <= a, "all_to_all: the send and receive buffers overlap");
  if (direct(c)) {
    return c.all_to_all_v(src.data, counts_, displs_, dst.data, counts_, displs_, src.dtype);
  }
  void* h = to_host(src, b_);
  if (a_.size() < dst.nbytes()) a_.resize(dst.nbytes());
  c.all_to_all_v(h, counts_, displs_, a_.data(), counts_, displs_, src.dtype);
  to_device(a_.data(), dst);
}

void StagedComm::send(Communicator& c, const Tensor& t, int peer, int tag) {
  if (direct(c)) return c.send(t.data, static_cast<size_t>(t.numel()), t.dtype, peer, tag);
  c.send(to_host(t, a_), static_cast<size_t>(t.numel()), t.dtype, peer, tag);
}

void StagedComm::recv(Communicator& c, const Tensor& t, int peer, int tag) {
  if (direct(c)) return c.recv(t.data, static_cast<size_t>(t.numel()), t.dtype, peer, tag);
  if (a_.size() < t.nbytes()) a_.resize(t.nbytes());
  c.recv(a_.data(), static_cast<size_t>(t.numel()), t.dtype, peer, tag);
  to_device(a_.data(), t);
}

Request StagedComm::isend(Communicator& c, const Tensor& t, int peer, int tag, std::vector<unsigned char>& host) {
  if (direct(c)) return c.isend(t.data, static_cast<size_t>(t.numel()), t.dtype, peer, tag);
  return c.isend(to_host(t, host), static_cast<size_t>(t.numel()), t.dtype, peer, tag);
}

void StagedComm::broadcast(Communicator& c, const Tensor& t, int root) {
  if (direct(c)) return c.broadcast(t.data, static_cast<size_t>(t.numel()), t.dtype, root);
  void* h = to_host(t, a_);
  c.broadcast(h, static_cast<size_t>(t.numel()), t.dtype, root);
  to_device(h, t);
}

}  // namespace moe
