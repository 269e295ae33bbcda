// cuDNN's fused attention (the frontend's SDPA graphs) for attention with bf16 products: causal,
// grouped-query, scale 1/sqrt(hd), softmax statistics (our lse) from the forward, a deterministic
// backward unless train.deterministic_attention = false (then cuDNN's default: atomics for dQ, no
// dP workspace). Our (B,S,H,hd) layout is cuDNN's (b,h,s,d) with strides {S*H*hd, hd, H*hd, 1}.
// cuDNN's inputs and outputs are bf16: bf16 mode's saved q, k, v and o go in as they are, fp32
// ones (and dout) are rounded into bf16 copies, and dq, dk, dv (and an fp32 o) come back rounded
// to bf16 (op_list.inc allows that with bf16_products). One graph per shape and algorithm, built
// once; a shape cuDNN refuses is remembered and runs on our kernel (attention.cu).
#include "kernels/cuda/sdpa_cudnn.h"

// cuDNN and NVRTC are loaded at run time (the frontend's dynamic loading): moecore does not need
// them to start, and without them attention runs on our kernel.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdio>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda_memory.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's shim resolves every cuDNN call through it
}  // namespace cudnn_frontend

namespace moe::cuda {

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// x itself when it is bf16, else a bf16 copy carved at p (p moves past it, from a 256-byte
// boundary: cudnn_sdpa_buffer_bytes' layout), filled from x when it is an input.
Tensor bf16_operand(Context& ctx, const Tensor& x, bool input, char*& p) {
  if (x.dtype == DType::kBF16) return x;
  const int64_t n = x.numel();
  Tensor t(p, DType::kBF16, {n}, Device::kCuda);
  p += (n * 2 + 255) / 256 * 256;
  if (input) convert(ctx, x, t);
  return t;
}

std::vector<int64_t> strides_bshd(int64_t S, int64_t H, int64_t hd) { return {S * H * hd, hd, H * hd, 1}; }

}  // namespace

struct CudnnSdpa::Graph {
  std::shared_ptr<fe::graph::Graph> graph;
  bool ok = false;
  int64_t workspace = 0;
  // The variant pack, its keys inserted once: a call only assigns pointers (no allocation).
  std::unordered_map<int64_t, void*> pack;
};

std::unique_ptr<CudnnSdpa> CudnnSdpa::load(Allocator& device, cudaStream_t stream, std::string* why) {
  if (!fe::cudnn_dlhandle)
    for (const char* lib : {"libcudnn.so.9", "libcudnn.so"})
      if ((fe::cudnn_dlhandle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL))) break;
  if (!fe::cudnn_dlhandle) {
    if (why) *why = std::string("cannot load libcudnn.so.9: ") + dlerror();
    return nullptr;
  }
  // A library that loads but cannot make a handle (no usable GPU for it, a driver too old for
  // this cuDNN, a missing sub-library) falls back to our kernel as a failed load does.
  // (The frontend's shim throws when a symbol is missing from the library it loaded.)
  cudnnContext* handle = nullptr;
  try {
    cudnnStatus_t s = fe::detail::create_handle(&handle);
    if (s != CUDNN_STATUS_SUCCESS) {
      if (why) *why = std::string("cudnnCreate failed: ") + fe::detail::get_error_string(s);
      return nullptr;
    }
    s = fe::detail::set_stream(handle, stream);
    if (s != CUDNN_STATUS_SUCCESS) {
      fe::detail::destroy_handle(handle);
      if (why) *why = std::string("cudnnSetStream failed: ") + fe::detail::get_error_string(s);
      return nullptr;
    }
  } catch (const std::exception& e) {
    if (handle) fe::detail::destroy_handle(handle);
    if (why) *why = std::string("cuDNN: ") + e.what();
    return nullptr;
  }
  return std::unique_ptr<CudnnSdpa>(new CudnnSdpa(device, handle));
}

CudnnSdpa::CudnnSdpa(Allocator& device, cudnnContext* handle) : device_(device), handle_(handle) {}

CudnnSdpa::~CudnnSdpa() {
  graphs_.clear();
  if (buffer_) device_.deallocate(buffer_, buffer_bytes_);
  if (handle_) fe::detail::destroy_handle(handle_);
}

void* CudnnSdpa::buffer(size_t bytes) {
  if (bytes <= buffer_bytes_) return buffer_;
  // Grows on the first call of a larger shape (the first training step), never in later steps.
  if (buffer_) device_.deallocate(buffer_, buffer_bytes_);
  const AllocationScope scope("cuDNN attention's bf16 operands and workspace");
  buffer_ = device_.allocate(bytes);
  buffer_bytes_ = bytes;
  return buffer_;
}

CudnnSdpa::Graph& CudnnSdpa::graph(bool backward, int64_t B, int64_t S, int64_t H, int64_t G, int64_t hd) {
  const Key key{backward, backward && deterministic_, B, S, H, G, hd};
  auto it = graphs_.find(key);
  if (it != graphs_.end()) return *it->second;
  auto g = std::make_unique<Graph>();
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto tensor = [&](const char* name, int64_t uid, int64_t heads) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({B, heads, S, hd})
                             .set_stride(strides_bshd(S, heads, hd)));
  };
  auto q = tensor("Q", kQ, H), k = tensor("K", kK, G), v = tensor("V", kV, G);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (!backward) {
    auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
    auto [o, stats] = graph->sdpa(q, k, v, attrs);
    o->set_output(true).set_uid(kO).set_dim({B, H, S, hd}).set_stride(strides_bshd(S, H, hd));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({B, H, S, 1}).set_stride({H * S, S, 1, 1});
  } else {
    auto o = tensor("O", kO, H), dout = tensor("dO", kDO, H);
    auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                   .set_name("Stats")
                                   .set_uid(kStats)
                                   .set_dim({B, H, S, 1})
                                   .set_stride({H * S, S, 1, 1})
                                   .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes()
                     .set_name("sdpa_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(scale)
                     .set_deterministic_algorithm(deterministic_);
    auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, dout, stats, attrs);
    dq->set_output(true).set_uid(kDQ).set_dim({B, H, S, hd}).set_stride(strides_bshd(S, H, hd));
    dk->set_output(true).set_uid(kDK).set_dim({B, G, S, hd}).set_stride(strides_bshd(S, G, hd));
    dv->set_output(true).set_uid(kDV).set_dim({B, G, S, hd}).set_stride(strides_bshd(S, G, hd));
  }
  fe::error_t built = graph->build(handle_, {fe::HeurMode_t::A});
  if (built.is_good()) {
    g->ok = graph->get_workspace_size(g->workspace).is_good();
    g->graph = graph;
  }
  if (!g->ok)
    std::fprintf(stderr, "moecore: cuDNN SDPA %s unavailable for B=%lld S=%lld H=%lld G=%lld hd=%lld (%s): using our kernel\n",
                 backward ? "backward" : "forward", static_cast<long long>(B), static_cast<long long>(S),
                 static_cast<long long>(H), static_cast<long long>(G), static_cast<long long>(hd),
                 built.is_good() ? "no workspace size" : built.get_message().c_str());
  return *graphs_.emplace(key, std::move(g)).first->second;
}

bool CudnnSdpa::forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse) {
  const int64_t B = q.dim(0), S = q.dim(1), H = q.dim(2), G = k.dim(2), hd = q.dim(3);
  Graph& g = graph(false, B, S, H, G, hd);
  if (!g.ok) return false;
  const bool stored = q.dtype == DType::kBF16;  // bf16 mode's saved q, k, v and o: no copies
  if (stored != (o.dtype == DType::kBF16)) return false;
  const int64_t nq = B * S * H * hd, nk = B * S * G * hd;
  char* p = static_cast<char*>(buffer(cudnn_sdpa_buffer_bytes(false, stored, nq, nk, g.workspace)));
  const Tensor qb = bf16_operand(ctx, q, true, p), kb = bf16_operand(ctx, k, true, p), vb = bf16_operand(ctx, v, true, p),
               ob = bf16_operand(ctx, o, false, p);
  for (const auto& [uid, ptr] : {std::pair<int64_t, void*>{kQ, qb.data}, {kK, kb.data}, {kV, vb.data}, {kO, ob.data},
                                 {kStats, lse.data}})
    g.pack[uid] = ptr;
  MOE_CHECK(g.graph->execute(handle_, g.pack, p).is_good(), "cuDNN SDPA forward failed to execute");
  if (ob.data != o.data) convert(ctx, ob, o);
  return true;
}

bool CudnnSdpa::backward(Context& ctx, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                         const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const int64_t B = q.dim(0), S = q.dim(1), H = q.dim(2), G = k.dim(2), hd = q.dim(3);
  Graph& g = graph(true, B, S, H, G, hd);
  if (!g.ok) return false;
  const bool stored = q.dtype == DType::kBF16;  // bf16 mode's saved q, k, v and o: no copies
  if (stored != (o.dtype == DType::kBF16)) return false;
  const int64_t nq = B * S * H * hd, nk = B * S * G * hd;
  char* p = static_cast<char*>(buffer(cudnn_sdpa_buffer_bytes(true, stored, nq, nk, g.workspace)));
  const Tensor qb = bf16_operand(ctx, q, true, p), ob = bf16_operand(ctx, o, true, p),
               db = bf16_operand(ctx, dout, true, p), dqb = bf16_operand(ctx, dq, false, p);
  const Tensor kb = bf16_operand(ctx, k, true, p), vb = bf16_operand(ctx, v, true, p),
               dkb = bf16_operand(ctx, dk, false, p), dvb = bf16_operand(ctx, dv, false, p);
  for (const auto& [uid, ptr] : {std::pair<int64_t, void*>{kQ, qb.data}, {kK, kb.data}, {kV, vb.data}, {kO, ob.data},
                                 {kDO, db.data}, {kStats, lse.data}, {kDQ, dqb.data}, {kDK, dkb.data}, {kDV, dvb.data}})
    g.pack[uid] = ptr;
  MOE_CHECK(g.graph->execute(handle_, g.pack, p).is_good(), "cuDNN SDPA backward failed to execute");
  convert(ctx, dqb, dq);
  convert(ctx, dkb, dk);
  convert(ctx, dvb, dv);
  return true;
}

}  // namespace moe::cuda
