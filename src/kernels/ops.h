// The kernel seam. Model code reaches kernels, device memory and ordering only through a
// Backend; a backend implements every op of kernels/op_list.inc (same names, same arguments) as
// free functions in its own namespace, plus the memory and stream calls below.
//   ref    -- plain scalar loops, f32 and f64: the oracle every fast op is tested against, and
//             the f64 path that must match the PyTorch fixtures to 1e-10.
//   cpu    -- oneDNN GEMMs + OpenMP kernels, f32 and bf16 GEMM operands.
//   strict -- the cpu kernels behind a device the host cannot touch (kernels/strict): memory the
//             host cannot dereference, ops run in order on the backend's own thread, results
//             visible only after a wait; it proves on the CPU that a step is device-ready.
//   cuda   -- kernels/cuda: cuBLASLt GEMMs + our kernels on one stream (-DMOE_CUDA=ON). A backend
//             may throw moe::Error("... not supported") for an op it
//             lacks and says so in supports(); tests report that as a skip, never a pass.
//
// What a backend must implement (a new one starts here):
//   memory     allocate / deallocate (Allocator), upload, download, copy;
//   ordering   record, wait, synchronize, elapsed_seconds: ops are enqueued on one stream in call
//              order; the host may read a download's bytes only after waiting for an event
//              recorded after it (or synchronize);
//   every op   of op_list.inc, and supports(op, dtype) for the cases it lacks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/buffer.h"
#include "core/tensor.h"
#include "kernels/op_types.h"

namespace moe {

// Every op of op_list.inc, by name (OpId::linear_fwd, ...).
enum class OpId : int {
#define MOE_OP(name, params, args) name,
#include "kernels/op_list.inc"
#undef MOE_OP
  kCount
};
const char* op_name(OpId op);

// Host <-> device staging copies a backend has made (each upload or download is one).
struct TransferStats {
  uint64_t to_host = 0, to_host_bytes = 0;      // download
  uint64_t to_device = 0, to_device_bytes = 0;  // upload
};
TransferStats operator-(const TransferStats& a, const TransferStats& b);
TransferStats operator+(const TransferStats& a, const TransferStats& b);

// A point in a backend's stream, returned by record().
struct Event {
  uint64_t seq = 0;
};
// Every backend keeps the times of at least its last kEventHistory recorded events: elapsed_seconds
// may be asked for any two of them (a fixed ring, so recording allocates nothing).
inline constexpr uint64_t kEventHistory = 4096;

class Backend : public Allocator {
 public:
  virtual const char* name() const = 0;
  // True when the host may dereference this backend's memory (ref, cpu): host-side code such as
  // MPI may then use device buffers directly; otherwise it stages through upload/download.
  bool host_addressable() const { return device() == Device::kCpu; }

  // ---- memory (plus Allocator::allocate / deallocate; deallocate waits for pending work)
  // dst <- dst.nbytes() bytes from host. Ordered after earlier ops; `host` may be reused as soon
  // as the call returns (the backend stages it).
  virtual void upload(const void* host, const Tensor& dst) = 0;
  // host <- src.nbytes() bytes. Ordered after earlier ops; the bytes are in `host` only once an
  // event recorded after this call has been waited for (or after synchronize()).
  virtual void download(const Tensor& src, void* host) = 0;
  // dst <- src, device to device: same dtype and number of elements.
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;

  // ---- ordering
  virtual Event record() = 0;           // a point after every call enqueued so far
  virtual void wait(Event e) = 0;       // the host blocks until the stream has passed e
  virtual void synchronize() = 0;       // the host blocks until every enqueued call has run
  // Seconds the stream spent between two recorded events (both must have been waited for, and
  // be among the last kEventHistory recorded).
  virtual double elapsed_seconds(Event from, Event to) = 0;

  // ---- what the host has staged so far
  const TransferStats& transfers() const { return transfers_; }

  // ---- capabilities: false for (op, dtype) cases this backend lacks (the op then throws
  // "not supported"). dtype is the op's float dtype, or kBF16 for bf16 GEMM operands.
  virtual bool supports(OpId op, DType dtype) const;
  // train.deterministic_attention: whether attention_bwd must be bitwise repeatable. Only the cuda
  // backend has a choice (cuDNN's deterministic backward needs a dP workspace); the host kernels
  // always are.
  virtual void set_deterministic_attention(bool on) { (void)on; }

#define MOE_OP(name, params, args) virtual void name params = 0;
#include "kernels/op_list.inc"
#undef MOE_OP

 protected:
  void count_download(size_t bytes) {
    ++transfers_.to_host;
    transfers_.to_host_bytes += bytes;
  }
  void count_upload(size_t bytes) {
    ++transfers_.to_device;
    transfers_.to_device_bytes += bytes;
  }

 private:
  TransferStats transfers_;
};

// "ref", "cpu" or "strict"; anything else is an error naming the choices.
std::unique_ptr<Backend> make_backend(const std::string& name);

}  // namespace moe
