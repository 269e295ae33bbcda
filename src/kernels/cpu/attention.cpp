// Fast causal grouped-query attention on CPUs, FlashAttention-2 style, fp32.
//
// Tiles of kTile queries x kTile keys. Each tile's scores are a kTile x kTile block in per-thread
// scratch (never an S x S matrix); fully masked tiles (keys after every query of the tile) are
// skipped, and on the diagonal tile the 16-lane blocks that are entirely masked are skipped too.
// Scores are kept in base-2 units (q pre-scaled by log2(e)/sqrt(hd)) so the softmax uses exp2;
// lse is saved in natural-log units as the op list says.
//
// Layout trick: every tile product is vectorized along a 64-wide tile dimension (queries or keys)
// rather than along hd, so any hd works at full vector width (hd = 8 in tests, 64/128 in models).
// One operand is packed transposed (hd x kTile, zero padded); the other is read row by row from the
// tensor and broadcast. Two register-blocked micro-kernels (attention_tiles.h; 4 rows x 64 lanes,
// 16 accumulators) cover every product:
//   scores:     C[r][x]  = sum_d A_r[d] * Bt[d][x]             (r < R rows of a tensor)
//   accumulate: C[d][x] += sum_r A_r[d] * P[r][x]              (C is hd x kTile)
//
// Forward: parallel over (batch, head, query tile); online softmax per query lane.
// Backward, no atomics, every output element written by exactly one work item in a fixed order:
//   pass 0: D = rowsum(dO * O)                            parallel over (batch, position)
//   pass 1: dk, dv, parallel over (batch, kv head, key tile), looping over the group's query heads
//           and then query tiles in a fixed order; scores recomputed from q, k and lse.
//           Each tile's ds is also kept in a store (kernels/cpu_memory.h), transposed, in the
//           form pass 2 reads (fp32, or bf16 pair rows for bf16 products).
//   pass 2: dq, parallel over (batch, head, query tile), looping over key tiles: dq^T += k^T ds
//           from the store (5 tile products in all, as the FLOP count says). Where one (batch,
//           kv head) pair's tiles exceed the store's bound, pass 2 recomputes the scores and dp
//           instead (7 products: the price of no atomics); the passes run for as many pairs at a
//           time as the store holds.
// So results are bitwise identical for any thread count (and store size).
// Intra-document masking (doc_start given): key tiles wholly before every query's document are
// skipped, and inside a tile keys before a query's document start are masked to -inf like the
// causal ones. Work items are scheduled dynamically,
// longest first; each item's arithmetic does not depend on which thread runs it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/buffer.h"
#include "kernels/checks/attention_checks.h"
#include "kernels/cpu_memory.h"
#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_simd.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_dnnl.h"

namespace moe::cpu {
namespace {

using namespace attn;  // NOLINT: the kernels' own vocabulary

// Grow-only buffers of the thread that asks, one per use, grown (never per tile or per op) to the
// largest size asked for: kScratch each thread's tile scratch, kRowSums D (B*H*S floats, on the
// calling thread), kStore the backward's store of ds tiles (calling thread).
enum class Use { kScratch, kRowSums, kStore };
template <Use>
float* grow_only(size_t floats) {
  thread_local Buffer buf;
  if (buf.bytes() < floats * sizeof(float)) buf = Buffer(floats * sizeof(float));
  return static_cast<float*>(buf.data());
}

// ------------------------------------------------------------------ shapes
struct Dims {
  int64_t B, S, H, G;
  int hd;
  const int32_t* doc = nullptr;  // (B,S) document starts, or null for plain causal
  int64_t rep() const { return H / G; }
  int64_t qstride() const { return H * hd; }  // between positions in q, o, dout, dq
  int64_t kstride() const { return G * hd; }  // between positions in k, v, dk, dv
  int64_t tiles() const { return (S + kTile - 1) / kTile; }
  // Whether the backward streams dq, dk and dv around the cache (unpack_transposed): where dq
  // alone passes an L2 (2 MiB on Zen 5), measured faster at olmoe_compat's 4 MiB, slower at
  // fine_grained's 1 MiB, whose gradients the next ops find in cache.
  bool stream_grads() const { return B * S * H * hd * int64_t{sizeof(float)} > (int64_t{2} << 20); }
};

constexpr int64_t kMaxHd = 4096;  // the largest head dim the kernels take
static_assert(kCpuAttentionTile == kTile, "the memory estimate's tile is the kernels' tile");

// The store's tiles of one query head: tile pair (qt, kt <= qt), keys x queries.
int64_t tile_pairs(int64_t tiles) { return tiles * (tiles + 1) / 2; }
size_t stored_tile(int64_t qt, int64_t kt) { return static_cast<size_t>(qt * (qt + 1) / 2 + kt) * kTile * kTile; }

Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  MOE_CHECK(q.dtype != DType::kF64, "cpu backend does not support f64 (", op,
            "; use the ref backend for the f64 path)");
  MOE_CHECK(q.dtype == DType::kF32 || q.dtype == DType::kBF16, op, ": cpu backend supports f32 and bf16, got ",
            dtype_name(q.dtype));
  const AttentionShape a = check_attention_inputs(q, k, v, op);
  MOE_CHECK(a.hd >= 1 && a.hd <= kMaxHd, op, ": head dim ", a.hd, " out of range");
  return Dims{a.B, a.S, a.H, a.G, static_cast<int>(a.hd)};
}
// With document starts: the first key tile any query of tile [q0, q0+nq) reads (key tiles wholly
// before every query's document are skipped), and each query lane's start as float (0 for
// padding lanes) in lanes_out. Without: 0.
int64_t first_key_tile(const Dims& d, int64_t b, int64_t q0, int nq, float* lanes_out) {
  if (!d.doc) return 0;
  const int32_t* ds = d.doc + b * d.S + q0;
  int64_t lo = q0 + nq;
  for (int i = 0; i < kTile; ++i) {
    lanes_out[i] = i < nq ? static_cast<float>(ds[i]) : 0.0f;
    if (i < nq) lo = std::min<int64_t>(lo, ds[i]);
  }
  return lo / kTile * kTile;
}

// Scratch layout for every pass, in floats: four hd x kTile panels, two kTile x kTile tiles and
// four kTile vectors. O(tile^2 + tile*hd) per thread.
size_t tile_floats(int hd) { return (4 * size_t(hd) + 2 * kTile + 4) * kTile; }
// Plus, after them, the bf16 products' packing area (Bf16Products): a probability or
// score-gradient tile's pair rows, kTile/2 x kTile words (q, k, v, dO are packed once per op).
size_t scratch_floats(int hd) { return tile_floats(hd) + size_t(kTile / 2) * kTile; }

// ------------------------------------------------------------------ forward
// kDoc: intra-document masking (d.doc set); a template parameter so the plain causal path
// compiles exactly as without it.
// o rows of a tile from the transposed panel, each scaled by mul: fp32, or (bf16 mode's saved o)
// rounded to bf16 as they are stored, through `rows` (kTile x hd floats of the tile's scratch).
void store_o_rows(const float* panel, int n, int hd, const float* mul, float* dst, int64_t stride, float*) {
  unpack_transposed(panel, n, hd, mul, dst, stride, false);
}
void store_o_rows(const float* panel, int n, int hd, const float* mul, bf16* dst, int64_t stride, float* rows) {
  unpack_transposed(panel, n, hd, mul, rows, hd, false);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < hd; ++c) elem::store(dst + i * stride + c, rows[static_cast<size_t>(i) * hd + c]);
}

template <class P, bool kDoc, class O>
void forward_tile(const Dims& d, typename P::Operand q, typename P::Operand k, typename P::Operand v, O* o,
                  float* lse, int64_t b, int64_t h, int64_t qt, float* ws) {
  const int hd = d.hd;
  const int64_t g = h / d.rep(), q0 = qt * kTile;
  const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
  float* qt_panel = ws;                     // hd x kTile: q^T * log2(e)/sqrt(hd)
  float* o_panel = ws + hd * kTile;         // hd x kTile: unnormalized o^T
  float* o_rows = ws + 2 * hd * kTile;      // kTile x hd: a bf16 o's rows before rounding
  float* s_tile = ws + 4 * hd * kTile;      // keys x queries: scores, then probabilities
  float* lanes = s_tile + 2 * kTile * kTile;  // kTile floats of per-query scalars
  float* extra = ws + tile_floats(hd);        // the product policy's packing area
  const float c = kLog2e / std::sqrt(static_cast<float>(hd));

  const auto qb = q + ((b * d.S + q0) * d.H + h) * hd;
  P::panel(qb, d.qstride(), nq, hd, c, qt_panel, extra);
  std::fill(o_panel, o_panel + hd * kTile, 0.0f);
  float ds_lanes[kTile];
  const int64_t kfirst = kDoc ? first_key_tile(d, b, q0, nq, ds_lanes) : 0;
  vf m[kNV], l[kNV], dsv[kNV];
  // With document masks a query lane may see a wholly masked key tile before its document
  // starts: a finite initial max keeps alpha = exp2(m - mnew) = 1 there instead of NaN.
  const float m0 = kDoc ? -1e30f : -std::numeric_limits<float>::infinity();
  for (int x = 0; x < kNV; ++x) {
    m[x] = vset1(m0);
    l[x] = vset1(0.0f);
    if constexpr (kDoc) dsv[x] = vload(ds_lanes + x * kLanes);
  }
  for (int64_t k0 = kfirst; k0 < q0 + nq; k0 += kTile) {  // key tiles past the last query: skipped
    const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
    const auto kb = k + ((b * d.S + k0) * d.G + g) * hd;
    const auto vb = v + ((b * d.S + k0) * d.G + g) * hd;
    // Only the diagonal tile (k0 == q0) has keys after queries: mask key > query there, and
    // skip the lane vectors of row j below j/16 (all masked) everywhere.
    const bool diag = k0 == q0;
    const Tri tri = diag ? kUpper : kFull;
    P::scores(kb, d.kstride(), nk, qt_panel, hd, c, s_tile, tri, extra);  // s_tile[j][i]
    vf mt[kNV];
    for (int x = 0; x < kNV; ++x) mt[x] = vset1(-std::numeric_limits<float>::infinity());
    by_row_groups(diag, nk, [&]<int V0, bool kDiag>(int j0, int j1) {
      max_rows<V0, kDiag, kDoc>(s_tile, j0, j1, k0, dsv, mt);
    });
    vf alpha[kNV], sum[kNV];
    for (int x = 0; x < kNV; ++x) {
      vf mnew = vmax(m[x], mt[x]);
      alpha[x] = vexp2(vsub(m[x], mnew));
      m[x] = mnew;
      sum[x] = vset1(0.0f);
    }
    by_row_groups(diag, nk, [&]<int V0, bool>(int j0, int j1) { exp_rows<V0>(s_tile, j0, j1, m, sum); });
    for (int x = 0; x < kNV; ++x) l[x] = vfma(l[x], alpha[x], sum[x]);
    P::accum(vb, d.kstride(), nk, s_tile, hd, o_panel, alpha, tri, extra);  // o^T = alpha o^T + v^T p
  }
  // lse = ln2 * (m + log2 l); o = o^T / l.
  float mv[kTile];
  for (int x = 0; x < kNV; ++x) {
    vstore(lanes + x * kLanes, l[x]);
    vstore(mv + x * kLanes, m[x]);
  }
  float* lse_row = lse + (b * d.H + h) * d.S + q0;
  for (int i = 0; i < nq; ++i) {
    lse_row[i] = kLn2 * (mv[i] + std::log2(lanes[i]));
    lanes[i] = 1.0f / lanes[i];
  }
  store_o_rows(o_panel, nq, hd, lanes, o + ((b * d.S + q0) * d.H + h) * hd, d.qstride(), o_rows);
}

// ------------------------------------------------------------------ backward
// Pass 1: dk and dv of key tile kt of kv head g, summed over the group's query heads in order;
// with ds_store (the pair's tiles), each tile's ds kept for pass 2.
template <class P, bool kDoc>
void backward_kv_tile(const Dims& d, typename P::Operand dout, typename P::Operand q, typename P::Operand k,
                      typename P::Operand v, const float* lse, const float* D, float* dk, float* dv,
                      int64_t b, int64_t g, int64_t kt, float* ds_store, float* ws) {
  const int hd = d.hd;
  const int64_t k0 = kt * kTile;
  const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
  float* kt_panel = ws;                    // hd x kTile: k^T * log2(e)/sqrt(hd)
  float* vt_panel = ws + hd * kTile;       // hd x kTile: v^T
  float* dk_panel = ws + 2 * hd * kTile;   // hd x kTile: dk^T / scale
  float* dv_panel = ws + 3 * hd * kTile;   // hd x kTile: dv^T
  float* p_tile = ws + 4 * hd * kTile;     // queries x keys: scores, then probabilities
  float* ds_tile = p_tile + kTile * kTile; // queries x keys: dp, then ds
  float* extra = ws + tile_floats(hd);     // the product policy's packing area
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd)), c = kLog2e * scale;

  const int64_t kvoff = ((b * d.S + k0) * d.G + g) * hd;
  P::panel(k + kvoff, d.kstride(), nk, hd, c, kt_panel, extra);
  P::panel(v + kvoff, d.kstride(), nk, hd, 1.0f, vt_panel, extra);
  std::fill(dk_panel, dk_panel + 2 * hd * kTile, 0.0f);  // dk and dv panels
  for (int64_t h = g * d.rep(); h < (g + 1) * d.rep(); ++h)
    for (int64_t q0 = k0; q0 < d.S; q0 += kTile) {  // query tiles before the keys: skipped
      const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
      const int64_t qoff = ((b * d.S + q0) * d.H + h) * hd;
      const float* lse_row = lse + (b * d.H + h) * d.S + q0;
      const float* D_row = D + (b * d.H + h) * d.S + q0;
      const int32_t* ds_row = kDoc ? d.doc + b * d.S + q0 : nullptr;
      if (kDoc && *std::min_element(ds_row, ds_row + nq) >= k0 + nk) continue;  // all before the documents
      // Only the diagonal tile (q0 == k0) has keys after queries (padding past S included):
      // mask there, and skip the lane vectors of row i above i/16 (all masked) everywhere.
      const bool diag = q0 == k0;
      const Tri tri = diag ? kLower : kFull;
      P::scores(q + qoff, d.qstride(), nq, kt_panel, hd, c, p_tile, tri, extra);         // s[i][j]
      P::scores(dout + qoff, d.qstride(), nq, vt_panel, hd, 1.0f, ds_tile, tri, extra);  // dp[i][j]
      for (int i = 0; i < nq; ++i) {
        const vf l2 = vset1(lse_row[i] * kLog2e), Di = vset1(D_row[i]);
        for (int x = 0; x < (diag ? i / kLanes + 1 : kNV); ++x) {
          float* ps = p_tile + i * kTile + x * kLanes;
          float* dps = ds_tile + i * kTile + x * kLanes;
          vf s = vload(ps);
          // key lane j is masked where k0 + x*16 + j > q0 + i
          if (diag) s = vmask_ge(s, static_cast<int>(q0 + i - k0 - x * kLanes + 1));
          // key lane j is masked where k0 + x*16 + j < doc_start of query q0 + i
          if constexpr (kDoc) s = vmask_lt(s, static_cast<int>(ds_row[i] - k0 - x * kLanes));
          vf p = vexp2(vsub(s, l2));
          vstore(ps, p);
          vstore(dps, vmul(p, vsub(vload(dps), Di)));
        }
      }
      if (ds_store)  // in the form pass 2's accumulation reads (the policy's keep_ds)
        P::keep_ds(ds_tile, nq, nk,
                   ds_store + static_cast<size_t>(h - g * d.rep()) * tile_pairs(d.tiles()) * kTile * kTile +
                       stored_tile(q0 / kTile, kt),
                   extra);
      P::accum(dout + qoff, d.qstride(), nq, p_tile, hd, dv_panel, nullptr, tri, extra);  // dv^T += dO^T p
      P::accum(q + qoff, d.qstride(), nq, ds_tile, hd, dk_panel, nullptr, tri, extra);    // dk^T += q^T ds
    }
  float mul[kTile];
  std::fill(mul, mul + kTile, scale);
  unpack_transposed(dk_panel, nk, hd, mul, dk + kvoff, d.kstride(), d.stream_grads());
  std::fill(mul, mul + kTile, 1.0f);
  unpack_transposed(dv_panel, nk, hd, mul, dv + kvoff, d.kstride(), d.stream_grads());
}

// Pass 2 from the store: dq of query tile qt of head h, summed over key tiles in order, from the
// head's tiles of ds (ds_head). Pass 1 wrote every tile read here: it skips a key tile only
// when every query's first key is past it, and so does first_key_tile.
template <class P, bool kDoc>
void backward_q_tile_stored(const Dims& d, typename P::Operand k, float* ds_head, float* dq, int64_t b,
                            int64_t h, int64_t qt, float* ws) {
  const int hd = d.hd;
  const int64_t g = h / d.rep(), q0 = qt * kTile;
  const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
  float* dq_panel = ws;                 // hd x kTile: dq^T / scale
  float* extra = ws + tile_floats(hd);  // the product policy's packing area
  std::fill(dq_panel, dq_panel + hd * kTile, 0.0f);
  float ds_lanes[kTile];
  const int64_t kfirst = kDoc ? first_key_tile(d, b, q0, nq, ds_lanes) : 0;
  for (int64_t k0 = kfirst; k0 < q0 + nq; k0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
    const Tri tri = k0 == q0 ? kUpper : kFull;  // as in the forward
    // RoundedProducts rounds the kept tile in place: this is its only reader.
    float* ds = ds_head + stored_tile(qt, k0 / kTile);
    P::accum_kept(k + ((b * d.S + k0) * d.G + g) * hd, d.kstride(), nk, ds, hd, dq_panel, tri, extra);
  }
  float mul[kTile];
  std::fill(mul, mul + kTile, 1.0f / std::sqrt(static_cast<float>(hd)));
  unpack_transposed(dq_panel, nq, hd, mul, dq + ((b * d.S + q0) * d.H + h) * hd, d.qstride(), d.stream_grads());
}

// Pass 2 recomputing: dq of query tile qt of head h, summed over key tiles in order.
template <class P, bool kDoc>
void backward_q_tile(const Dims& d, typename P::Operand dout, typename P::Operand q, typename P::Operand k,
                     typename P::Operand v, const float* lse, const float* D, float* dq, int64_t b,
                     int64_t h, int64_t qt, float* ws) {
  const int hd = d.hd;
  const int64_t g = h / d.rep(), q0 = qt * kTile;
  const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
  float* qt_panel = ws;                    // hd x kTile: q^T * log2(e)/sqrt(hd)
  float* dot_panel = ws + hd * kTile;      // hd x kTile: dO^T
  float* dq_panel = ws + 2 * hd * kTile;   // hd x kTile: dq^T / scale
  float* p_tile = ws + 4 * hd * kTile;     // keys x queries: scores, then probabilities
  float* ds_tile = p_tile + kTile * kTile; // keys x queries: dp, then ds
  float* lanes = ds_tile + kTile * kTile;  // lse*log2(e), then D, for each query
  float* extra = ws + tile_floats(hd);     // the product policy's packing area
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd)), c = kLog2e * scale;

  const int64_t qoff = ((b * d.S + q0) * d.H + h) * hd;
  P::panel(q + qoff, d.qstride(), nq, hd, c, qt_panel, extra);
  P::panel(dout + qoff, d.qstride(), nq, hd, 1.0f, dot_panel, extra);
  std::fill(dq_panel, dq_panel + hd * kTile, 0.0f);
  const float* lse_row = lse + (b * d.H + h) * d.S + q0;
  const float* D_row = D + (b * d.H + h) * d.S + q0;
  for (int i = 0; i < kTile; ++i) {
    lanes[i] = i < nq ? lse_row[i] * kLog2e : 0.0f;
    lanes[kTile + i] = i < nq ? D_row[i] : 0.0f;
  }
  float ds_lanes[kTile];
  const int64_t kfirst = kDoc ? first_key_tile(d, b, q0, nq, ds_lanes) : 0;
  vf l2[kNV], Dv[kNV], dsv[kNV];
  for (int x = 0; x < kNV; ++x) {
    l2[x] = vload(lanes + x * kLanes);
    Dv[x] = vload(lanes + kTile + x * kLanes);
    if constexpr (kDoc) dsv[x] = vload(ds_lanes + x * kLanes);
  }
  for (int64_t k0 = kfirst; k0 < q0 + nq; k0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
    const auto kb = k + ((b * d.S + k0) * d.G + g) * hd;
    const auto vb = v + ((b * d.S + k0) * d.G + g) * hd;
    const bool diag = k0 == q0;  // as in the forward
    const Tri tri = diag ? kUpper : kFull;
    P::scores(kb, d.kstride(), nk, qt_panel, hd, c, p_tile, tri, extra);       // s[j][i]
    P::scores(vb, d.kstride(), nk, dot_panel, hd, 1.0f, ds_tile, tri, extra);  // dp[j][i]
    for (int j = 0; j < nk; ++j)
      for (int x = diag ? j / kLanes : 0; x < kNV; ++x) {
        vf s = vload(p_tile + j * kTile + x * kLanes);
        if (diag) s = vmask_lt(s, static_cast<int>(k0 + j - q0 - x * kLanes));
        if constexpr (kDoc) s = vmask_doc(s, dsv[x], static_cast<float>(k0 + j));
        vf p = vexp2(vsub(s, l2[x]));
        float* dps = ds_tile + j * kTile + x * kLanes;
        vstore(dps, vmul(p, vsub(vload(dps), Dv[x])));
      }
    P::accum(kb, d.kstride(), nk, ds_tile, hd, dq_panel, nullptr, tri, extra);  // dq^T += k^T ds
  }
  float mul[kTile];
  std::fill(mul, mul + kTile, scale);
  unpack_transposed(dq_panel, nq, hd, mul, dq + qoff, d.qstride(), d.stream_grads());
}

#if defined(MOE_ATTENTION_BF16)
// Grow-only buffers on the calling thread for the tensors packed once per op (q, k, v, dO), in the
// forms the op reads: rows (the scores' broadcast operand and the panels) and pair rows (the
// accumulations' broadcast operand). A bf16 tensor's rows are the tensor itself, not a copy.
// With amx, the accumulations' form is the columns (attention_amx.h) instead of the pair rows: as
// many bytes where S is a multiple of 32 (plan/memory.cpp counts both).
struct Forms {
  bool rows, pairs;
};
Bf16Tensor pack_for_bf16(int slot, const Tensor& x, int64_t B, int64_t S, int64_t row, int64_t hd, Forms forms,
                         bool amx) {
  thread_local Buffer bufs[4];
  const bool own_rows = forms.rows && x.dtype != DType::kBF16;
  const int64_t sp = (S + 31) / 32 * 32;  // AMX columns: whole 32-position reduction steps
  const size_t n = static_cast<size_t>(B * S * row);
  const size_t accum_bytes = !forms.pairs ? 0
                             : amx        ? static_cast<size_t>(B * row * sp) * sizeof(uint16_t)
                                          : static_cast<size_t>(B * ((S + 1) / 2) * row) * sizeof(uint32_t);
  const size_t row_bytes = own_rows ? (n * sizeof(uint16_t) + 63) / 64 * 64 : 0;
  const size_t bytes = row_bytes + accum_bytes;
  Buffer& buf = bufs[slot];
  if (buf.bytes() < bytes) buf = Buffer(bytes);
  char* accum_form = static_cast<char*>(buf.data()) + row_bytes;
  uint16_t* rows = own_rows ? static_cast<uint16_t*>(buf.data()) : nullptr;
  uint32_t* pairs = forms.pairs && !amx ? reinterpret_cast<uint32_t*>(accum_form) : nullptr;
  uint16_t* cols = forms.pairs && amx ? reinterpret_cast<uint16_t*>(accum_form) : nullptr;
  Bf16Tensor t{rows, pairs, S, row, hd, cols, sp};
  if (x.dtype == DType::kBF16) {
    pack_bf16_tensor(x.as<bf16>(), B, S, row, hd, nullptr, pairs);
    if (cols) pack_bf16_cols(x.as<bf16>(), B, S, row, hd, sp, cols);
    t.rows = forms.rows ? reinterpret_cast<const uint16_t*>(x.as<bf16>()) : nullptr;
    return t;
  }
  pack_bf16_tensor(x.as<float>(), B, S, row, hd, rows, pairs);
  if (cols) pack_bf16_cols(x.as<float>(), B, S, row, hd, sp, cols);
  return t;
}
#endif

#if defined(MOE_ATTENTION_AMX)
// bf16 products on AMX tiles: where oneDNN's GEMMs run on them (gemm::amx_bf16; so
// ONEDNN_MAX_CPU_ISA turns both off), on whole tiles (attention_amx.h).
bool use_amx(const Dims& d) { return cpu::gemm::amx_bf16() && d.hd % 32 == 0 && d.S % 16 == 0; }
#endif

// Whether this call runs bf16 products: asked for and an even head dim (pairs: the AVX512-BF16
// kernels; without them RoundedProducts keeps the rule); otherwise fp32 products.
bool use_bf16(bool asked, int hd) { return asked && hd % 2 == 0; }

template <class P, class O>
void run_forward(const Dims& d, typename P::Operand q, typename P::Operand k, typename P::Operand v, O* o,
                 float* lse) {
  const int64_t nt = d.tiles(), bh = d.B * d.H;
#pragma omp parallel
  {
    float* ws = grow_only<Use::kScratch>(scratch_floats(d.hd));
    enter_products<P>();
    // Longest items (last query tiles) first; each item's result is independent of the schedule.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nt * bh; ++item) {
      const int64_t qt = nt - 1 - item / bh, r = item % bh;
      if (d.doc) forward_tile<P, true, O>(d, q, k, v, o, lse, r / d.H, r % d.H, qt, ws);
      else forward_tile<P, false, O>(d, q, k, v, o, lse, r / d.H, r % d.H, qt, ws);
    }
    leave_products<P>();
  }
}

// Passes 1 and 2 of the backward (D from pass 0), for as many (batch, kv head) pairs at a time as
// the store holds (all of them in one round when it holds none: pass 2 then recomputes).
template <class P>
void run_backward(const Dims& d, typename P::Operand dout, typename P::Operand q, typename P::Operand k,
                  typename P::Operand v, const float* lse, const float* D, float* dq, float* dk,
                  float* dv) {
  const int64_t nt = d.tiles(), pairs = d.B * d.G, rep = d.rep();
  const int64_t per_round = cpu_attention_store_pairs(d.B, d.H, d.G, d.S);
  const size_t pair_floats = static_cast<size_t>(rep * tile_pairs(nt)) * kTile * kTile;
  float* store = per_round > 0 ? grow_only<Use::kStore>(static_cast<size_t>(per_round) * pair_floats) : nullptr;
  for (int64_t p0 = 0; p0 < pairs; p0 += store ? per_round : pairs) {
    const int64_t np = store ? std::min(per_round, pairs - p0) : pairs;
#pragma omp parallel
    {
      float* ws = grow_only<Use::kScratch>(scratch_floats(d.hd));
      enter_products<P>();
      // Pass 1: dk, dv. Item (kt, pair); the first key tiles see the most query tiles: first.
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < nt * np; ++item) {
        const int64_t kt = item / np, u = item % np, b = (p0 + u) / d.G, g = (p0 + u) % d.G;
        float* ds = store ? store + static_cast<size_t>(u) * pair_floats : nullptr;
        if (d.doc) backward_kv_tile<P, true>(d, dout, q, k, v, lse, D, dk, dv, b, g, kt, ds, ws);
        else backward_kv_tile<P, false>(d, dout, q, k, v, lse, D, dk, dv, b, g, kt, ds, ws);
      }
      // Pass 2: dq. Item (qt, pair, head of its group); the last query tiles see the most key
      // tiles: first.
      const int64_t nh = np * rep;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < nt * nh; ++item) {
        const int64_t qt = nt - 1 - item / nh, r = item % nh, u = r / rep;
        const int64_t b = (p0 + u) / d.G, h = (p0 + u) % d.G * rep + r % rep;
        if (store) {
          float* ds = store + static_cast<size_t>(r) * (pair_floats / static_cast<size_t>(rep));
          if (d.doc) backward_q_tile_stored<P, true>(d, k, ds, dq, b, h, qt, ws);
          else backward_q_tile_stored<P, false>(d, k, ds, dq, b, h, qt, ws);
        } else if (d.doc) {
          backward_q_tile<P, true>(d, dout, q, k, v, lse, D, dq, b, h, qt, ws);
        } else {
          backward_q_tile<P, false>(d, dout, q, k, v, lse, D, dq, b, h, qt, ws);
        }
      }
      leave_products<P>();
    }
  }
}

}  // namespace

void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                   const Tensor& lse, const Tensor& doc_start, bool bf16_products) {
  Dims d = check_attention(q, k, v, "attention_fwd");
  d.doc = checked_doc_start(doc_start, d.B, d.S, "attention_fwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/false);
  check_attention_dtypes(q, o, lse, bf16_products, {}, "attention_fwd");
  // o: fp32, or bf16 (rounded) where bf16 mode saves it so.
  auto run = [&](auto* op) {
    float* lp = lse.as<float>();
#if defined(MOE_ATTENTION_BF16)
    if (use_bf16(bf16_products, d.hd)) {
      // The forward reads q and k as rows (q's panel, k in the scores), v as pair rows (or columns).
      const bool amx = use_amx(d);
      const Bf16Tensor tq = pack_for_bf16(0, q, d.B, d.S, d.qstride(), d.hd, {true, false}, amx),
                       tk = pack_for_bf16(1, k, d.B, d.S, d.kstride(), d.hd, {true, false}, amx),
                       tv = pack_for_bf16(2, v, d.B, d.S, d.kstride(), d.hd, {false, true}, amx);
      if (amx) run_forward<AmxProducts>(d, {&tq, 0}, {&tk, 0}, {&tv, 0}, op, lp);
      else run_forward<Bf16Products>(d, {&tq, 0}, {&tk, 0}, {&tv, 0}, op, lp);
      return;
    }
#else
    if (use_bf16(bf16_products, d.hd)) {
      run_forward<RoundedProducts>(d, f32_operand(0, q, true), f32_operand(1, k, true), f32_operand(2, v, true), op, lp);
      return;
    }
#endif
    // fp32 products (an odd head dim): bf16 q, k, v widened.
    run_forward<F32Products>(d, f32_operand(0, q, false), f32_operand(1, k, false), f32_operand(2, v, false), op, lp);
  };
  if (o.dtype == DType::kBF16) run(o.as<bf16>());
  else run(o.as<float>());
}

void attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& o, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                   const Tensor& dv, const Tensor& doc_start, bool bf16_products) {
  Dims d = check_attention(q, k, v, "attention_bwd");
  d.doc = checked_doc_start(doc_start, d.B, d.S, "attention_bwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/true);
  check_attention_gradients(d.B, d.S, d.H, d.G, d.hd, dout, dq, dk, dv);
  check_attention_dtypes(q, o, lse, bf16_products, {&dout, &dq, &dk, &dv}, "attention_bwd");
  const float *dop = dout.as<float>(), *lp = lse.as<float>();
  float *dqp = dq.as<float>(), *dkp = dk.as<float>(), *dvp = dv.as<float>();
  const int64_t hd = d.hd;
  float* D = grow_only<Use::kRowSums>(static_cast<size_t>(d.B * d.H * d.S));

  // Pass 0: D[b,h,s] = dO . O, each row summed in index order (o fp32, or bf16 as saved: its row
  // widened first, so both take the same compiled dot product). Rows (b, s, h) in memory order,
  // 16 at a time in the lanes of one vector (row_dots16), the rest one by one.
  const bool o16 = o.dtype == DType::kBF16;
  const int64_t rows = d.B * d.S * d.H, blocks = kRowDots ? rows / kRowDots : 0;
  auto d_index = [&](int64_t r) { return ((r / d.H / d.S) * d.H + r % d.H) * d.S + (r / d.H) % d.S; };
#pragma omp parallel
  {
    float wide[kMaxHd];  // one widened row (check_attention bounds hd)
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      float sums[kRowDots];
      const int64_t off = blk * kRowDots * hd;
      if (o16) row_dots16(dop + off, o.as<bf16>() + off, hd, sums);
      else row_dots16(dop + off, o.as<float>() + off, hd, sums);
      for (int64_t i = 0; i < kRowDots; ++i) D[d_index(blk * kRowDots + i)] = sums[i];
    }
#pragma omp for schedule(static)
    for (int64_t r = blocks * kRowDots; r < rows; ++r) {
      const int64_t off = r * hd;
      const float* c = o16 ? wide : o.as<float>() + off;
      if (o16)
        for (int64_t i = 0; i < hd; ++i) wide[i] = elem::load(o.as<bf16>()[off + i]);
      D[d_index(r)] = row_dot(dop + off, c, hd);
    }
  }

#if defined(MOE_ATTENTION_BF16)
  if (use_bf16(bf16_products, d.hd)) {
    // The backward reads dO, q and k in both forms (scores or panels, and accumulations), v as
    // rows only (its panel, and the recomputed dp).
    const bool amx = use_amx(d);
    const Bf16Tensor tdo = pack_for_bf16(0, dout, d.B, d.S, d.qstride(), d.hd, {true, true}, amx),
                     tq = pack_for_bf16(1, q, d.B, d.S, d.qstride(), d.hd, {true, true}, amx),
                     tk = pack_for_bf16(2, k, d.B, d.S, d.kstride(), d.hd, {true, true}, amx),
                     tv = pack_for_bf16(3, v, d.B, d.S, d.kstride(), d.hd, {true, false}, amx);
    if (amx) run_backward<AmxProducts>(d, {&tdo, 0}, {&tq, 0}, {&tk, 0}, {&tv, 0}, lp, D, dqp, dkp, dvp);
    else run_backward<Bf16Products>(d, {&tdo, 0}, {&tq, 0}, {&tk, 0}, {&tv, 0}, lp, D, dqp, dkp, dvp);
    return;
  }
#else
  if (use_bf16(bf16_products, d.hd)) {
    run_backward<RoundedProducts>(d, f32_operand(0, dout, true), f32_operand(1, q, true), f32_operand(2, k, true),
                                  f32_operand(3, v, true), lp, D, dqp, dkp, dvp);
    return;
  }
#endif
  run_backward<F32Products>(d, dop, f32_operand(1, q, false), f32_operand(2, k, false), f32_operand(3, v, false), lp, D,
                            dqp, dkp, dvp);
}

}  // namespace moe::cpu
