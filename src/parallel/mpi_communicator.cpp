// The MPI backend: the only file that includes <mpi.h>.
// C bindings only: keep Open MPI's deprecated C++ bindings (libmpi_cxx) out.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "parallel/communicator.h"

namespace moe {
namespace {

// Initializes MPI once and finalizes it at process exit (a function-local static).
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime runtime;
    return runtime;
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

 private:
  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owns_ = true;
    }
  }
  bool owns_ = false;
};

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  MOE_FAIL(what, " failed: ", std::string(msg, static_cast<size_t>(len)));
}

MPI_Datatype reduce_type(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI32: return MPI_INT32_T;
    default: MOE_FAIL("no MPI reduction type for ", dtype_name(t));
  }
}

int to_int(uint64_t n, const char* what) {
  MOE_CHECK(n <= static_cast<uint64_t>(INT_MAX), what, ": ", n, " exceeds MPI's int count");
  return static_cast<int>(n);
}

// send counts, send displacements, recv counts, recv displacements, in bytes, as one int array.
std::vector<int> byte_counts(const std::vector<int64_t>& sc, const std::vector<int64_t>& sd,
                             const std::vector<int64_t>& rc, const std::vector<int64_t>& rd, DType dtype) {
  const uint64_t e = dtype_size(dtype);
  const size_t n = sc.size();
  std::vector<int> c(4 * n);
  for (size_t j = 0; j < n; ++j) {
    c[j] = to_int(static_cast<uint64_t>(sc[j]) * e, "all_to_all_v send count");
    c[n + j] = to_int(static_cast<uint64_t>(sd[j]) * e, "all_to_all_v send displacement");
    c[2 * n + j] = to_int(static_cast<uint64_t>(rc[j]) * e, "all_to_all_v recv count");
    c[3 * n + j] = to_int(static_cast<uint64_t>(rd[j]) * e, "all_to_all_v recv displacement");
  }
  return c;
}

class MpiRequest final : public Request::Impl {
 public:
  MPI_Request req = MPI_REQUEST_NULL;
  // all_to_all_v keeps its int count arrays alive until completion (MPI requires it).
  std::vector<int> counts;
  void wait() override { check_mpi(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait"); }
  bool test() override {
    int flag = 0;
    check_mpi(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    return flag != 0;
  }
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    if (owned_ && !mpi_finalized()) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_unique<MpiCommunicator>(sub, true);
  }

 protected:
  Request do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf, to_int(count, "all_reduce"), reduce_type(dtype), MPI_SUM, comm_,
                             &r->req),
              "MPI_Iallreduce");
    return Request(std::move(r));
  }
  void do_all_reduce_sum_blocking(void* buf, size_t count, DType dtype) override {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, buf, to_int(count, "all_reduce"), reduce_type(dtype), MPI_SUM, comm_),
              "MPI_Allreduce");
  }
  void do_all_to_all_v_blocking(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_displs, void* recv,
                                const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                DType dtype) override {
    const std::vector<int> c = byte_counts(send_counts, send_displs, recv_counts, recv_displs, dtype);
    const size_t n = static_cast<size_t>(size_);
    check_mpi(MPI_Alltoallv(send, c.data(), c.data() + n, MPI_BYTE, recv, c.data() + 2 * n, c.data() + 3 * n,
                            MPI_BYTE, comm_),
              "MPI_Alltoallv");
  }
  Request do_reduce_scatter_sum(const void* send, void* recv, size_t recv_count, DType dtype) override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Ireduce_scatter_block(send, recv, to_int(recv_count, "reduce_scatter"), reduce_type(dtype),
                                        MPI_SUM, comm_, &r->req),
              "MPI_Ireduce_scatter_block");
    return Request(std::move(r));
  }
  Request do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) override {
    auto r = std::make_unique<MpiRequest>();
    const int bytes = to_int(send_count * dtype_size(dtype), "all_gather");
    check_mpi(MPI_Iallgather(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm_, &r->req), "MPI_Iallgather");
    return Request(std::move(r));
  }
  Request do_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& send_displs, void* recv,
                          const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                          DType dtype) override {
    // Any dtype travels as bytes; counts and displacements are scaled by the element size.
    auto r = std::make_unique<MpiRequest>();
    const size_t n = static_cast<size_t>(size_);
    r->counts = byte_counts(send_counts, send_displs, recv_counts, recv_displs, dtype);
    int* c = r->counts.data();
    check_mpi(MPI_Ialltoallv(send, c, c + n, MPI_BYTE, recv, c + 2 * n, c + 3 * n, MPI_BYTE, comm_, &r->req),
              "MPI_Ialltoallv");
    return Request(std::move(r));
  }
  Request do_send(const void* buf, size_t count, DType dtype, int dest, int tag) override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Isend(buf, to_int(count * dtype_size(dtype), "send"), MPI_BYTE, dest, tag, comm_, &r->req),
              "MPI_Isend");
    return Request(std::move(r));
  }
  Request do_recv(void* buf, size_t count, DType dtype, int source, int tag) override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Irecv(buf, to_int(count * dtype_size(dtype), "recv"), MPI_BYTE, source, tag, comm_, &r->req),
              "MPI_Irecv");
    return Request(std::move(r));
  }
  Request do_broadcast(void* buf, size_t count, DType dtype, int root) override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Ibcast(buf, to_int(count * dtype_size(dtype), "broadcast"), MPI_BYTE, root, comm_, &r->req),
              "MPI_Ibcast");
    return Request(std::move(r));
  }
  Request do_barrier() override {
    auto r = std::make_unique<MpiRequest>();
    check_mpi(MPI_Ibarrier(comm_, &r->req), "MPI_Ibarrier");
    return Request(std::move(r));
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> mpi_world() {
  MpiRuntime::get();
  // Errors come back as codes and become moe::Error (named), instead of MPI's default abort.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

void mpi_abort(const std::string& message, int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  if (initialized && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace moe
