// CPU GEMM tiles: oneDNN matmul primitives, and our own weight-gradient micro-kernels, run on
// fixed tiles under our own OpenMP scheduling (gemm_tiles.h; the ops' entry points are in
// gemm.cpp, the work items and the region that runs them in gemm_items.h).
//
// Determinism: every output is split into tiles whose boundaries depend only on the shapes (and,
// for grouped GEMMs, on the offsets), never on the thread count; the one exception, the bands of
// dense weight gradients, follows the thread count where a band's size cannot change its bits
// (weight_band). Each tile is computed on one thread by single-threaded oneDNN primitives
// (gemm_dnnl.h): one call, or, for weight gradients and long reductions, a fixed sequence of
// calls over consecutive chunks of the reduction accumulated in order. The reduction is never
// split across tiles, so which thread runs a tile cannot change a bit of the result.
//
// Kernels: oneDNN 2.6 runs its brgemm kernels (brg:avx512_core, brg:avx512_core_bf16) only on
// dense operands, and falls back to its JIT GEMM ("gemm:jit") on strided sub-matrices. Most tiles
// are therefore shaped to be dense: bands of whole rows for the forward and data gradients; for a
// forward cut into column tiles the C tile is computed in a per-thread buffer and copied out;
// weight gradients take bands of dw rows, whose A block (a column block of dy) is packed
// chunk by chunk into a per-thread buffer. Strided on purpose, where the JIT GEMM measured faster
// (Zen 5): the data gradient of small-M GEMMs cut into column tiles (B a column block of w); an
// LM head's forward (kWideWeight: C tiles written in place) and data gradient (kLongReduction: A
// a column block of dy per chunk).
//
// Our own micro-kernels, where this build has them: weight gradients (AVX-512 for fp32,
// AVX512-BF16 for bf16; gemm_wgrad.h: the same bands and chunks, each chunk's product added to dw
// in one rounding as before) and the bf16 data gradient of a long reduction (gemm_long.h: one
// chain over the whole reduction). Where oneDNN runs bf16 on AMX tiles (gemm::amx_bf16) every bf16
// GEMM is oneDNN's, on dense tiles: vdpbf16ps is no faster than fp32 FMAs there, and the JIT
// GEMM's strided tiles miss AMX (kernels_bench, Emerald Rapids, 2 threads: weight gradient
// 2048x512x512 167 -> 1,319 GFLOP/s, an LM head's data gradient 163 -> 1,848, its forward 419 -> 885).
//
// Scheduling: all tiles of one op, across experts for grouped GEMMs, form one flat list, ordered
// by decreasing cost and handed out dynamically, so a skewed expert load balances like an even
// one. oneDNN stays sequential inside our region: it checks omp_in_parallel(), and we also set
// the region's own thread count to one (an ICV local to the region's implicit tasks).
#include "kernels/cpu/gemm_tiles.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "kernels/cpu_memory.h"
#include "kernels/cpu/gemm_items.h"
#include "kernels/cpu/gemm_long.h"
#include "kernels/cpu/gemm_wgrad.h"

namespace moe::cpu::tiles {
namespace {

using cpu::gemm::Desc;
using cpu::gemm::Trans;

// ------------------------------------------------------------------ tile policy
// A function of the shapes (and offsets) only, never of the thread count. Numbers measured
// single-threaded on this CPU (Zen 4, 2 cores): bands of 64..256 rows run within a few % of one
// whole-matrix call (f32 ~100-110, bf16 ~190-215 GFLOP/s); 16-row bands lose ~20 %.
//
// Forward / data gradient: row bands of kMinRowTile..kRowTile rows aiming at kMinTiles tiles so
// the threads can share the work; when rows alone cannot give that many (small M), columns are
// cut too, into tiles at least kMinColTile wide and kMinTileFlops big (staged forward tiles at
// most kMaxStagedColTile wide, to bound the per-thread buffer).
constexpr int64_t kMinRowTile = 64;
constexpr int64_t kRowTile = 256;
constexpr int64_t kMinColTile = 128;
constexpr int64_t kMaxStagedColTile = 2048;
constexpr int64_t kMinTiles = 8;
constexpr double kMinTileFlops = 4e6;
// Long reductions (an LM head's data gradient reduces over the vocabulary): each tile reduces in
// chunks of kReduceChunk, in order, its A a strided column block of dy (oneDNN runs its JIT GEMM
// there), and aims at kMinTiles / 2 row bands, since every band reads the whole weight. At
// 1024 x 256 x 50,304 on 2 threads (Zen 5, kernels_bench), one brgemm call per band over the whole
// reduction against these chunks: fp32 343-348 -> 501-516 GFLOP/s, bf16 770 -> 845
// (docs/PERFORMANCE_HISTORY.md, #30 sixth pass).
constexpr int64_t kLongReduction = kCpuLongReduction;  // kernels/cpu_memory.h
constexpr int64_t kReduceChunk = 2048;
// Wide weights (an LM head's forward, n x k at least kWideWeight elements): tiles of up to
// kWideRowTile rows by kWideColTile columns written in place (strided C: oneDNN's JIT GEMM), so
// each block of the weight is packed once per kWideRowTile rows instead of once per row band:
// 1024 x 50,304 x 256 on 2 threads (Zen 5, kernels_bench), fp32 349-356 -> 511-514 GFLOP/s, bf16
// 855-867 -> 986-1,003.
constexpr int64_t kWideWeight = int64_t{1} << 20;
constexpr int64_t kWideRowTile = 1024;
constexpr int64_t kWideColTile = 2048;
// On AMX (bf16) the wide forward runs oneDNN's brgemm on staged tiles of up to kAmxWideRowTile
// rows x kAmxWideColTile columns, each copied out with streaming stores: written in place, the LM
// head's fp32 logits (206 MB a micro-batch in fine_grained) were first read into the cache line
// by line (fine_grained bf16 linear_fwd 74.7-87.4 -> 49.0-58.6 ms per step, olmoe_compat 28.1-28.7
// -> 23.6-23.7). Tall and narrow, so each call packs its 256 columns of the weight once for up to
// 1,024 rows: against 128-row bands x 2,048 columns (Emerald Rapids, alternated), fine_grained bf16
// linear_fwd 53-55 -> 44-46 ms per step and tokens/s +5.3% (4 rounds +3.7 .. +9.9%); kernels_bench
// 1024x50,304x256 18.1-22.7 -> 15.0-15.6 ms, 2048x8192x512 9.7-10.9 -> 7.9-9.1 ms. The fp32 wide
// forward is compute-bound: staged and streamed, no faster.
constexpr int64_t kAmxWideRowTile = 1024;
constexpr int64_t kAmxWideColTile = 256;
// Weight gradient dw(n,k): bands of kMinWeightBand..kWeightBand rows of dw (full width),
// reducing over the rows of dy and x in chunks of kWeightChunk rows (weight_band).
constexpr int64_t kMinWeightBand = 16;
constexpr int64_t kWeightBand = 256;
constexpr int64_t kWeightChunk = 512;
constexpr int64_t kOwnWeightBand = 1024;
constexpr int64_t kOwnWeightBandIntel = 256;
// Grouped weight gradients: each expert's rows are cut into reduction chunks of kGroupChunk
// rows, then at most one of a multiple of kGroupRows rows and one of fewer than kGroupRows (tiles
// are (expert, band of dw rows)); the forward and data gradient cut rows as kPadRows says. Each
// family's primitives (every length it may use) are created together, one family per
// configuration, so a new expert load creates none. Big
// chunks matter for hot experts: each call re-packs the expert's weights (64-row chunks cost a
// skewed load ~10 % more than 256-row ones).
constexpr int64_t kGroupRows = 64;
constexpr int64_t kGroupChunk = 256;
// On AMX (bf16) weight gradients reduce chunks of kAmxChunk rows instead, and the rows past them
// go in ONE call, its reduction padded with zeros (A's transposed copy and a copy of B's rows,
// Item::tail_pad) to a multiple of kAmxPadRows, a tile's reduction depth. Tails of 1..63 rows
// and 64-row mid chunks had cut oneDNN's AMX kernels to 397-667 GFLOP/s on uneven loads (16
// experts x 128..384 rows, 512 x 512; 559-1,127 even); padded: 720-729 (256-row chunks padded:
// 538-657). Against the previous build, 128 experts x 256..768 rows (256 x 256) 875-916 -> 1,164-
// 1,290, x 512 rows 1,141-1,293 -> 1,341-1,380 (kernels_bench, Emerald Rapids, alternated 3
// times). In olmoe_compat's bf16 step the grouped weight gradients took 48-63 ms, then 35. 16
// primitives per family.
constexpr int64_t kAmxPadRows = 32;
constexpr int64_t kAmxChunk = 512;
// Grouped weight-gradient bands: up to kGroupWeightBand rows of an expert's dw, cut evenly. Each
// band re-packs the expert's rows of x, so an expert's whole dw in one band packs them once: on 2
// threads (kernels_bench, Zen 5) 16 experts x 256 rows, 512 x 512, fp32 355-373 -> 399-400 GFLOP/s,
// bf16 723-769 -> 772-823; 64 experts x 64 rows, 1024 x 512, fp32 295-331 -> 345-351, bf16
// 448-495 -> 535-563 (256-row bands before). Shapes only: the bands never follow the threads.
constexpr int64_t kGroupWeightBand = 1024;
// Forward and data gradient: an expert's rows past its kGroupChunk-row chunks go in ONE call,
// its length rounded up to kPadRows and the extra rows (the next expert's, or unused buffer
// rows: every output row depends on its own input row only) computed into a per-thread buffer
// and dropped. Only where the padded rows would pass the end of A does the remainder take two
// exact calls (a multiple of kPadRows, then fewer). Measured at 128 experts x ~512 rows, uneven
// (learned routing): 256 + 192 + a 1..63-row tail was ~60% more calls, each re-packing the
// expert's weights, than even loads (docs/PERFORMANCE_HISTORY.md, expert scaling). The family holds
// lengths 1..kPadRows-1 and the multiples of kPadRows up to kGroupChunk: 31 primitives.
constexpr int64_t kPadRows = 16;
// Weight gradients: a tile's product is computed into the thread's dense staging buffer and then
// added to dw, rather than by the primitive's own accumulate (its sum post-op), when the tile
// fits kStagedSumBytes (no more than the forward's staged tiles, kRowTile x kMaxStagedColTile
// floats). Where dw is cold (every expert's dw, except at a step's first write, which overwrites:
// Item::overwrite) the post-op's reads of the old C stall the micro-kernel: 57 -> 67% of the fp32
// peak, 53 -> 71% of bf16's, at olmoe_compat's expert shape (docs/PERFORMANCE_HISTORY.md). The same sum,
// C_old + product, in the same one rounding.
constexpr int64_t kStagedSumBytes = kRowTile * kMaxStagedColTile * 4;
bool staged_sum(int64_t band, int64_t k) { return band * k * 4 <= kStagedSumBytes; }

struct RowChunks {
  int64_t nfull, mid, tail;  // nfull chunks of kGroupChunk rows, then mid rows, then tail rows
};
RowChunks split_rows(int64_t rows) {
  return {rows / kGroupChunk, rows % kGroupChunk / kGroupRows * kGroupRows, rows % kGroupRows};
}

// bf16 on AMX tiles (gemm::amx_bf16): oneDNN's dense brgemm tiles beat our vdpbf16ps kernels and
// its strided JIT GEMM several times over, so such a build takes neither.
bool amx(DType t) { return t == DType::kBF16 && cpu::gemm::amx_bf16(); }
bool own_weight_kernel(DType t) { return cpu::wgrad::available(t) && !amx(t); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Splits `len` into tiles of at most `max_tile`, evenly, the tile size rounded up to 16.
int64_t even_tile(int64_t len, int64_t max_tile) {
  const int64_t count = ceil_div(len, max_tile);
  return std::min(len, round_up(ceil_div(len, count), 16));
}

// About len / min_tiles, rounded up to 16 and clamped to [lo, hi] (and to len).
int64_t band_rows(int64_t len, int64_t lo, int64_t hi, int64_t min_tiles) {
  return std::min(len, std::clamp(round_up(ceil_div(len, min_tiles), 16), lo, hi));
}

// Dense weight gradients dw(n,k): as many bands as threads, at least two. Each band re-packs the
// chunk of x (oneDNN's B) it reduces over, so fewer, wider bands pack less: on 2 threads
// (kernels_bench, Zen 5) 64-row bands (kMinTiles = 8, the rule before) against two: 2048x512x512
// fp32 401-416 -> 473-505 GFLOP/s, bf16 812-877 -> 932-981; the router's 16384x128x256 bf16
// 482-560 -> 785-869. Unlike the other tiles, the band follows the thread count: a dw element's
// bits do not depend on the band that holds it (oneDNN reduces each element over the chunk's rows
// in order, whatever the band's rows; Gemm.WeightBandsOfAnySizeGiveTheSameBits, and every run's
// 1/2/3-thread bitwise tests).
// Our own kernel (gemm_wgrad.h) streams its band's a panel (one group of kR columns at a time)
// and keeps only b's in L2, so it takes bands of up to kOwnWeightBand rows: an LM head's weight
// gradient packs b a quarter as often (Zen 5). On Intel's Xeons the panel of such a band (2 MiB
// in fp32 at 512-row chunks), re-read for every column block of b, comes from an L3 that feeds
// one core at a fraction of a Zen L3's rate: bands of kOwnWeightBandIntel rows there, whose panel
// stays in L2 beside b (Emerald Rapids, kernels_bench fp32, alternated 3 times: 2048x8192x512
// 293-306 -> 381-401 GFLOP/s, 1024x50304x256 332-335 -> 383-385; tools/ab_bench.py fp32
// olmoe_compat +2.5%, fine_grained +3.4%). A dw element's bits do not depend on its band.
int64_t own_weight_band_cap() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel ? kOwnWeightBandIntel : kOwnWeightBand;
}
int64_t weight_band(int64_t n, bool own) {
  const int64_t tiles = std::max(2, omp_get_max_threads());
  const int64_t cap = own ? own_weight_band_cap() : kWeightBand;
  return std::min(n, std::clamp(round_up(ceil_div(n, tiles), 16), kMinWeightBand, cap));
}

struct Tiles {
  int64_t tm, tn;
};

// Forward and data gradient, C(m,n) with reduction k.
Tiles band_tiles(int64_t m, int64_t n, int64_t k, int64_t max_tn, int64_t min_tiles) {
  const int64_t tm = band_rows(m, kMinRowTile, kRowTile, min_tiles);
  const int64_t mt = ceil_div(m, tm);
  if (mt >= min_tiles) return {tm, n};
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  int64_t nt = std::max<int64_t>(1, std::min({ceil_div(min_tiles, mt), n / kMinColTile,
                                              static_cast<int64_t>(flops / kMinTileFlops) / mt}));
  if (nt > 1) nt = std::max(nt, ceil_div(n, max_tn));
  return {tm, std::min(n, round_up(ceil_div(n, nt), 16))};
}

// How a forward or data gradient `d` (ta = kN) is cut: tiles, whether column tiles are staged
// through a dense C buffer (forward column tiles, so oneDNN runs brgemm on them), and the
// reduction chunk (0: one call over the whole reduction).
struct BandPlan {
  Tiles tiles;
  bool staged = false;
  int64_t reduce_chunk = 0;
  bool stream = false;  // staged tiles copied out with streaming stores (Item::c_stream)
};
BandPlan band_plan(const Desc& d, bool forward) {
  if (forward && d.n * d.k >= kWideWeight && !amx(d.dtype))
    return {{even_tile(d.m, kWideRowTile), even_tile(d.n, kWideColTile)}, false, 0};
  if (forward && d.n * d.k >= kWideWeight)  // on AMX
    return {{even_tile(d.m, kAmxWideRowTile), even_tile(d.n, kAmxWideColTile)}, true, 0, true};
  const bool long_reduction = !forward && d.k >= kLongReduction;
  const Tiles t = band_tiles(d.m, d.n, d.k, forward ? kMaxStagedColTile : d.n,
                             long_reduction ? kMinTiles / 2 : kMinTiles);
  return {t, forward && t.tn < d.n, long_reduction ? kReduceChunk : 0};
}

// One tile of `d` at rows x cols reducing `red` of its k, written (accumulate = false) or added.
Desc tile_desc(const Desc& d, const BandPlan& p, int64_t rows, int64_t cols, int64_t red, bool accumulate) {
  Desc td = d;
  td.m = rows;
  td.n = cols;
  td.k = red;
  if (p.staged) td.ldc = cols;
  td.accumulate = accumulate;
  return td;
}

// ------------------------------------------------------------------ plans

// y(m,n) (+)= x(m,k) * w(n,k)^T
Desc fwd_desc(DType t, int64_t m, int64_t n, int64_t k, bool acc) {
  return {t, Trans::kN, Trans::kT, m, n, k, k, k, n, acc};
}
// dx(m,k) (+)= dy(m,n) * w(n,k): C (m,k), reduction n
Desc bwd_data_desc(DType t, int64_t m, int64_t n, int64_t k, bool acc) {
  return {t, Trans::kN, Trans::kN, m, k, n, n, k, k, acc};
}
// A band of `band` rows of dw(n,k) += dy^T x over `rows` rows, with dy's column block packed
// densely: A stored (rows, band), transposed. Accumulating unless the tile's sum is staged.
// With bf16 on AMX, A is copied transposed instead (Item::a_transposed): (band, rows), row-major.
Desc weight_desc(DType t, int64_t band, int64_t k, int64_t rows) {
  if (amx(t)) return {t, Trans::kN, Trans::kN, band, k, rows, rows, k, k, !staged_sum(band, k)};
  return {t, Trans::kT, Trans::kN, band, k, rows, band, k, k, !staged_sum(band, k)};
}

// Forward or data gradient of a whole dense GEMM `d` (ta = kN) on a, b, c (band_plan).
void plan_bands(const Desc& d, bool forward, const void* a, const void* b, float* c) {
  const size_t es = dtype_size(d.dtype);
  const BandPlan p = band_plan(d, forward);
  const int64_t chunk = p.reduce_chunk, tail = chunk ? d.k % chunk : 0;
  for (int64_t i0 = 0; i0 < d.m; i0 += p.tiles.tm)
    for (int64_t j0 = 0; j0 < d.n; j0 += p.tiles.tn) {
      const int64_t rows = std::min(p.tiles.tm, d.m - i0), cols = std::min(p.tiles.tn, d.n - j0);
      Item it;
      it.a = static_cast<const char*>(a) + static_cast<size_t>(i0 * d.lda) * es;
      it.b = static_cast<const char*>(b) +
             static_cast<size_t>(d.tb == Trans::kN ? j0 : j0 * d.ldb) * es;
      it.c = c + i0 * d.ldc + j0;
      it.es = es;
      if (chunk) {  // chunks of the reduction in order: A moves along its rows, B down (tb = kN)
        it.first = cpu::gemm::primitive(tile_desc(d, p, rows, cols, chunk, d.accumulate));
        it.full = cpu::gemm::primitive(tile_desc(d, p, rows, cols, chunk, true));
        it.nfull = d.k / chunk;
        it.chunk = chunk;
        if (tail) it.tail = cpu::gemm::primitive(tile_desc(d, p, rows, cols, tail, true));
        it.tail_rows = tail;
        it.a_row = static_cast<int64_t>(es);
        it.b_row = static_cast<int64_t>(static_cast<size_t>(d.ldb) * es);
      } else {
        it.full = cpu::gemm::primitive(tile_desc(d, p, rows, cols, d.k, d.accumulate));
      }
      if (p.staged) {
        it.c_rows = rows;
        it.c_cols = cols;
        it.c_ld = d.ldc;
        it.c_in = d.accumulate;
        it.c_stream = p.stream;
      }
      it.cost = static_cast<double>(rows) * static_cast<double>(cols);
      items().push_back(it);
    }
}

// The bf16 data gradient of a long reduction on our own kernel (gemm_long.h): w paired once per
// op into a grow-only buffer (in parallel), then bands of dx rows as band_plan cuts them, each
// reducing the whole of n. Only where it writes dx (every LM head's call; an accumulating one
// keeps oneDNN's chunks).
bool own_long_data(const Desc& d) {
  return d.k >= kLongReduction && !d.accumulate && cpu::longred::available(d.dtype) && !amx(d.dtype);
}
void plan_long_data(const Desc& d, const void* dy, const void* w, float* dx) {
  static Buffer pairs;
  const int64_t red = d.k, cols = d.n, words = cpu::longred::pair_words(red, cols);
  if (pairs.bytes() < static_cast<size_t>(words) * 4) pairs = Buffer(static_cast<size_t>(words) * 4);
  uint32_t* wp = static_cast<uint32_t*>(pairs.data());
  const int64_t npairs = ceil_div(red, 2), step = 64;
#pragma omp parallel for schedule(static)
  for (int64_t p0 = 0; p0 < npairs; p0 += step)
    cpu::longred::pair_rows(w, red, cols, p0, std::min(npairs, p0 + step), wp);
  const int64_t tm = band_plan(d, /*forward=*/false).tiles.tm;
  for (int64_t i0 = 0; i0 < d.m; i0 += tm) {
    Item it;
    it.kernel = Item::Kernel::kLongData;
    it.a = static_cast<const char*>(dy) + static_cast<size_t>(i0 * d.lda) * dtype_size(d.dtype);
    it.c = dx + i0 * d.ldc;
    it.pairs = wp;
    it.rows = std::min(tm, d.m - i0);
    it.red = red;
    it.cols = cols;
    it.cost = static_cast<double>(it.rows) * static_cast<double>(cols);
    items().push_back(it);
  }
}

// Grouped forward / data gradient: C rows [off[e], off[e+1]) = A rows * B_e, where B_e starts
// b_expert bytes after B_{e-1}. `d` describes one expert (m ignored, ta = kN); A has a_rows
// rows. Every item is a full-width chunk of rows, dense in A, B and C: kGroupChunk-row chunks,
// then the remainder padded to kPadRows (see kPadRows).
void plan_grouped_rows(const Desc& d, const void* a, const void* b, int64_t b_expert, float* c,
                       const int32_t* off, int64_t experts, int64_t a_rows) {
  const size_t es = dtype_size(d.dtype);
  const Primitive* const* fam = cpu::gemm::family(d, /*vary_k=*/false, kPadRows, kGroupChunk);
  for (int64_t e = 0; e < experts; ++e) {
    const char* be = static_cast<const char*>(b) + static_cast<size_t>(e * b_expert);
    int64_t i0 = off[e];
    auto add = [&](int64_t rows, int64_t padded) {
      Item it;
      it.a = static_cast<const char*>(a) + static_cast<size_t>(i0 * d.lda) * es;
      it.b = be;
      it.c = c + i0 * d.ldc;
      it.full = fam[padded];
      it.es = es;
      if (padded > rows) {  // staged: dense at leading dimension n (d.ldc == d.n here)
        it.c_rows = rows;
        it.c_cols = d.n;
        it.c_ld = d.ldc;
        it.c_pad_rows = padded;
      }
      it.cost = static_cast<double>(padded) * static_cast<double>(d.n);
      items().push_back(it);
      i0 += rows;
    };
    const int64_t rows = off[e + 1] - off[e], rest = rows % kGroupChunk;
    for (int64_t j = 0; j < rows / kGroupChunk; ++j) add(kGroupChunk, kGroupChunk);
    const int64_t padded = round_up(rest, kPadRows);
    if (rest == 0) continue;
    if (i0 + padded <= a_rows) {
      add(rest, padded);
    } else {
      if (rest / kPadRows) add(rest / kPadRows * kPadRows, rest / kPadRows * kPadRows);
      if (rest % kPadRows) add(rest % kPadRows, rest % kPadRows);
    }
  }
}

// One weight-gradient tile: dw rows [i0, i0+band) (full width k, at dw) (+)= dy^T x over the
// rows starting at dy and x: nfull chunks of `chunk` rows (primitive full), then mid_rows (mid)
// and tail_rows (tail) when those primitives are given.
Item weight_tile(DType t, const char* dy, const char* x, float* dw, int64_t n, int64_t k, int64_t i0,
                 int64_t band, bool accumulate) {
  const size_t es = dtype_size(t);
  Item it;
  it.a = dy + static_cast<size_t>(i0) * es;
  it.b = x;
  it.c = dw + i0 * k;
  it.a_row = static_cast<int64_t>(static_cast<size_t>(n) * es);
  it.b_row = static_cast<int64_t>(static_cast<size_t>(k) * es);
  it.es = es;
  it.a_cols = band;
  it.a_ld = n;
  it.c_tile = band * k;  // dw rows [i0, i0+band), full width: contiguous
  it.a_transposed = amx(t);  // weight_desc's A
  it.staged = staged_sum(band, k);
  it.overwrite = !accumulate;
  return it;
}

// A weight tile that runs our own micro-kernel (no primitives, nothing staged).
void use_own_kernel(Item& it, DType t) {
  it.kernel = Item::Kernel::kWeight;
  it.dtype = t;
  it.staged = false;
}

// dw(n,k) (+)= dy(m,n)^T x(m,k): bands of dw rows, each reducing all m rows in chunks.
void plan_weight(DType t, int64_t m, int64_t n, int64_t k, const void* dy, const void* x,
                 float* dw, bool accumulate) {
  const bool own = own_weight_kernel(t);
  const int64_t band = weight_band(n, own);
  const int64_t chunk = std::min(m, kWeightChunk), tail = m % chunk;
  for (int64_t i0 = 0; i0 < n; i0 += band) {
    const int64_t b = std::min(band, n - i0);
    Item it =
        weight_tile(t, static_cast<const char*>(dy), static_cast<const char*>(x), dw, n, k, i0, b, accumulate);
    it.nfull = m / chunk;
    it.chunk = chunk;
    it.tail_rows = tail;
    if (own) {
      use_own_kernel(it, t);
    } else {
      it.full = cpu::gemm::primitive(weight_desc(t, b, k, chunk));
      if (tail) it.tail = cpu::gemm::primitive(weight_desc(t, b, k, tail));
    }
    it.cost = static_cast<double>(m) * static_cast<double>(b) * static_cast<double>(k);
    items().push_back(it);
  }
}

// dw(n,k) = 0 as items of `band` rows each, run with the op's tiles rather than before them on
// the planning thread: a router near collapse leaves most experts without rows (olmoe_compat's
// bench steps run at a load of 5-8 of a possible 8: up to 14 of 16 experts empty), and their dw,
// 3 MB an expert and layer there, was zeroed serially while the other thread waited. Costed as a tile of
// kZeroCostRows reduced rows (a memory pass), so they run last and fill the threads' tails.
constexpr int64_t kZeroCostRows = 32;
void plan_zero(float* dw, int64_t n, int64_t k, int64_t band) {
  for (int64_t i0 = 0; i0 < n; i0 += band) {
    Item it;
    it.kernel = Item::Kernel::kZero;
    it.c = dw + i0 * k;
    it.c_tile = std::min(band, n - i0) * k;
    it.cost = static_cast<double>(kZeroCostRows) * static_cast<double>(it.c_tile);
    items().push_back(it);
  }
}

// Grouped: tiles (expert, band of dw[e] rows), each reducing its expert's rows in chunks
// (split_rows), in order. Never split by rows.
void plan_grouped_weight(DType t, int64_t n, int64_t k, const void* dy, const void* x, float* dw,
                         const int32_t* off, int64_t experts, bool accumulate) {
  const size_t es = dtype_size(t);
  // Wider than kWeightBand only while the tile stays staged (a band of cold dw summed by the
  // primitive stalls it: kStagedSumBytes).
  const int64_t cap = std::max(kWeightBand, std::min(kGroupWeightBand, kStagedSumBytes / (4 * k)));
  const int64_t band = even_tile(n, cap);
  const Primitive* const* fams[2] = {nullptr, nullptr};  // full bands, last band
  const bool own = own_weight_kernel(t), pad = amx(t);
  for (int64_t i0 = 0; i0 < n && !own; i0 += band) {
    const Primitive* const*& f = fams[i0 + band >= n];
    if (!f)
      f = cpu::gemm::family(weight_desc(t, std::min(band, n - i0), k, 0), /*vary_k=*/true,
                            pad ? kAmxPadRows : kGroupRows, pad ? kAmxChunk : kGroupChunk, /*multiples_only=*/pad);
  }
  // Expert-major: consecutive items share the expert's rows of dy and x (kept in order by the
  // cost sort's tie-break on plan order).
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) {  // a zero-row expert adds nothing; without accumulate its dw is zeros
      if (!accumulate) plan_zero(dw + e * n * k, n, k, band);
      continue;
    }
    const RowChunks ch = pad ? RowChunks{rows / kAmxChunk, 0, rows % kAmxChunk} : split_rows(rows);
    for (int64_t i0 = 0; i0 < n; i0 += band) {
      const int64_t b = std::min(band, n - i0);
      const Primitive* const* fam = fams[i0 + band >= n];
      Item it = weight_tile(t, static_cast<const char*>(dy) + static_cast<size_t>(off[e] * n) * es,
                            static_cast<const char*>(x) + static_cast<size_t>(off[e] * k) * es,
                            dw + e * n * k, n, k, i0, b, accumulate);
      it.nfull = ch.nfull;
      it.chunk = pad ? kAmxChunk : kGroupChunk;
      it.mid_rows = ch.mid;
      it.tail_rows = ch.tail;
      if (own) {
        use_own_kernel(it, t);
      } else {
        it.full = fam[it.chunk];
        it.mid = ch.mid ? fam[ch.mid] : nullptr;
        it.tail_pad = pad ? round_up(ch.tail, kAmxPadRows) : ch.tail;
        it.tail = ch.tail ? fam[it.tail_pad] : nullptr;
      }
      it.cost = static_cast<double>(rows) * static_cast<double>(b) * static_cast<double>(k);
      items().push_back(it);
    }
  }
}

// Plans one whole op into the item list and runs it, serialized with the other ops.
template <class Plan>
void run_op(const Plan& plan) {
  std::lock_guard<std::mutex> lock(op_mutex());
  items().clear();
  plan();
  run_items(items());
}

}  // namespace

void zero_rows(float* c, int64_t rows, int64_t cols) {
  std::memset(c, 0, static_cast<size_t>(rows * cols) * sizeof(float));
}

void linear_fwd(DType t, int64_t m, int64_t n, int64_t k, const void* x, const void* w, float* y, bool accumulate) {
  run_op([&] {
    plan_bands(fwd_desc(t, m, n, k, accumulate), /*forward=*/true, x, w, y);
  });
}

void linear_bwd_data(DType t, int64_t m, int64_t n, int64_t k, const void* dy, const void* w, float* dx,
                     bool accumulate) {
  run_op([&] {
    const Desc d = bwd_data_desc(t, m, n, k, accumulate);
    if (own_long_data(d)) {
      plan_long_data(d, dy, w, dx);
    } else {
      plan_bands(d, /*forward=*/false, dy, w, dx);
    }
  });
}

void linear_bwd_weight(DType t, int64_t m, int64_t n, int64_t k, const void* dy, const void* x, float* dw,
                       bool accumulate) {
  run_op([&] {
    plan_weight(t, m, n, k, dy, x, dw, accumulate);
  });
}

void grouped_fwd(DType t, int64_t n, int64_t k, const void* x, const void* w, const int32_t* off, int64_t experts,
                 int64_t rows, float* y) {
  run_op([&] {
    plan_grouped_rows(fwd_desc(t, 0, n, k, false), x, w, n * k * static_cast<int64_t>(dtype_size(t)), y, off,
                      experts, rows);
  });
}

void grouped_bwd_data(DType t, int64_t n, int64_t k, const void* dy, const void* w, const int32_t* off,
                      int64_t experts, int64_t rows, float* dx) {
  run_op([&] {
    plan_grouped_rows(bwd_data_desc(t, 0, n, k, false), dy, w, n * k * static_cast<int64_t>(dtype_size(t)), dx,
                      off, experts, rows);
  });
}

void grouped_bwd_weight(DType t, int64_t n, int64_t k, const void* dy, const void* x, const int32_t* off,
                        int64_t experts, float* dw, bool accumulate) {
  run_op([&] {
    plan_grouped_weight(t, n, k, dy, x, dw, off, experts, accumulate);
  });
}

std::string first_tile_impl(GemmOp op, DType dtype, int64_t m, int64_t n, int64_t k) {
  std::lock_guard<std::mutex> lock(op_mutex());
  Desc d;
  if (op == GemmOp::kBackwardWeight) {
    if (own_weight_kernel(dtype)) return dtype == DType::kBF16 ? "moecore:avx512_bf16" : "moecore:avx512";
    d = weight_desc(dtype, weight_band(n, false), k, std::min(m, kWeightChunk));
  } else {
    const bool fwd = op == GemmOp::kForward;
    d = fwd ? fwd_desc(dtype, m, n, k, false) : bwd_data_desc(dtype, m, n, k, false);
    if (!fwd && own_long_data(d)) return "moecore:avx512_bf16";
    const BandPlan p = band_plan(d, fwd);
    d = tile_desc(d, p, p.tiles.tm, p.tiles.tn, p.reduce_chunk ? p.reduce_chunk : d.k, false);
  }
  return cpu::gemm::impl_info(cpu::gemm::primitive(d));
}

}  // namespace moe::cpu::tiles
