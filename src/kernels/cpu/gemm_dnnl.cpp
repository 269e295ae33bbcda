// oneDNN matmul primitives for the CPU GEMM ops: creation with one OpenMP thread, the cache,
// per-thread execution state. See gemm_dnnl.h.
#include "kernels/cpu/gemm_dnnl.h"

#include <omp.h>

#include <functional>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/phase_timer.h"
#include "kernels/cpu/amx.h"

namespace moe::cpu {
namespace gemm {

// Memory objects of one primitive for one thread, made once: executing only repoints their data
// handles (a dnnl::memory made per call costs a heap allocation).
struct Mems {
  dnnl::memory a, b, c, scratch;
};

struct Primitive {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, scratch;
  size_t scratch_bytes = 0;
  std::string impl;
  std::vector<Mems> mems;  // one per prepared thread
  // bf16 operands on a CPU where oneDNN has no bf16 matmul (no AVX-512: oneDNN 2.6 needs
  // avx512_core): an fp32 primitive over the operands widened to fp32 per call. bf16 x bf16 is
  // exact in fp32 (8 + 8 significant bits), so this is the bf16 GEMM's arithmetic (fp32 products,
  // fp32 sums), but for summation order and subnormals (read and kept, not flushed).
  bool widen = false;
  size_t a_extent = 0, b_extent = 0;  // elements spanned by the strided operands
};

namespace {

dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return dnnl::memory::data_type::f32;
    case DType::kBF16:
      return dnnl::memory::data_type::bf16;
    default:
      MOE_FAIL("cpu GEMM: operands must be f32 or bf16, got ", dtype_name(t));
  }
}

struct DescHash {
  size_t operator()(const Desc& d) const {
    size_t h = static_cast<size_t>(d.dtype) | static_cast<size_t>(d.ta) << 4 |
               static_cast<size_t>(d.tb) << 6 | static_cast<size_t>(d.accumulate) << 8;
    for (int64_t v : {d.m, d.n, d.k, d.lda, d.ldb, d.ldc})
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
  }
};

struct FamilyKey {
  Desc d;
  bool vary_k;
  int64_t step, max_len;
  bool multiples_only;
  bool operator==(const FamilyKey&) const = default;
};
struct FamilyHash {
  size_t operator()(const FamilyKey& f) const {
    return DescHash()(f.d) ^ (static_cast<size_t>(f.vary_k) << 1) ^
           (std::hash<int64_t>()(f.step) << 3) ^ (std::hash<int64_t>()(f.max_len) << 5) ^
           (static_cast<size_t>(f.multiples_only) << 2);
  }
};

std::unordered_map<Desc, std::unique_ptr<Primitive>, DescHash>& cache() {
  static std::unordered_map<Desc, std::unique_ptr<Primitive>, DescHash> c;
  return c;
}

std::unordered_map<FamilyKey, std::vector<const Primitive*>, FamilyHash>& families() {
  static std::unordered_map<FamilyKey, std::vector<const Primitive*>, FamilyHash> f;
  return f;
}

// Restores OpenMP's thread count when it goes out of scope.
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_;
};

// The primitive of d with operands of type t; null if oneDNN has none.
std::unique_ptr<Primitive> create_as(const Desc& d, dnnl::memory::data_type t) {
  using dnnl::memory;
  auto p = std::make_unique<Primitive>();
  // Transposes are expressed through strides only; oneDNN picks its own copy routines.
  p->a = memory::desc({d.m, d.k}, t,
                      d.ta == Trans::kN ? memory::dims{d.lda, 1} : memory::dims{1, d.lda});
  p->b = memory::desc({d.k, d.n}, t,
                      d.tb == Trans::kN ? memory::dims{d.ldb, 1} : memory::dims{1, d.ldb});
  p->c = memory::desc({d.m, d.n}, memory::data_type::f32, memory::dims{d.ldc, 1});
  dnnl::primitive_attr attr;
  // We own the scratchpads (one per thread, allocated once), so executing never allocates.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (d.accumulate) {
    // C += A*B in the same pass: oneDNN adds the old C to the finished dot products.
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  // oneDNN sizes its blocking and scratchpad from omp_get_max_threads() at creation, and
  // primitive creation may consult it again: hold it at one for both, so every primitive is
  // the single-threaded one whatever the caller's thread count.
  OneThread one;
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a, p->b, p->c), attr, engine());
    p->prim = dnnl::matmul(pd);
    p->scratch = pd.scratchpad_desc();
    p->scratch_bytes = p->scratch.get_size();
    p->impl = pd.impl_info_str();
  } catch (const dnnl::error&) {
    return nullptr;
  }
  return p;
}

std::unique_ptr<Primitive> create(const Desc& d) {
  MOE_CHECK(d.m > 0 && d.n > 0 && d.k > 0, "cpu GEMM: empty primitive shape (", d.m, ",", d.n, ",",
            d.k, ")");
  MOE_CHECK(!omp_in_parallel(), "cpu GEMM: primitives must be created outside parallel regions");
  std::unique_ptr<Primitive> p = create_as(d, dnnl_type(d.dtype));
  if (!p && d.dtype == DType::kBF16) {
    p = create_as(d, dnnl::memory::data_type::f32);
    if (p) {
      p->widen = true;
      p->impl = "widened to f32: " + p->impl;
      p->a_extent = static_cast<size_t>(d.ta == Trans::kN ? (d.m - 1) * d.lda + d.k : (d.k - 1) * d.lda + d.m);
      p->b_extent = static_cast<size_t>(d.tb == Trans::kN ? (d.k - 1) * d.ldb + d.n : (d.n - 1) * d.ldb + d.k);
    }
  }
  MOE_CHECK(p != nullptr, "cpu GEMM: oneDNN could not create a ", dtype_name(d.dtype), " matmul (", d.m, "x", d.n,
            "x", d.k, ")");
  return p;
}

struct ThreadState {
  dnnl::stream stream;
  Buffer scratch;
  Buffer wide_a, wide_b;  // widened bf16 operands (Primitive::widen), grown once
};

// bf16 -> fp32 is exact: the bf16 bits are the fp32 value's high half.
const float* widened(const void* src, size_t n, Buffer& buf) {
  if (buf.bytes() < n * sizeof(float)) buf = Buffer(n * sizeof(float));
  const auto* s = static_cast<const uint16_t*>(src);
  auto* d = static_cast<uint32_t*>(buf.data());
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
  return static_cast<const float*>(buf.data());
}

std::vector<std::unique_ptr<ThreadState>>& thread_states() {
  static std::vector<std::unique_ptr<ThreadState>> s;
  return s;
}

// Gives p memory objects for every prepared thread (null data handles until executed). The
// scratchpad's handle is fixed here: it changes only when prepare_threads regrows the buffer,
// which re-points it.
void make_mems(Primitive& p) {
  dnnl::engine& eng = engine();
  const auto& states = thread_states();
  while (p.mems.size() < states.size()) {
    const ThreadState& t = *states[p.mems.size()];
    Mems m{dnnl::memory(p.a, eng, DNNL_MEMORY_NONE), dnnl::memory(p.b, eng, DNNL_MEMORY_NONE),
           dnnl::memory(p.c, eng, DNNL_MEMORY_NONE), dnnl::memory()};
    if (p.scratch_bytes > 0) m.scratch = dnnl::memory(p.scratch, eng, t.scratch.data());
    p.mems.push_back(std::move(m));
  }
}

}  // namespace

const Primitive* primitive(const Desc& d) {
  auto& c = cache();
  auto it = c.find(d);
  if (it == c.end()) {
    it = c.emplace(d, create(d)).first;
    make_mems(*it->second);
  }
  return it->second.get();
}

const Primitive* const* family(Desc d, bool vary_k, int64_t step, int64_t max_len, bool multiples_only) {
  (vary_k ? d.k : d.m) = 0;
  FamilyKey key{d, vary_k, step, max_len, multiples_only};
  auto& f = families();
  auto it = f.find(key);
  if (it == f.end()) {
    std::vector<const Primitive*> v(static_cast<size_t>(max_len + 1), nullptr);
    for (int64_t len = multiples_only ? step : 1; len <= max_len; len += len < step ? 1 : step) {
      (vary_k ? d.k : d.m) = len;
      if (vary_k && d.ta == Trans::kN && key.d.lda == 0) d.lda = len;  // A dense, k long (row-major)
      v[static_cast<size_t>(len)] = primitive(d);
    }
    it = f.emplace(key, std::move(v)).first;
  }
  return it->second.data();
}

size_t scratch_bytes(const Primitive* p) { return p->scratch_bytes; }
size_t primitive_count() { return cache().size(); }
std::string impl_info(const Primitive* p) { return p->impl; }

bool amx_bf16() {
  static const bool amx = [] {
    // With the kernel's permission for tile data asked here: oneDNN asks for it only when it
    // first creates an AMX kernel, and our attention may run its tiles before that.
    return dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx && amx::permitted();
  }();
  return amx;
}

std::vector<std::pair<Desc, std::string>> cached_primitives() {
  std::vector<std::pair<Desc, std::string>> out;
  for (const auto& [d, p] : cache()) out.emplace_back(d, p->impl);
  return out;
}

void prepare_threads(int threads, size_t scratch) {
  auto& s = thread_states();
  const size_t had = s.size();
  while (static_cast<int>(s.size()) < threads) {
    auto t = std::make_unique<ThreadState>();
    t->stream = dnnl::stream(engine());
    s.push_back(std::move(t));
  }
  bool regrown = false;
  for (int i = 0; i < threads; ++i) {
    ThreadState& t = *s[static_cast<size_t>(i)];
    if (t.scratch.bytes() < scratch) {
      t.scratch = Buffer(scratch);
      regrown = true;
    }
  }
  if (s.size() == had && !regrown) return;  // the common case: nothing to (re)make
  for (auto& [d, p] : cache()) {
    make_mems(*p);
    if (!regrown || p->scratch_bytes == 0) continue;
    for (size_t i = 0; i < p->mems.size(); ++i)
      p->mems[i].scratch.set_data_handle(s[i]->scratch.data());
  }
}

void execute(const Primitive* p, const void* a, const void* b, float* c, int thread) {
  ThreadState& t = *thread_states()[static_cast<size_t>(thread)];
  // The memory objects are this thread's own: repointing them races with no other thread.
  const Mems& m = p->mems[static_cast<size_t>(thread)];
  if (p->widen) {
    a = widened(a, p->a_extent, t.wide_a);
    b = widened(b, p->b_extent, t.wide_b);
  }
  m.a.set_data_handle(const_cast<void*>(a));
  m.b.set_data_handle(const_cast<void*>(b));
  m.c.set_data_handle(c);
  // The C API on a stack array: the C++ execute() copies the argument map into a std::vector.
  const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, m.a.get()},
                                   {DNNL_ARG_WEIGHTS, m.b.get()},
                                   {DNNL_ARG_DST, m.c.get()},
                                   {DNNL_ARG_SCRATCHPAD, m.scratch ? m.scratch.get() : nullptr}};
  // dnnl_primitive_execute itself allocates (oneDNN 2.6 copies the arguments into a
  // std::unordered_map per call: 6 operator new per call); bench reports those separately.
  ForeignAllocScope foreign;
  dnnl::error::wrap_c_api(
      dnnl_primitive_execute(p->prim.get(), t.stream.get(), p->scratch_bytes > 0 ? 4 : 3, args),
      "cpu GEMM: oneDNN matmul execution failed");
}

}  // namespace gemm
}  // namespace moe::cpu
