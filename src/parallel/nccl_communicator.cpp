// The NCCL communicator (parallel/nccl_communicator.h); the only file that includes <nccl.h>.
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "core/dynamic_library.h"
#include "kernels/cuda/cuda_backend.h"

namespace moe {
namespace {

// NCCL is loaded at run time (core/dynamic_library.h): calls go through this table.
#define MOE_NCCL_FUNCTIONS(X) X(ncclAllGather) X(ncclAllReduce) X(ncclBroadcast) X(ncclCommCount) X(ncclCommDestroy) X(ncclCommInitRank) X(ncclCommSplit) X(ncclCommUserRank) X(ncclGetErrorString) X(ncclGetLastError) X(ncclGetUniqueId) X(ncclGetVersion) X(ncclGroupEnd) X(ncclGroupStart) X(ncclRecv) X(ncclReduceScatter) X(ncclSend)
struct NcclApi {
#define MOE_DECLARE(f) decltype(&::f) f = nullptr;
  MOE_NCCL_FUNCTIONS(MOE_DECLARE)
#undef MOE_DECLARE
};
const NcclApi& nccl() {
  static const NcclApi api = [] {
    void* h = open_library({"libnccl.so.2", "libnccl.so"}, "NCCL");
    NcclApi a;
#define MOE_RESOLVE(f) a.f = reinterpret_cast<decltype(a.f)>(library_symbol(h, #f, "NCCL"));
    MOE_NCCL_FUNCTIONS(MOE_RESOLVE)
#undef MOE_RESOLVE
    return a;
  }();
  return api;
}

void check_nccl(ncclResult_t r, const char* call) {
  MOE_CHECK(r == ncclSuccess, "NCCL: ", call, " failed: ", nccl().ncclGetErrorString(r), " (", nccl().ncclGetLastError(nullptr), ")");
}
void check_rt(cudaError_t e, const char* call) {
  MOE_CHECK(e == cudaSuccess, "NCCL communicator: ", call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kE4M3:  // MXFP8 payloads move as bytes; nothing reduces them
    case DType::kE5M2:
    case DType::kE8M0: return ncclUint8;
  }
  MOE_FAIL("NCCL: no type for ", dtype_name(t));
}

// The events requests end with: one per request, taken from the pool and handed back when the
// request is done with, so an event is never re-recorded while a request still holds it (a ring
// reused slots under requests kept across many later operations). Shared with the requests, which
// may outlive their communicator.
class EventPool {
 public:
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  cudaEvent_t take() {
    if (free_.empty()) {
      cudaEvent_t e = nullptr;
      check_rt(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      return e;
    }
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  void give(cudaEvent_t e) { free_.push_back(e); }

 private:
  std::vector<cudaEvent_t> free_;
};

class PooledEvent {
 public:
  explicit PooledEvent(std::shared_ptr<EventPool> pool) : pool_(std::move(pool)), event_(pool_->take()) {}
  ~PooledEvent() { pool_->give(event_); }
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

// test() asks whether the operation has finished on the device (cudaEventQuery) and never blocks
// or orders anything: a finished operation needs no ordering. wait() orders the backend's stream
// after it (no host wait).
bool event_done(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) return false;
  check_rt(r, "cudaEventQuery");
  return true;
}

class NcclRequest final : public Request::Impl {
 public:
  NcclRequest(cudaStream_t compute, std::unique_ptr<PooledEvent> done) : compute_(compute), done_(std::move(done)) {}
  void wait() override { check_rt(cudaStreamWaitEvent(compute_, done_->get(), 0), "cudaStreamWaitEvent"); }
  bool test() override { return event_done(done_->get()); }

 private:
  cudaStream_t compute_;
  std::unique_ptr<PooledEvent> done_;
};

// The operations of one group complete together at group_end, whose event exists only then.
struct GroupState {
  explicit GroupState(std::shared_ptr<EventPool> pool) : done(std::move(pool)) {}
  PooledEvent done;
  bool ended = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t compute) : comm_(comm), compute_(compute) {
    check_nccl(nccl().ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(nccl().ncclCommCount(comm_, &size_), "ncclCommCount");
    check_rt(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check_rt(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    check_rt(cudaMalloc(&barrier_word_, sizeof(int32_t)), "cudaMalloc");
    check_rt(cudaMemset(barrier_word_, 0, sizeof(int32_t)), "cudaMemset");
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    nccl().ncclCommDestroy(comm_);
    cudaFree(barrier_word_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Device buffer_device() const override { return Device::kCuda; }

  void group_start() override {
    MOE_CHECK(!grouped_, "NCCL: group_start inside a group");
    grouped_ = true;
    group_ = std::make_shared<GroupState>(events_);
    enter();
    check_nccl(nccl().ncclGroupStart(), "ncclGroupStart");
  }
  void group_end() override {
    MOE_CHECK(grouped_, "NCCL: group_end without group_start");
    grouped_ = false;
    check_nccl(nccl().ncclGroupEnd(), "ncclGroupEnd");
    check_rt(cudaEventRecord(group_->done.get(), stream_), "cudaEventRecord");
    group_->ended = true;
    group_.reset();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    ncclComm_t sub = nullptr;
    check_nccl(nccl().ncclCommSplit(comm_, color, key, &sub, nullptr), "ncclCommSplit");
    return std::make_unique<NcclCommunicator>(sub, compute_);
  }

 protected:
  Request do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    enter();
    check_nccl(nccl().ncclAllReduce(buf, buf, count, nccl_type(dtype), ncclSum, comm_, stream_), "ncclAllReduce");
    return leave();
  }
  Request do_reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) override {
    enter();
    check_nccl(nccl().ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), ncclSum, comm_, stream_), "ncclReduceScatter");
    return leave();
  }
  Request do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) override {
    enter();
    check_nccl(nccl().ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, stream_), "ncclAllGather");
    return leave();
  }
  Request do_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                          void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                          DType dtype) override {
    enter();
    const size_t elem = dtype_size(dtype);
    check_nccl(nccl().ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      const auto i = static_cast<size_t>(p);
      if (send_counts[i] > 0)
        check_nccl(nccl().ncclSend(static_cast<const char*>(send) + static_cast<size_t>(send_displs[i]) * elem,
                            static_cast<size_t>(send_counts[i]), nccl_type(dtype), p, comm_, stream_),
                   "ncclSend");
      if (recv_counts[i] > 0)
        check_nccl(nccl().ncclRecv(static_cast<char*>(recv) + static_cast<size_t>(recv_displs[i]) * elem,
                            static_cast<size_t>(recv_counts[i]), nccl_type(dtype), p, comm_, stream_),
                   "ncclRecv");
    }
    check_nccl(nccl().ncclGroupEnd(), "ncclGroupEnd");
    return leave();
  }
  Request do_send(const void* buf, size_t count, DType dtype, int dest, int) override {
    enter();
    check_nccl(nccl().ncclSend(buf, count, nccl_type(dtype), dest, comm_, stream_), "ncclSend");
    return leave();
  }
  Request do_recv(void* buf, size_t count, DType dtype, int source, int) override {
    enter();
    check_nccl(nccl().ncclRecv(buf, count, nccl_type(dtype), source, comm_, stream_), "ncclRecv");
    return leave();
  }
  Request do_broadcast(void* buf, size_t count, DType dtype, int root) override {
    enter();
    check_nccl(nccl().ncclBroadcast(buf, buf, count, nccl_type(dtype), root, comm_, stream_), "ncclBroadcast");
    return leave();
  }
  // The one host-blocking call: every rank's stream has reached this point.
  Request do_barrier() override {
    enter();
    check_nccl(nccl().ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream_), "ncclAllReduce");
    check_rt(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return Request();
  }

 private:
  // The communication stream waits for everything the backend's stream has enqueued so far. One
  // event serves every call: a stream waits for the record made before the wait call, whatever
  // is recorded into the event later.
  void enter() {
    if (grouped_ && entered_in_group_) return;
    check_rt(cudaEventRecord(ready_, compute_), "cudaEventRecord");
    check_rt(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    entered_in_group_ = grouped_;
  }
  // Inside a group the operations complete together at group_end: their requests end with the
  // group's event, recorded then.
  Request leave() {
    if (grouped_) return Request(std::make_unique<GroupRequest>(compute_, group_));
    entered_in_group_ = false;
    auto done = std::make_unique<PooledEvent>(events_);
    check_rt(cudaEventRecord(done->get(), stream_), "cudaEventRecord");
    return Request(std::make_unique<NcclRequest>(compute_, std::move(done)));
  }

  class GroupRequest final : public Request::Impl {
   public:
    GroupRequest(cudaStream_t compute, std::shared_ptr<GroupState> group) : compute_(compute), group_(std::move(group)) {}
    void wait() override {
      MOE_CHECK(group_->ended, "NCCL: a request of a group was waited for before group_end");
      check_rt(cudaStreamWaitEvent(compute_, group_->done.get(), 0), "cudaStreamWaitEvent");
    }
    bool test() override { return group_->ended && event_done(group_->done.get()); }

   private:
    cudaStream_t compute_;
    std::shared_ptr<GroupState> group_;
  };

  ncclComm_t comm_;
  cudaStream_t compute_, stream_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  cudaEvent_t ready_ = nullptr;
  bool grouped_ = false, entered_in_group_ = false;
  std::shared_ptr<GroupState> group_;  // the open group (group_start .. group_end)
  int32_t* barrier_word_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_world(Communicator& bootstrap, Backend& cuda) {
  MOE_CHECK(cuda.device() == Device::kCuda, "NCCL needs train.backend = \"cuda\", not ", cuda.name());
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) check_nccl(nccl().ncclGetUniqueId(&id), "ncclGetUniqueId");
  bootstrap.broadcast(&id, sizeof id / sizeof(int32_t), DType::kI32, 0);  // 128 bytes
  ncclComm_t comm = nullptr;
  check_nccl(nccl().ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()), "ncclCommInitRank");
  return std::make_unique<NcclCommunicator>(comm, static_cast<cudaStream_t>(cuda_stream(cuda)));
}

std::string nccl_version() {
  int v = 0;
  check_nccl(nccl().ncclGetVersion(&v), "ncclGetVersion");
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace moe
