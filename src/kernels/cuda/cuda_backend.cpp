// The CUDA backend: device memory, one stream, events, staging through pinned host rings, and
// every op of kernels/op_list.inc bound to the moe::cuda kernels (kernels/cuda/*.cu).
//  - Memory: cudaMalloc, never zeroed (like the strict backend's NaN fill, nothing may rely on it).
//    Out of memory names the request and the device's free and total memory.
//  - Staging: uploads copy the host bytes into a pinned ring and return (the caller may reuse its
//    buffer at once); downloads land in a pinned ring and are copied to the caller's buffer when
//    the host waits for a later event, which is exactly when the Backend contract lets it read
//    them. Both rings and every event are allocated when the backend is made.
//  - Device errors (an id outside the vocabulary, ...) are written by kernels into host-mapped
//    memory and raised, naming the op, by the next wait or synchronize.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>

#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_lt.h"
#include "kernels/cuda_memory.h"
#ifdef MOE_WITH_CUDNN
#include "kernels/cuda/sdpa_cudnn.h"
#endif

namespace moe {
namespace cuda {

void fail_cuda(cudaError_t err, const char* call, const char* file, int line) {
  MOE_FAIL("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", call, " at ", file, ":", line);
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  MOE_CHECK(err == cudaSuccess, "cuda backend: ", op, ": kernel launch failed: ", cudaGetErrorName(err), " (",
            cudaGetErrorString(err), ")");
}

void check_device(const Tensor& t, const char* op) {
  if (t.data == nullptr) return;
  MOE_CHECK(t.device == Device::kCuda, "cuda backend: ", op, " was given a ", device_name(t.device), " tensor ",
            t.shape_str(), "; its memory must come from this backend");
}

size_t scratch_limit_error(size_t need, size_t have, const char* op) {
  MOE_FAIL("cuda backend: ", op, " needs ", need, " bytes of scratch, the backend has ", have,
           " (set MOE_CUDA_SCRATCH_MB higher)");
}

void fail_dtype(DType t, const char* op) {
  MOE_FAIL(op, ": dtype ", dtype_name(t), " not supported on cuda (f32, or bf16 where the op allows it; f64 is the ref backend's)");
}

}  // namespace cuda

namespace {

std::atomic<size_t> g_allocated{0}, g_peak{0};

void count_allocation(int64_t bytes) {
  const size_t now = g_allocated.fetch_add(static_cast<size_t>(bytes)) + static_cast<size_t>(bytes);
  size_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// A pinned host ring: bytes [begin, end) in absolute positions, reusable once the stream has
// passed the event recorded after the copy that used them.
class PinnedRing {
 public:
  explicit PinnedRing(size_t bytes) : bytes_(bytes) { MOE_CUDA_CHECK(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault)); }
  ~PinnedRing() { cudaFreeHost(data_); }
  PinnedRing(const PinnedRing&) = delete;
  PinnedRing& operator=(const PinnedRing&) = delete;
  size_t capacity() const { return bytes_; }
  // The next n bytes (n <= capacity): contiguous, so a region that would wrap starts at 0.
  size_t reserve(size_t n) {
    size_t at = head_;
    if (at % bytes_ + n > bytes_) at += bytes_ - at % bytes_;
    head_ = at + n;
    return at;
  }
  char* at(size_t abs) const { return static_cast<char*>(data_) + abs % bytes_; }
  size_t head() const { return head_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
  size_t head_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) {
    ctx_.device = device;
    MOE_CUDA_CHECK(cudaSetDevice(device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&ctx_.sm_count, cudaDevAttrMultiProcessorCount, device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&ctx_.cc_major, cudaDevAttrComputeCapabilityMajor, device));
    if (const char* g = std::getenv("MOE_CUDA_GROUPED")) {
      MOE_CHECK(std::string(g) == "simt" || std::string(g) == "tensor", "MOE_CUDA_GROUPED = \"", g,
                "\" (allowed: simt, tensor)");
      ctx_.tensor_core_grouped = std::string(g) == "tensor";
    }
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    for (cudaEvent_t& e : events_) MOE_CUDA_CHECK(cudaEventCreate(&e));
    MOE_CUDA_CHECK(cudaHostAlloc(&error_host_, sizeof(cuda::DeviceError), cudaHostAllocMapped));
    std::memset(static_cast<void*>(error_host_), 0, sizeof(cuda::DeviceError));
    MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctx_.error), error_host_, 0));
    const AllocationScope scope("the cuda backend's scratch and cuBLASLt workspace");
    ctx_.scratch_bytes = cuda_scratch_bytes();
    ctx_.scratch = allocate(ctx_.scratch_bytes);
    workspace_bytes_ = kCublasLtWorkspaceBytes;
    workspace_ = allocate(workspace_bytes_);
    gemm_ = std::make_unique<cuda::GemmLt>(workspace_, workspace_bytes_);
    ctx_.gemm = gemm_.get();
#ifdef MOE_WITH_CUDNN
    const char* attention = std::getenv("MOE_CUDA_ATTENTION");
    MOE_CHECK(!attention || std::string(attention) == "ours" || std::string(attention) == "cudnn", "MOE_CUDA_ATTENTION = \"",
              attention ? attention : "", "\" (allowed: cudnn, ours)");
    if (!attention || std::string(attention) == "cudnn") {
      std::string why;
      sdpa_ = cuda::CudnnSdpa::load(*this, ctx_.stream, &why);
      if (!sdpa_) std::fprintf(stderr, "moecore: cuDNN unavailable (%s): attention runs on our kernel\n", why.c_str());
      ctx_.sdpa = sdpa_.get();
    }
#endif
    up_ = std::make_unique<PinnedRing>(env_mib("MOE_CUDA_STAGING_MB", size_t{64} << 20));
    down_ = std::make_unique<PinnedRing>(up_->capacity());
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(ctx_.stream);
#ifdef MOE_WITH_CUDNN
    sdpa_.reset();
#endif
    gemm_.reset();
    if (workspace_) deallocate(workspace_, workspace_bytes_);
    if (ctx_.scratch) deallocate(ctx_.scratch, ctx_.scratch_bytes);
    cudaFreeHost(error_host_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(ctx_.stream);
  }

  const char* name() const override { return "cuda"; }
  Device device() const override { return Device::kCuda; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes < 1 ? 1 : bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      const char* what = AllocationScope::current();
      MOE_FAIL("cuda backend: out of device memory allocating ", bytes >> 20, " MiB", *what ? " for " : "", what,
               " on GPU ", ctx_.device, " (", free_b >> 20, " MiB free of ", total_b >> 20, ")");
    }
    MOE_CUDA_CHECK(err);
    count_allocation(static_cast<int64_t>(bytes));
    return p;
  }

  void deallocate(void* p, size_t bytes) noexcept override {
    cudaStreamSynchronize(ctx_.stream);  // pending work may still use it (as cudaFree itself waits)
    cudaFree(p);
    g_allocated.fetch_sub(bytes);
  }

  void upload(const void* host, const Tensor& dst) override {
    cuda::check_device(dst, "upload");
    const size_t n = dst.nbytes();
    count_upload(n);
    const char* src = static_cast<const char*>(host);
    for (size_t done = 0; done < n;) {
      const size_t chunk = std::min(n - done, up_->capacity());
      const size_t at = up_->reserve(chunk);
      reclaim(up_uses_, *up_, at, chunk);
      std::memcpy(up_->at(at), src + done, chunk);
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.data) + done, up_->at(at), chunk, cudaMemcpyHostToDevice, ctx_.stream));
      up_uses_.push_back(Use{at, record().seq, nullptr, 0});
      done += chunk;
    }
  }

  void download(const Tensor& src, void* host) override {
    cuda::check_device(src, "download");
    const size_t n = src.nbytes();
    count_download(n);
    char* dst = static_cast<char*>(host);
    for (size_t done = 0; done < n;) {
      const size_t chunk = std::min(n - done, down_->capacity());
      const size_t at = down_->reserve(chunk);
      reclaim(down_uses_, *down_, at, chunk);
      MOE_CUDA_CHECK(cudaMemcpyAsync(down_->at(at), static_cast<const char*>(src.data) + done, chunk, cudaMemcpyDeviceToHost,
                                     ctx_.stream));
      down_uses_.push_back(Use{at, record().seq, dst + done, chunk});
      done += chunk;
    }
  }

  void copy(const Tensor& src, const Tensor& dst) override {
    MOE_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy: source ", src.shape_str(), " ", dtype_name(src.dtype),
              " and destination ", dst.shape_str(), " ", dtype_name(dst.dtype), " differ");
    cuda::check_device(src, "copy");
    cuda::check_device(dst, "copy");
    if (src.nbytes() > 0 && src.data != dst.data)
      MOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, ctx_.stream));
  }

  Event record() override {
    const uint64_t seq = ++seq_;
    MOE_CUDA_CHECK(cudaEventRecord(events_[seq % kEvents], ctx_.stream));
    return Event{seq};
  }

  void wait(Event e) override {
    MOE_CHECK(e.seq <= seq_, "cuda backend: wait for event ", e.seq, ", which was never recorded");
    if (e.seq + kEvents <= seq_) {  // its slot was reused by a later event: that one is later still
      synchronize();
      return;
    }
    if (e.seq > 0) MOE_CUDA_CHECK(cudaEventSynchronize(events_[e.seq % kEvents]));
    if (e.seq > waited_) waited_ = e.seq;
    after_wait();
  }

  void synchronize() override {
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    waited_ = seq_;
    after_wait();
  }

  double elapsed_seconds(Event from, Event to) override {
    MOE_CHECK(from.seq + kEvents > seq_ && to.seq + kEvents > seq_, "elapsed_seconds: event ", from.seq, " or ", to.seq,
              " is not among the last ", kEvents, " recorded");
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[from.seq % kEvents], events_[to.seq % kEvents]));
    return static_cast<double>(ms) * 1e-3;
  }

  bool supports(OpId op, DType dtype) const override { return cuda_supports(op, dtype); }
  void set_deterministic_attention(bool on) override {
    if (sdpa_) sdpa_->set_deterministic(on);
  }
  cudaStream_t stream() const { return ctx_.stream; }
  const CudaPaths& paths() const { return ctx_.paths; }

#define MOE_ARGS(...) __VA_ARGS__
#define MOE_OP(name, params, args) \
  void name params override { cuda::name(ctx_, MOE_ARGS args); }
#include "kernels/op_list.inc"
#undef MOE_OP
#undef MOE_ARGS

 private:
  static constexpr uint64_t kEvents = kEventHistory;
  // A ring region in use by a stream-ordered copy, until event `seq`; downloads also name where
  // the host wants the bytes.
  struct Use {
    size_t begin;
    uint64_t seq;
    char* host;
    size_t bytes;
  };

  // Before writing ring bytes [at, at + n): the oldest uses whose bytes those overwrite (absolute
  // positions below at + n - capacity) must have finished; waiting delivers and drops them.
  void reclaim(std::deque<Use>& uses, const PinnedRing& ring, size_t at, size_t n) {
    const size_t reused_below = at + n > ring.capacity() ? at + n - ring.capacity() : 0;
    while (!uses.empty() && uses.front().begin < reused_below) wait(Event{uses.front().seq});
  }

  void deliver(const Use& u) {
    if (u.host && u.bytes) std::memcpy(u.host, down_->at(u.begin), u.bytes);
  }

  // After the host has waited up to waited_: hand over finished downloads and forget finished
  // uploads, then raise a device error (a download that finished is delivered even when a later
  // kernel failed: the caller's bytes are what the device computed before the error).
  void after_wait() {
    while (!down_uses_.empty() && down_uses_.front().seq <= waited_) {
      deliver(down_uses_.front());
      down_uses_.pop_front();
    }
    while (!up_uses_.empty() && up_uses_.front().seq <= waited_) up_uses_.pop_front();
    raise_device_error();
  }

  void raise_device_error() {
    volatile cuda::DeviceError* e = error_host_;
    if (e->code <= 0) return;
    const int code = e->code;
    const int value = e->value;
    const long long index = e->index;
    e->value = 0;
    e->index = 0;
    e->code = 0;
    const OpId op = static_cast<OpId>(code - 1);
    MOE_FAIL("cuda backend: ", op_name(op), ": invalid value ", value, " at index ", index,
             " (found on the device: an id, label or expert index out of range, or a bad offset table, doc_start or segment)");
  }

  cuda::Context ctx_;
  std::array<cudaEvent_t, kEvents> events_{};
  uint64_t seq_ = 0, waited_ = 0;
  cuda::DeviceError* error_host_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::unique_ptr<cuda::GemmLt> gemm_;
#ifdef MOE_WITH_CUDNN
  std::unique_ptr<cuda::CudnnSdpa> sdpa_;
#endif
  std::unique_ptr<PinnedRing> up_, down_;
  std::deque<Use> up_uses_, down_uses_;
};

}  // namespace

size_t cuda_peak_allocated_bytes() { return g_peak.load(); }

double cuda_peak_tflops(bool bf16) {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (major == 9) return bf16 ? 989.4 : 66.9;  // H100 / H200 SXM
  if (major == 10) return bf16 ? 2250.0 : 80.0;  // B200 / B300
  return 0;
}

bool cuda_supports(OpId op, DType dtype) {
  switch (op) {  // MXFP8: the ref and cpu backends only, for now (kernels/cuda/mxfp8.cpp)
    case OpId::mx_quantize:
    case OpId::mx_quantize_swizzled:
    case OpId::mx_dequantize:
    case OpId::mx_linear:
    case OpId::mx_grouped_linear: return false;
    default: break;
  }
  if (dtype != DType::kF64) return true;
  // f64 is the reference's precision; only the dtype-agnostic ops take it (step statistics and
  // control scalars are f64 on every backend).
  switch (op) {
    case OpId::fill:
    case OpId::convert:
    case OpId::scale:
    case OpId::axpy:
    case OpId::sum_to:
    case OpId::sumsq_to:
    case OpId::sumsq_segments:
    case OpId::ep_slab_copy: return true;  // bytes are copied
    default: return false;
  }
}

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

int cuda_local_device() {
  std::string why;
  const int n = cuda_device_count(&why);
  MOE_CHECK(n > 0, "train.backend = \"cuda\": no usable GPU (", why, ")");
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* v = std::getenv(var);
    if (v && *v) return std::atoi(v) % n;
  }
  return 0;
}

void* cuda_stream(Backend& cuda) {
  auto* b = dynamic_cast<CudaBackend*>(&cuda);
  MOE_CHECK(b != nullptr, "a CUDA stream was asked of the ", cuda.name(), " backend");
  return b->stream();
}

CudaPaths cuda_paths(Backend& cuda) {
  auto* b = dynamic_cast<CudaBackend*>(&cuda);
  MOE_CHECK(b != nullptr, "cuda_paths was asked of the ", cuda.name(), " backend");
  return b->paths();
}

std::string cuda_paths_text(const CudaPaths& p) {
  return "grouped GEMM: " + std::to_string(p.grouped_cutlass) + " CUTLASS, " + std::to_string(p.grouped_simt) +
         " SIMT; attention: " + std::to_string(p.attention_cudnn) + " cuDNN, " + std::to_string(p.attention_ours) + " ours";
}

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(cuda_local_device()); }

}  // namespace moe
