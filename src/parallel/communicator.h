// The communicator seam: every collective the distributed runtime uses, over raw buffers.
// Implementations: MPI (mpi_communicator.cpp, the only file that includes <mpi.h>) and
// SelfCommunicator (size 1, no MPI). An NCCL backend will implement the same interface.
//
// Counts and displacements are in elements of the given dtype. Buffers are host memory, or (a
// device communicator: NCCL) memory of the device buffer_device() names; a device communicator's
// operations are ordered on the device (wait() orders later device work after them; the host does
// not block).
// Non-blocking calls return a Request; the buffers must stay alive and untouched until wait()
// (or a test() that returned true). Open MPI progresses non-blocking collectives only inside MPI
// calls, so poll test() during long computations.
//
// Byte counters (per op kind, per communicator object): the payload bytes this rank sends to
// other ranks under the logical definition below, independent of the algorithm MPI picks.
//   all_reduce     : count * elem        (0 when size == 1)
//   reduce_scatter : (size - 1) * recv_count * elem   (the chunks other ranks own)
//   all_gather     : (size - 1) * send_count * elem   (my chunk, to every peer)
//   all_to_all_v   : sum of send_counts[j] * elem over j != rank (rows that leave this rank)
//   send           : count * elem;  recv: 0 sent (received bytes are counted separately)
//   broadcast      : root: (size - 1) * count * elem; others 0
//   barrier        : 0
// Non-blocking variants count when issued. calls[] counts operations.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moe {

enum class CommOp : uint8_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kAllToAllV,
  kSend,
  kRecv,
  kBroadcast,
  kBarrier,
};
constexpr int kNumCommOps = 8;
const char* comm_op_name(CommOp op);

struct CommStats {
  std::array<uint64_t, kNumCommOps> bytes_sent{};
  std::array<uint64_t, kNumCommOps> bytes_received{};  // payload received (recv, all_to_all_v)
  std::array<uint64_t, kNumCommOps> calls{};
  uint64_t sent(CommOp op) const { return bytes_sent[static_cast<int>(op)]; }
  uint64_t received(CommOp op) const { return bytes_received[static_cast<int>(op)]; }
  uint64_t count(CommOp op) const { return calls[static_cast<int>(op)]; }
  uint64_t total_sent() const;
};

// A handle to an outstanding non-blocking operation. Default-constructed = already complete.
// Destroying an incomplete request waits for it (never leaves MPI with dangling buffers).
class Request {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual bool test() = 0;
  };
  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept;
  ~Request();

  void wait();
  // True when complete (then the buffers may be reused). Drives MPI progress.
  bool test();
  bool done() const { return impl_ == nullptr; }

 private:
  std::unique_ptr<Impl> impl_;
};

void wait_all(std::vector<Request>& requests);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  // Where buffers must live: host memory (MPI, self) or a device's (NCCL: Device::kCuda).
  virtual Device buffer_device() const { return Device::kCpu; }
  // Point-to-point operations issued between these two calls progress together (NCCL needs it for
  // sends and receives between the same pair; elsewhere they are no-ops). Not nested.
  virtual void group_start() {}
  virtual void group_end() {}

  // In place element-wise sum over all ranks; dtype f32 or f64 (or i32).
  Request iall_reduce_sum(void* buf, size_t count, DType dtype);
  // send holds size() * recv_count elements; rank r receives the sum of chunk r into recv.
  Request ireduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype);
  // recv holds size() * send_count elements, chunk r from rank r (any dtype).
  Request iall_gather(const void* send, void* recv, size_t send_count, DType dtype);
  // MPI_Alltoallv semantics; counts/displacements (elements) have size() entries; any dtype.
  Request iall_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& send_displs, void* recv,
                        const std::vector<int64_t>& recv_counts,
                        const std::vector<int64_t>& recv_displs, DType dtype);
  Request isend(const void* buf, size_t count, DType dtype, int dest, int tag = 0);
  Request irecv(void* buf, size_t count, DType dtype, int source, int tag = 0);
  Request ibroadcast(void* buf, size_t count, DType dtype, int root);
  Request ibarrier();

  // Blocking forms: issue, then wait.
  // all_reduce and all_to_all_v have blocking hooks: Open MPI's blocking collectives (coll/tuned)
  // are faster than its non-blocking ones (libnbc), e.g. 1M-float all_reduce at np=2.
  void all_reduce_sum(void* buf, size_t count, DType dtype);
  void reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) {
    ireduce_scatter_sum(send, recv, recv_count, dtype).wait();
  }
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
    iall_gather(send, recv, send_count, dtype).wait();
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_displs, void* recv,
                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    DType dtype);
  void send(const void* buf, size_t count, DType dtype, int dest, int tag = 0) {
    isend(buf, count, dtype, dest, tag).wait();
  }
  void recv(void* buf, size_t count, DType dtype, int source, int tag = 0) {
    irecv(buf, count, dtype, source, tag).wait();
  }
  void broadcast(void* buf, size_t count, DType dtype, int root) { ibroadcast(buf, count, dtype, root).wait(); }
  void barrier() { ibarrier().wait(); }

  // Sub-group of the ranks that pass the same color, ordered by (key, rank). Collective.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  CommStats stats() const { return stats_; }  // a snapshot
  void reset_stats() { stats_ = CommStats{}; }

 protected:
  virtual Request do_all_reduce_sum(void* buf, size_t count, DType dtype) = 0;
  virtual Request do_reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) = 0;
  virtual Request do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) = 0;
  virtual Request do_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& send_displs, void* recv,
                                  const std::vector<int64_t>& recv_counts,
                                  const std::vector<int64_t>& recv_displs, DType dtype) = 0;
  virtual Request do_send(const void* buf, size_t count, DType dtype, int dest, int tag) = 0;
  virtual Request do_recv(void* buf, size_t count, DType dtype, int source, int tag) = 0;
  virtual Request do_broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  virtual Request do_barrier() = 0;
  // Blocking forms; the defaults issue the non-blocking call and wait.
  virtual void do_all_reduce_sum_blocking(void* buf, size_t count, DType dtype) {
    do_all_reduce_sum(buf, count, dtype).wait();
  }
  virtual void do_all_to_all_v_blocking(const void* send, const std::vector<int64_t>& send_counts,
                                        const std::vector<int64_t>& send_displs, void* recv,
                                        const std::vector<int64_t>& recv_counts,
                                        const std::vector<int64_t>& recv_displs, DType dtype) {
    do_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype).wait();
  }

 private:
  void account(CommOp op, uint64_t sent, uint64_t received);
  void account_all_to_all_v(const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                            const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                            DType dtype);
  CommStats stats_;
};

// Size 1, no MPI: collectives copy or do nothing; send/recv to self are errors.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  std::unique_ptr<Communicator> split(int color, int key) override;

 protected:
  Request do_all_reduce_sum(void* buf, size_t count, DType dtype) override;
  Request do_reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) override;
  Request do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) override;
  Request do_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& send_displs, void* recv,
                          const std::vector<int64_t>& recv_counts,
                          const std::vector<int64_t>& recv_displs, DType dtype) override;
  Request do_send(const void* buf, size_t count, DType dtype, int dest, int tag) override;
  Request do_recv(void* buf, size_t count, DType dtype, int source, int tag) override;
  Request do_broadcast(void* buf, size_t count, DType dtype, int root) override;
  Request do_barrier() override;
};

// The MPI world. Initializes MPI once (MPI_THREAD_FUNNELED) on first use and finalizes it at
// process exit; works under mpirun and as a singleton (plain ./prog). Defined in
// mpi_communicator.cpp.
std::unique_ptr<Communicator> mpi_world();
// True when a launcher (mpirun, srun) started this process: Open MPI, PMI or PMIx variables.
bool launched_by_mpi();
// This process's rank as the launcher numbered it (0 without a launcher); readable before MPI init.
int launch_rank();
// The world of a command: the MPI world under a launcher, else a SelfCommunicator (no MPI init).
std::unique_ptr<Communicator> launch_world();
// Every rank's string, in rank order (all-gather of the lengths, then of the padded bytes). Collective.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);
// Ends every rank now with this message and exit code (MPI_Abort); never returns.
[[noreturn]] void mpi_abort(const std::string& message, int code = 1);

}  // namespace moe
