#include "kernels/strict/strict_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/host/event_times.h"

namespace moe {
namespace {

// One enqueued call, stored in place (no allocation per op): the largest op closure (attention
// backward: ten tensor views) takes about 500 bytes.
struct Task {
  static constexpr size_t kBytes = 768;
  alignas(64) unsigned char storage[kBytes];
  void (*run)(void*) = nullptr;
  void (*destroy)(void*) = nullptr;
};

class StrictBackend final : public Backend {
 public:
  StrictBackend() : worker_([this] { work(); }) {}
  ~StrictBackend() override {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      released_ = enqueued_;
    }
    work_cv_.notify_all();
    worker_.join();
    for (auto& [view, region] : regions_) unmap(view, region);
  }

  const char* name() const override { return "strict"; }
  Device device() const override { return Device::kStrict; }

  void* allocate(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t n = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    const int fd = memfd_create("moecore-strict", MFD_CLOEXEC);
    MOE_CHECK(fd >= 0, "strict backend: memfd_create for ", bytes, " bytes failed: ", std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(n)) != 0) {
      const int err = errno;
      close(fd);
      MOE_FAIL("strict backend: cannot size ", bytes, " bytes: ", std::strerror(err));
    }
    void* rw = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    void* view = rw == MAP_FAILED ? MAP_FAILED : mmap(nullptr, n, PROT_NONE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (view == MAP_FAILED) {
      if (rw != MAP_FAILED) munmap(rw, n);
      MOE_FAIL("strict backend: cannot map ", bytes, " bytes: ", std::strerror(err));
    }
    std::memset(rw, 0xFF, n);
    std::lock_guard<std::mutex> lk(regions_m_);
    regions_[reinterpret_cast<uintptr_t>(view)] = Region{static_cast<char*>(rw), n};
    return view;
  }

  void deallocate(void* p, size_t) noexcept override {
    drain();  // pending calls may still use it (cudaFree waits for the device too)
    std::lock_guard<std::mutex> lk(regions_m_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(p));
    if (it == regions_.end()) return;
    unmap(it->first, it->second);
    regions_.erase(it);
  }

  void upload(const void* host, const Tensor& dst) override {
    const Tensor d = translate("upload", dst);
    count_upload(d.nbytes());
    std::vector<unsigned char> staged(static_cast<const unsigned char*>(host),
                                      static_cast<const unsigned char*>(host) + d.nbytes());
    push([d, staged = std::move(staged)] {
      if (!staged.empty()) std::memcpy(d.data, staged.data(), staged.size());
    });
  }

  void download(const Tensor& src, void* host) override {
    const Tensor s = translate("download", src);
    count_download(s.nbytes());
    push([s, host] {
      if (s.nbytes() > 0) std::memcpy(host, s.data, s.nbytes());
    });
  }

  void copy(const Tensor& src, const Tensor& dst) override {
    MOE_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy: source ", src.shape_str(), " ",
              dtype_name(src.dtype), " and destination ", dst.shape_str(), " ", dtype_name(dst.dtype), " differ");
    const Tensor s = translate("copy", src), d = translate("copy", dst);
    push([s, d] {
      if (s.nbytes() > 0 && s.data != d.data) std::memmove(d.data, s.data, s.nbytes());
    });
  }

  Event record() override {
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lk(m_);
      seq = enqueued_ + 1;  // only the host thread enqueues, so this is the next task's number
    }
    MOE_CHECK(push([this, seq] { times_.stamp(seq); }) == seq, "strict backend: events recorded from two threads");
    return Event{seq};
  }

  void wait(Event e) override {
    std::unique_lock<std::mutex> lk(m_);
    MOE_CHECK(e.seq <= enqueued_, "strict backend: wait for event ", e.seq, ", which was never recorded");
    if (released_ < e.seq) released_ = e.seq;
    work_cv_.notify_one();
    done_cv_.wait(lk, [&] { return done_ >= e.seq; });
    if (error_) {
      std::exception_ptr err = std::exchange(error_, nullptr);
      std::rethrow_exception(err);
    }
  }

  void synchronize() override {
    uint64_t last = 0;
    {
      std::lock_guard<std::mutex> lk(m_);
      last = enqueued_;
    }
    wait(Event{last});
  }

  double elapsed_seconds(Event from, Event to) override {
    std::lock_guard<std::mutex> lk(m_);
    MOE_CHECK(done_ >= from.seq && done_ >= to.seq, "strict backend: elapsed_seconds between events ", from.seq,
              " and ", to.seq, " before waiting for them");
    return times_.seconds_between(from.seq, to.seq);
  }

#define MOE_ARGS(...) __VA_ARGS__
#define MOE_OP(name, params, args) \
  void name params override { submit(#name, [](const auto&... a) { cpu::name(a...); }, MOE_ARGS args); }
#include "kernels/op_list.inc"
#undef MOE_OP
#undef MOE_ARGS

 private:
  struct Region {
    char* rw = nullptr;
    size_t bytes = 0;
  };
  static constexpr uint64_t kQueue = 1024;

  static void unmap(uintptr_t view, const Region& r) {
    munmap(reinterpret_cast<void*>(view), r.bytes);
    munmap(r.rw, r.bytes);
  }

  // The backend's own address of a strict tensor's bytes: a view of the read-write mapping,
  // marked host so the cpu kernels accept it. Anything else is refused, naming the call.
  Tensor translate(const char* op, const Tensor& t) {
    if (t.data == nullptr) {  // an empty "none" argument (e.g. no doc_start), or no bytes at all
      Tensor r = t;
      r.device = Device::kCpu;
      return r;
    }
    MOE_CHECK(t.device == Device::kStrict, "strict backend: ", op, " was given a ", device_name(t.device),
              " tensor ", t.shape_str(), "; its memory must come from this backend");
    const auto p = reinterpret_cast<uintptr_t>(t.data);
    std::lock_guard<std::mutex> lk(regions_m_);
    auto it = regions_.upper_bound(p);
    MOE_CHECK(it != regions_.begin(), "strict backend: ", op, ": tensor ", t.shape_str(),
              " does not point into memory of this backend");
    --it;
    MOE_CHECK(p + t.nbytes() <= it->first + it->second.bytes, "strict backend: ", op, ": tensor ", t.shape_str(),
              " ", dtype_name(t.dtype), " runs past the end of its allocation");
    Tensor r = t;
    r.data = it->second.rw + (p - it->first);
    r.device = Device::kCpu;
    return r;
  }
  template <class T> static const T& translate(const char*, const T& v) { return v; }

  template <class F, class... A> void submit(const char* op, F f, const A&... a) {
    auto bound = std::make_tuple(translate(op, a)...);
    push([f, bound] { std::apply(f, bound); });
  }

  // Enqueues f as the next task; returns its sequence number (1, 2, ...).
  template <class F> uint64_t push(F&& f) {
    using Fn = std::decay_t<F>;
    static_assert(sizeof(Fn) <= Task::kBytes && alignof(Fn) <= 64, "op closure too large for a strict task");
    std::unique_lock<std::mutex> lk(m_);
    if (enqueued_ - done_ == kQueue) {  // full: let the worker run everything queued
      released_ = enqueued_;
      work_cv_.notify_one();
      done_cv_.wait(lk, [&] { return enqueued_ - done_ < kQueue; });
    }
    Task& t = queue_[enqueued_ % kQueue];
    new (t.storage) Fn(std::forward<F>(f));
    t.run = [](void* p) { (*static_cast<Fn*>(p))(); };
    t.destroy = [](void* p) { static_cast<Fn*>(p)->~Fn(); };
    return ++enqueued_;
  }

  // Runs every enqueued task, keeping any error for the next wait.
  void drain() noexcept {
    std::unique_lock<std::mutex> lk(m_);
    released_ = enqueued_;
    work_cv_.notify_one();
    done_cv_.wait(lk, [&] { return done_ == enqueued_; });
  }

  void work() {
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || released_ > done_; });
      if (released_ == done_) return;  // stopping, and nothing left
      const uint64_t seq = done_ + 1;
      Task& t = queue_[(seq - 1) % kQueue];
      const bool skip = error_ != nullptr;  // after an error, later calls do not run
      lk.unlock();
      std::exception_ptr err;
      if (!skip) {
        try {
          cpu::adopt_thread_setting();
          t.run(t.storage);
        } catch (...) {
          err = std::current_exception();
        }
      }
      t.destroy(t.storage);
      lk.lock();
      if (err && !error_) error_ = err;
      done_ = seq;
      done_cv_.notify_all();
    }
  }

  std::mutex m_;  // guards the queue counters and error_
  std::condition_variable work_cv_, done_cv_;
  std::array<Task, kQueue> queue_{};
  uint64_t enqueued_ = 0, released_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  EventTimes times_;
  std::mutex regions_m_;
  std::map<uintptr_t, Region> regions_;  // by PROT_NONE view address
  std::thread worker_;  // last: starts after everything above is constructed
};

}  // namespace

std::unique_ptr<Backend> make_strict_backend() { return std::make_unique<StrictBackend>(); }

}  // namespace moe
