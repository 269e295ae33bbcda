#include "parallel/communicator.h"

#include <algorithm>
#include <cstdlib>

#include <cstring>
#include <numeric>

#include "core/check.h"

namespace moe {

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kAllToAllV: return "all_to_all_v";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kBarrier: return "barrier";
  }
  return "?";
}

uint64_t CommStats::total_sent() const { return std::accumulate(bytes_sent.begin(), bytes_sent.end(), uint64_t{0}); }

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    if (impl_) impl_->wait();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Request::~Request() {
  if (impl_) impl_->wait();
}

void Request::wait() {
  if (!impl_) return;
  impl_->wait();
  impl_.reset();
}

bool Request::test() {
  if (!impl_) return true;
  if (!impl_->test()) return false;
  impl_.reset();
  return true;
}

void wait_all(std::vector<Request>& requests) {
  for (Request& r : requests) r.wait();
}

void Communicator::account(CommOp op, uint64_t sent, uint64_t received) {
  const int i = static_cast<int>(op);
  stats_.bytes_sent[i] += sent;
  stats_.bytes_received[i] += received;
  stats_.calls[i] += 1;
}

namespace {
void check_reducible(DType dtype, const char* op) {
  MOE_CHECK(dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kI32, op,
            ": sum needs f32, f64 or i32, got ", dtype_name(dtype));
}
void check_vec(const std::vector<int64_t>& v, int size, const char* what) {
  MOE_CHECK(static_cast<int>(v.size()) == size, "all_to_all_v: ", what, " has ", v.size(),
            " entries for ", size, " ranks");
  for (int64_t x : v) MOE_CHECK(x >= 0, "all_to_all_v: negative entry ", x, " in ", what);
}
}  // namespace

Request Communicator::iall_reduce_sum(void* buf, size_t count, DType dtype) {
  check_reducible(dtype, "all_reduce");
  account(CommOp::kAllReduce, size() > 1 ? count * dtype_size(dtype) : 0, 0);
  return do_all_reduce_sum(buf, count, dtype);
}

Request Communicator::ireduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) {
  check_reducible(dtype, "reduce_scatter");
  account(CommOp::kReduceScatter, static_cast<uint64_t>(size() - 1) * recv_count * dtype_size(dtype), 0);
  return do_reduce_scatter_sum(send, recv, recv_count, dtype);
}

Request Communicator::iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  account(CommOp::kAllGather, static_cast<uint64_t>(size() - 1) * send_count * dtype_size(dtype), 0);
  return do_all_gather(send, recv, send_count, dtype);
}

void Communicator::all_reduce_sum(void* buf, size_t count, DType dtype) {
  check_reducible(dtype, "all_reduce");
  account(CommOp::kAllReduce, size() > 1 ? count * dtype_size(dtype) : 0, 0);
  do_all_reduce_sum_blocking(buf, count, dtype);
}

void Communicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_displs, void* recv,
                                const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                DType dtype) {
  account_all_to_all_v(send_counts, send_displs, recv_counts, recv_displs, dtype);
  do_all_to_all_v_blocking(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
}

Request Communicator::iall_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                    const std::vector<int64_t>& send_displs, void* recv,
                                    const std::vector<int64_t>& recv_counts,
                                    const std::vector<int64_t>& recv_displs, DType dtype) {
  account_all_to_all_v(send_counts, send_displs, recv_counts, recv_displs, dtype);
  return do_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
}

void Communicator::account_all_to_all_v(const std::vector<int64_t>& send_counts,
                                        const std::vector<int64_t>& send_displs,
                                        const std::vector<int64_t>& recv_counts,
                                        const std::vector<int64_t>& recv_displs, DType dtype) {
  const int n = size();
  check_vec(send_counts, n, "send_counts");
  check_vec(send_displs, n, "send_displs");
  check_vec(recv_counts, n, "recv_counts");
  check_vec(recv_displs, n, "recv_displs");
  uint64_t sent = 0, received = 0;
  for (int j = 0; j < n; ++j) {
    if (j == rank()) continue;
    sent += static_cast<uint64_t>(send_counts[j]);
    received += static_cast<uint64_t>(recv_counts[j]);
  }
  account(CommOp::kAllToAllV, sent * dtype_size(dtype), received * dtype_size(dtype));
}

Request Communicator::isend(const void* buf, size_t count, DType dtype, int dest, int tag) {
  MOE_CHECK(dest >= 0 && dest < size(), "send: destination ", dest, " is not a rank of ", size());
  account(CommOp::kSend, count * dtype_size(dtype), 0);
  return do_send(buf, count, dtype, dest, tag);
}

Request Communicator::irecv(void* buf, size_t count, DType dtype, int source, int tag) {
  MOE_CHECK(source >= 0 && source < size(), "recv: source ", source, " is not a rank of ", size());
  account(CommOp::kRecv, 0, count * dtype_size(dtype));
  return do_recv(buf, count, dtype, source, tag);
}

Request Communicator::ibroadcast(void* buf, size_t count, DType dtype, int root) {
  MOE_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of ", size());
  const uint64_t bytes = count * dtype_size(dtype);
  account(CommOp::kBroadcast, rank() == root ? static_cast<uint64_t>(size() - 1) * bytes : 0,
          rank() == root ? 0 : bytes);
  return do_broadcast(buf, count, dtype, root);
}

Request Communicator::ibarrier() {
  account(CommOp::kBarrier, 0, 0);
  return do_barrier();
}

// ---- SelfCommunicator ----

std::unique_ptr<Communicator> SelfCommunicator::split(int, int) { return std::make_unique<SelfCommunicator>(); }

Request SelfCommunicator::do_all_reduce_sum(void*, size_t, DType) { return {}; }

Request SelfCommunicator::do_reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) {
  if (recv_count && send != recv) std::memmove(recv, send, recv_count * dtype_size(dtype));
  return {};
}

Request SelfCommunicator::do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  if (send_count && send != recv) std::memmove(recv, send, send_count * dtype_size(dtype));
  return {};
}

Request SelfCommunicator::do_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                          const std::vector<int64_t>& send_displs, void* recv,
                                          const std::vector<int64_t>& recv_counts,
                                          const std::vector<int64_t>& recv_displs, DType dtype) {
  MOE_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: rank 0 sends ", send_counts[0],
            " elements to itself but expects ", recv_counts[0]);
  const size_t e = dtype_size(dtype);
  if (send_counts[0])
    std::memmove(static_cast<char*>(recv) + recv_displs[0] * e, static_cast<const char*>(send) + send_displs[0] * e,
                 static_cast<size_t>(send_counts[0]) * e);
  return {};
}

Request SelfCommunicator::do_send(const void*, size_t, DType, int, int) {
  MOE_FAIL("send to self on a size-1 communicator would never be matched");
}
Request SelfCommunicator::do_recv(void*, size_t, DType, int, int) {
  MOE_FAIL("recv from self on a size-1 communicator would never be matched");
}
Request SelfCommunicator::do_broadcast(void*, size_t, DType, int) { return {}; }
Request SelfCommunicator::do_barrier() { return {}; }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

int launch_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

std::unique_ptr<Communicator> launch_world() {
  if (launched_by_mpi()) return mpi_world();
  return std::make_unique<SelfCommunicator>();
}

// Every rank's string, in rank order (all-gather of the lengths, then of the padded bytes).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  int32_t len = static_cast<int32_t>(mine.size());
  std::vector<int32_t> lens(static_cast<size_t>(n));
  comm.all_gather(&len, lens.data(), 1, DType::kI32);
  const int32_t max_len = *std::max_element(lens.begin(), lens.end());
  const size_t words = static_cast<size_t>(max_len + 3) / 4;
  std::vector<int32_t> send(words, 0), recv(words * static_cast<size_t>(n));
  std::memcpy(send.data(), mine.data(), mine.size());
  comm.all_gather(send.data(), recv.data(), words, DType::kI32);
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(reinterpret_cast<const char*>(recv.data() + static_cast<size_t>(r) * words),
                     static_cast<size_t>(lens[static_cast<size_t>(r)]));
  return out;
}

}  // namespace moe
