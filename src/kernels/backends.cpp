// Binds each backend namespace's free functions to the Backend interface.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

class RefBackend final : public Backend {
 public:
  const char* name() const override { return "ref"; }
  Device device() const override { return Device::kCpu; }
#define MOE_OP(name, params, args) \
  void name params override { ref::name args; }
#include "kernels/op_list.inc"
#undef MOE_OP
};

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  Device device() const override { return Device::kCpu; }
#define MOE_OP(name, params, args) \
  void name params override { cpu::name args; }
#include "kernels/op_list.inc"
#undef MOE_OP
};

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "ref") return std::make_unique<RefBackend>();
  if (name == "cpu") return std::make_unique<CpuBackend>();
  MOE_FAIL("unknown kernel backend '", name, "' (allowed: ref, cpu)");
}

}  // namespace moe
