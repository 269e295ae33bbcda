#include "common/backends.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "core/buffer.h"
#ifdef MOE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moe::test {
namespace {

// One device copy of a host range; arguments inside the range (aliases, sub-views) share it.
struct Mirror {
  const char* host = nullptr;
  size_t bytes = 0;
  Buffer device;
  Tensor view;  // all of `device`, in the dtype of the argument it was made for
};

class HostFacing final : public Backend {
 public:
  explicit HostFacing(Backend& device) : dev_(device) {}
  const char* name() const override { return dev_.name(); }
  Device device() const override { return Device::kCpu; }
  void* allocate(size_t bytes) override { return host_memory().allocate(bytes); }
  void deallocate(void* p, size_t bytes) noexcept override { host_memory().deallocate(p, bytes); }
  void upload(const void* host, const Tensor& dst) override {
    if (dst.nbytes() > 0) std::memcpy(dst.data, host, dst.nbytes());
  }
  void download(const Tensor& src, void* host) override {
    if (src.nbytes() > 0) std::memcpy(host, src.data, src.nbytes());
  }
  void copy(const Tensor& src, const Tensor& dst) override { call(&Backend::copy, src, dst); }
  Event record() override { return dev_.record(); }
  void wait(Event e) override { dev_.wait(e); }
  void synchronize() override { dev_.synchronize(); }
  double elapsed_seconds(Event a, Event b) override { return dev_.elapsed_seconds(a, b); }
  bool supports(OpId op, DType dtype) const override { return dev_.supports(op, dtype); }

#define MOE_OP(name, params, args) \
  void name params override { call(&Backend::name, MOE_ARGS args); }
#define MOE_ARGS(...) __VA_ARGS__
#include "kernels/op_list.inc"
#undef MOE_ARGS
#undef MOE_OP

 private:
  void add(const Tensor& t) {
    if (t.data == nullptr || t.nbytes() == 0) return;
    pending_.push_back(t);
  }
  template <class T> void add(const T&) {}

  Tensor on_device(const Tensor& t) const {
    if (t.data == nullptr || t.nbytes() == 0) {
      Tensor e = t;
      e.device = dev_.device();
      return e;
    }
    const char* p = static_cast<const char*>(t.data);
    for (const Mirror& m : mirrors_)
      if (p >= m.host && p + t.nbytes() <= m.host + m.bytes) {
        Tensor d = t;
        d.data = static_cast<char*>(m.device.data()) + (p - m.host);
        d.device = dev_.device();
        return d;
      }
    MOE_FAIL("host_facing: no device copy for a tensor argument");
  }
  template <class T> const T& on_device(const T& v) const { return v; }

  template <class M, class... A> void call(M op, const A&... args) {
    mirrors_.clear();
    pending_.clear();
    (add(args), ...);
    // Largest first, so an argument inside another (an alias, a sub-view) reuses its copy.
    std::stable_sort(pending_.begin(), pending_.end(),
                     [](const Tensor& a, const Tensor& b) { return a.nbytes() > b.nbytes(); });
    for (const Tensor& t : pending_) {
      const char* p = static_cast<const char*>(t.data);
      bool inside = false;
      for (const Mirror& m : mirrors_) {
        if (p >= m.host && p + t.nbytes() <= m.host + m.bytes) inside = true;
        else
          MOE_CHECK(p + t.nbytes() <= m.host || p >= m.host + m.bytes,
                    "host_facing: tensor arguments overlap without one containing the other");
      }
      if (inside) continue;
      Mirror m{p, t.nbytes(), Buffer(dev_, t.nbytes()), Tensor()};
      m.view = m.device.view(t.dtype, {t.numel()});
      dev_.upload(p, m.view);
      mirrors_.push_back(std::move(m));
    }
    (dev_.*op)(on_device(args)...);
    for (const Mirror& m : mirrors_) dev_.download(m.view, const_cast<char*>(m.host));
    dev_.synchronize();
  }

  Backend& dev_;
  std::vector<Tensor> pending_;
  std::vector<Mirror> mirrors_;
};

std::unique_ptr<Backend> g_device;
std::unique_ptr<Backend> g_fast;

}  // namespace

const std::vector<std::string>& backends_under_test() {
#ifdef MOE_WITH_CUDA
  static const std::vector<std::string> names{"cpu", "strict", "cuda"};
#else
  static const std::vector<std::string> names{"cpu", "strict"};
#endif
  return names;
}

bool backend_available(const std::string& name, std::string* why) {
#ifdef MOE_WITH_CUDA
  if (name == "cuda") return cuda_device_count(why) > 0;
#endif
  (void)name;
  (void)why;
  return true;
}

bool backend_supports(const std::string& name, OpId op, DType dtype) {
#ifdef MOE_WITH_CUDA
  if (name == "cuda") return cuda_supports(op, dtype);  // known without a GPU
#endif
  return make_backend(name)->supports(op, dtype);
}

std::unique_ptr<Backend> host_facing(Backend& device) { return std::make_unique<HostFacing>(device); }

Backend& fast() {
  MOE_CHECK(g_fast != nullptr, "test::fast() outside a backend test (TEST_P of a MOE_BACKEND_SUITE)");
  return *g_fast;
}

Backend& fast_device() {
  MOE_CHECK(g_device != nullptr, "test::fast_device() outside a backend test");
  return *g_device;
}

void use_backend(const std::string& name) {
  g_fast.reset();
  g_device = make_backend(name);
  g_fast = host_facing(*g_device);
}

void release_backend() {
  g_fast.reset();
  g_device.reset();
}

void BackendTest::SetUp() {
  std::string why;
  if (!backend_available(GetParam(), &why)) GTEST_SKIP() << GetParam() << " backend unavailable: " << why;
  use_backend(GetParam());
}

void BackendTest::TearDown() { release_backend(); }

}  // namespace moe::test
