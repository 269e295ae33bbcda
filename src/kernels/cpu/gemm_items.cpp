// The work items' execution (gemm_items.h): per-thread staging, one item's sequence of calls, and
// the OpenMP region that hands an op's items out.
#include "kernels/cpu/gemm_items.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "core/buffer.h"
#include "kernels/cpu/avx512.h"
#include "kernels/cpu/gemm_long.h"
#include "kernels/cpu/gemm_tiles.h"
#include "kernels/cpu/gemm_wgrad.h"
#include "kernels/cpu/transpose16.h"

namespace moe::cpu::tiles {
namespace {

// Per-thread buffers for packed A, staged C and padded B.
struct Staging {
  Buffer a, c, w, b;  // w: the own micro-kernel's panels; b: a padded tail's rows of B
};
std::vector<Staging>& staging() {
  static std::vector<Staging> s;
  return s;
}

// Copies a rows x cols block (elements of es bytes) at leading dimension src_ld to dst at
// leading dimension dst_ld.
void copy_block(const char* src, int64_t src_ld, char* dst, int64_t dst_ld, int64_t rows,
                int64_t cols, size_t es) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + static_cast<size_t>(r * dst_ld) * es,
                src + static_cast<size_t>(r * src_ld) * es, static_cast<size_t>(cols) * es);
}

// copy_block for floats, with streaming stores into every destination row that starts on a cache
// line and is a whole number of vectors long (the others copied as usual), then a fence.
void stream_block(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows, int64_t cols) {
#if defined(__AVX512F__)
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * dst_ld;
    const float* s = src + r * src_ld;
    if (reinterpret_cast<uintptr_t>(d) % 64 != 0 || cols % 16 != 0) {
      std::memcpy(d, s, static_cast<size_t>(cols) * sizeof(float));
      continue;
    }
    for (int64_t j = 0; j < cols; j += 16) _mm512_stream_ps(d + j, _mm512_loadu_ps(s + j));
  }
  _mm_sfence();
#else
  copy_block(reinterpret_cast<const char*>(src), src_ld, reinterpret_cast<char*>(dst), dst_ld, rows, cols,
             sizeof(float));
#endif
}

// c[i] += prod[i], i < n: the sum a primitive's accumulate would do, in the same single rounding.
void add_block(const float* prod, float* c, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) c[i] += prod[i];
}

void run_item(const Item& it, int thread) {
  if (it.kernel == Item::Kernel::kLongData) {
    cpu::longred::band(it.a, it.red, it.pairs, it.red, it.cols, it.rows, it.c, it.cols);
    return;
  }
  if (it.kernel == Item::Kernel::kZero) {
    zero_rows(it.c, 1, it.c_tile);
    return;
  }
  Staging& st = staging()[static_cast<size_t>(thread)];
  float* c = it.c;
  if (it.c_rows) {
    c = static_cast<float*>(st.c.data());
    if (it.c_in)
      copy_block(reinterpret_cast<const char*>(it.c), it.c_ld, reinterpret_cast<char*>(c),
                 it.c_cols, it.c_rows, it.c_cols, sizeof(float));
  }
  const char* a = it.a;
  const char* b = it.b;
  bool first = true;
  if (it.overwrite && !it.staged && it.kernel == Item::Kernel::kOneDnn) zero_rows(c, 1, it.c_tile);
  const bool only_call = it.nfull + (it.mid_rows > 0) + (it.tail_rows > 0) == 1;
  // pad >= rows: the primitive's reduction length (a padded tail's; zeros past rows).
  auto call = [&](const Primitive* p, int64_t rows, int64_t pad) {
    if (it.kernel == Item::Kernel::kWeight) {
      const int64_t es = static_cast<int64_t>(it.es);
      cpu::wgrad::chunk(it.dtype, a, it.a_ld, b, it.b_row / es, rows, it.a_cols, it.c_tile / it.a_cols, c,
                        it.overwrite && first, st.w.data());
      a += rows * it.a_row;
      b += rows * it.b_row;
      first = false;
      return;
    }
    const void* ap = a;
    const void* bp = b;
    if (pad > rows) {  // B's rows, then zero rows (finite: a zero column of A times them adds zero)
      const size_t have = static_cast<size_t>(rows * it.b_row);
      std::memcpy(st.b.data(), b, have);
      std::memset(static_cast<char*>(st.b.data()) + have, 0, static_cast<size_t>((pad - rows) * it.b_row));
      bp = st.b.data();
    }
    if (it.a_transposed) {
      transpose_block16(reinterpret_cast<const uint16_t*>(a), it.a_ld, static_cast<uint16_t*>(st.a.data()), pad,
                        rows, it.a_cols);
      ap = st.a.data();
    } else if (it.a_cols) {
      copy_block(a, it.a_ld, static_cast<char*>(st.a.data()), it.a_cols, rows, it.a_cols, it.es);
      ap = st.a.data();
    }
    if (it.staged && it.overwrite && only_call) {
      // The tile's whole sum in one call, to a step's cold gradient that nothing reads before the
      // optimizer: computed in the staging buffer and streamed out, so its lines are not first
      // read into the cache (olmoe_compat bf16, AMX: grouped weight gradients 35.2-38.5 -> 30.6-
      // 33.3 ms per step, alternated 3 times). The same values.
      float* prod = static_cast<float*>(st.c.data());
      cpu::gemm::execute(p, ap, bp, prod, thread);
      stream_block(prod, it.c_tile, c, it.c_tile, 1, it.c_tile);
    } else if (it.staged && it.overwrite && first) {
      cpu::gemm::execute(p, ap, bp, c, thread);  // the staged primitive writes, at C's layout (band x k, dense)
    } else if (it.staged) {
      float* prod = static_cast<float*>(st.c.data());
      cpu::gemm::execute(p, ap, bp, prod, thread);
      add_block(prod, c, it.c_tile);
    } else {
      cpu::gemm::execute(p, ap, bp, c, thread);
    }
    a += rows * it.a_row;
    b += rows * it.b_row;
    first = false;
  };
  for (int64_t j = 0; j < it.nfull; ++j) call(j == 0 && it.first ? it.first : it.full, it.chunk, it.chunk);
  if (it.mid_rows) call(it.mid, it.mid_rows, it.mid_rows);
  if (it.tail_rows) call(it.tail, it.tail_rows, std::max(it.tail_rows, it.tail_pad));
  if (it.c_rows && it.c_stream)
    stream_block(c, it.c_cols, it.c, it.c_ld, it.c_rows, it.c_cols);
  else if (it.c_rows)
    copy_block(reinterpret_cast<const char*>(c), it.c_cols, reinterpret_cast<char*>(it.c), it.c_ld,
               it.c_rows, it.c_cols, sizeof(float));
}

}  // namespace

std::vector<Item>& items() {
  static std::vector<Item> v;  // reused: no allocation after the first step
  return v;
}

// The ops are serialized: they share the per-thread buffers and the primitive cache.
std::mutex& op_mutex() {
  static std::mutex m;
  return m;
}

void run_items(std::vector<Item>& list) {
  if (list.empty()) return;
  // Largest first, then dynamic hand-out: the last items to start are the cheapest. Ties keep
  // plan order (std::stable_sort would, but it allocates a temporary buffer on every call).
  for (size_t i = 0; i < list.size(); ++i) list[i].seq = static_cast<int64_t>(i);
  std::sort(list.begin(), list.end(), [](const Item& x, const Item& y) {
    return x.cost != y.cost ? x.cost > y.cost : x.seq < y.seq;
  });
  size_t scratch = 0, a_bytes = 0, c_bytes = 0, w_bytes = 0, b_bytes = 0;
  for (const Item& it : list) {
    if (it.kernel == Item::Kernel::kLongData || it.kernel == Item::Kernel::kZero) continue;
    if (it.kernel == Item::Kernel::kWeight) {
      const int64_t rows = std::max({it.nfull > 0 ? it.chunk : 0, it.mid_rows, it.tail_rows});
      w_bytes = std::max(w_bytes, cpu::wgrad::scratch_bytes(it.dtype, rows, it.a_cols, it.c_tile / it.a_cols));
      continue;
    }
    if (it.full) scratch = std::max(scratch, cpu::gemm::scratch_bytes(it.full));
    if (it.first) scratch = std::max(scratch, cpu::gemm::scratch_bytes(it.first));
    if (it.mid) scratch = std::max(scratch, cpu::gemm::scratch_bytes(it.mid));
    if (it.tail) scratch = std::max(scratch, cpu::gemm::scratch_bytes(it.tail));
    const int64_t a_rows = std::max({it.nfull > 0 ? it.chunk : 0, it.mid_rows, it.tail_rows, it.tail_pad});
    a_bytes = std::max(a_bytes, static_cast<size_t>(a_rows * it.a_cols) * it.es);
    if (it.tail_pad > it.tail_rows) b_bytes = std::max(b_bytes, static_cast<size_t>(it.tail_pad * it.b_row));
    c_bytes = std::max(c_bytes, static_cast<size_t>(std::max(it.c_rows, it.c_pad_rows) * it.c_cols) * sizeof(float));
    if (it.staged) c_bytes = std::max(c_bytes, static_cast<size_t>(it.c_tile) * sizeof(float));
  }
  const int threads = omp_get_max_threads();
  cpu::gemm::prepare_threads(threads, scratch);
  auto& st = staging();
  if (static_cast<int>(st.size()) < threads) st.resize(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    Staging& s = st[static_cast<size_t>(t)];
    if (s.a.bytes() < a_bytes) s.a = Buffer(a_bytes);
    if (s.c.bytes() < c_bytes) s.c = Buffer(c_bytes);
    if (s.w.bytes() < w_bytes) s.w = Buffer(w_bytes);
    if (s.b.bytes() < b_bytes) s.b = Buffer(b_bytes);
  }
  const int64_t n = static_cast<int64_t>(list.size());
  std::exception_ptr error;
#pragma omp parallel if (n > 1)
  {
    // oneDNN must stay on this thread. In an active region it does (omp_in_parallel()); in an
    // inactive one (a single item) it would size its own region by omp_get_max_threads(), so
    // that is set to one here. The ICV belongs to this region's tasks, not to the caller.
    omp_set_num_threads(1);
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        run_item(list[static_cast<size_t>(i)], thread);
      } catch (...) {
#pragma omp critical(moe_gemm_error)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace moe::cpu::tiles
