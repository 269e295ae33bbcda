// Binds each backend namespace's free functions to the Backend interface. ref and cpu run on
// the host, synchronously: memory is host memory, every call has finished when it returns, so
// events are timestamps and waits return at once.
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/host/event_times.h"
#include "kernels/op_times.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/strict/strict_backend.h"
#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moe {

const char* op_name(OpId op) {
  switch (op) {
#define MOE_OP(name, params, args) \
  case OpId::name: return #name;
#include "kernels/op_list.inc"
#undef MOE_OP
    case OpId::kCount: break;
  }
  return "?";
}

TransferStats operator-(const TransferStats& a, const TransferStats& b) {
  return {a.to_host - b.to_host, a.to_host_bytes - b.to_host_bytes, a.to_device - b.to_device,
          a.to_device_bytes - b.to_device_bytes};
}

TransferStats operator+(const TransferStats& a, const TransferStats& b) {
  return {a.to_host + b.to_host, a.to_host_bytes + b.to_host_bytes, a.to_device + b.to_device,
          a.to_device_bytes + b.to_device_bytes};
}

bool Backend::supports(OpId, DType) const { return true; }

namespace {

void check_copy(const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy: source ", src.shape_str(), " ",
            dtype_name(src.dtype), " and destination ", dst.shape_str(), " ", dtype_name(dst.dtype), " differ");
}

class HostBackend : public Backend {
 public:
  Device device() const override { return Device::kCpu; }
  void* allocate(size_t bytes) override { return host_memory().allocate(bytes); }
  void deallocate(void* p, size_t bytes) noexcept override { host_memory().deallocate(p, bytes); }
  void upload(const void* host, const Tensor& dst) override {
    count_upload(dst.nbytes());
    if (dst.nbytes() > 0) std::memcpy(dst.data, host, dst.nbytes());
  }
  void download(const Tensor& src, void* host) override {
    count_download(src.nbytes());
    if (src.nbytes() > 0) std::memcpy(host, src.data, src.nbytes());
  }
  void copy(const Tensor& src, const Tensor& dst) override {
    check_copy(src, dst);
    if (src.nbytes() > 0 && src.data != dst.data) std::memmove(dst.data, src.data, src.nbytes());
  }
  Event record() override {
    times_.stamp(++seq_);
    return Event{seq_};
  }
  void wait(Event) override {}
  void synchronize() override {}
  double elapsed_seconds(Event from, Event to) override { return times_.seconds_between(from.seq, to.seq); }

 private:
  uint64_t seq_ = 0;
  EventTimes times_;
};

class RefBackend final : public HostBackend {
 public:
  const char* name() const override { return "ref"; }
#define MOE_OP(name, params, args) \
  void name params override { ref::name args; }
#include "kernels/op_list.inc"
#undef MOE_OP
};

class CpuBackend final : public HostBackend {
 public:
  const char* name() const override { return "cpu"; }
  // Each call timed into op_times_sink() when a bench asks (`moecore bench --ops`).
#define MOE_OP(name, params, args)             \
  void name params override {                  \
    const OpClock op_clock_(OpId::name);       \
    cpu::name args;                            \
  }
#include "kernels/op_list.inc"
#undef MOE_OP
};

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "ref") return std::make_unique<RefBackend>();
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "strict") return make_strict_backend();
  if (name == "cuda") {
#ifdef MOE_WITH_CUDA
    return make_cuda_backend();
#else
    MOE_FAIL("kernel backend 'cuda': this moecore was built without CUDA (configure with -DMOE_CUDA=ON)");
#endif
  }
  MOE_FAIL("unknown kernel backend '", name, "' (allowed: ref, cpu, strict, cuda)");
}

}  // namespace moe
