// Dense GEMMs on cuBLASLt: linear_fwd, linear_bwd_data, linear_bwd_weight (kernels/op_list.inc).
// bf16 operands multiply with fp32 accumulation into fp32 outputs; fp32 operands use fp32 compute
// (CUBLAS_COMPUTE_32F: no TF32), the parity path. "+=" is beta = 1. Our row-major (M,N) matrix is
// cuBLAS's column-major (N,M), so y = x w^T is Y^T = W^T-op applied to X in column-major terms.
// One algorithm per shape, chosen once by the heuristic with a fixed workspace and no split-K
// reduction scheme, then cached: the result never depends on the workspace or on a later query,
// so a run is bitwise repeatable.
#include "kernels/cuda/gemm_lt.h"

#include <cublasLt.h>

#include <vector>

#include "core/dynamic_library.h"
#include "kernels/cuda/alignment.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/checks/gemm_checks.h"

namespace moe::cuda {
namespace {

// cuBLASLt is loaded at run time (core/dynamic_library.h): calls go through this table.
#define MOE_LT_FUNCTIONS(X) X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtMatmul) X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute) X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)
struct LtApi {
#define MOE_DECLARE(f) decltype(&::f) f = nullptr;
  MOE_LT_FUNCTIONS(MOE_DECLARE)
#undef MOE_DECLARE
};
const LtApi& lt() {
  static const LtApi api = [] {
    void* h = open_library({"libcublasLt.so.13", "libcublasLt.so"}, "cuBLASLt");
    LtApi a;
#define MOE_RESOLVE(f) a.f = reinterpret_cast<decltype(a.f)>(library_symbol(h, #f, "cuBLASLt"));
    MOE_LT_FUNCTIONS(MOE_RESOLVE)
#undef MOE_RESOLVE
    return a;
  }();
  return api;
}

// cuBLASLt alone (without libcublas) has no status strings.
const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS status";
  }
}

void check_lt(cublasStatus_t s, const char* what) {
  MOE_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", what, " failed: ", status_name(s), " (", static_cast<int>(s), ")");
}

// The operands' alignments, not cuBLASLt's default assumption of 256 bytes (C is also D).
void set_alignments(cublasLtMatmulPreference_t pref, uint32_t a, uint32_t b, uint32_t c) {
  for (const auto& [attr, bytes] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c},
                                    std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c}})
    check_lt(lt().cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof bytes), "minimum alignment");
}

}  // namespace

struct GemmLt::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

GemmLt::GemmLt(void* workspace, size_t workspace_bytes) : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  check_lt(lt().cublasLtCreate(&handle_), "cublasLtCreate");
}

GemmLt::~GemmLt() {
  for (auto& [key, plan] : plans_) {
    lt().cublasLtMatrixLayoutDestroy(plan->a);
    lt().cublasLtMatrixLayoutDestroy(plan->b);
    lt().cublasLtMatrixLayoutDestroy(plan->c);
    lt().cublasLtMatmulDescDestroy(plan->desc);
  }
  if (handle_) lt().cublasLtDestroy(handle_);
}

size_t GemmLt::KeyHash::operator()(const Key& k) const {
  size_t h = static_cast<size_t>(k.bf16) * 31 + static_cast<size_t>(k.transa) * 7 + static_cast<size_t>(k.transb);
  for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc, int64_t{k.align_a}, int64_t{k.align_b}, int64_t{k.align_c}})
    h = h * 1000003u ^ static_cast<size_t>(v);
  return h;
}

const GemmLt::Plan& GemmLt::plan(const Key& key, const char* op) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  const cudaDataType_t in = key.bf16 ? CUDA_R_16BF : CUDA_R_32F;
  check_lt(lt().cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t ta = key.transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(lt().cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa");
  check_lt(lt().cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb");
  // Stored shapes (column-major): A is (m,k) or its transpose (k,m); B is (k,n) or (n,k).
  const uint64_t a_rows = static_cast<uint64_t>(key.transa ? key.k : key.m), a_cols = static_cast<uint64_t>(key.transa ? key.m : key.k);
  const uint64_t b_rows = static_cast<uint64_t>(key.transb ? key.n : key.k), b_cols = static_cast<uint64_t>(key.transb ? key.k : key.n);
  check_lt(lt().cublasLtMatrixLayoutCreate(&p->a, in, a_rows, a_cols, key.lda), "layout A");
  check_lt(lt().cublasLtMatrixLayoutCreate(&p->b, in, b_rows, b_cols, key.ldb), "layout B");
  check_lt(lt().cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, static_cast<uint64_t>(key.m), static_cast<uint64_t>(key.n), key.ldc),
           "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(lt().cublasLtMatmulPreferenceCreate(&pref), "preference");
  const uint64_t ws = workspace_bytes_;
  const uint32_t no_split_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  check_lt(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), "workspace");
  check_lt(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split_reduction,
                                                sizeof no_split_reduction),
           "reduction scheme");
  set_alignments(pref, key.align_a, key.align_b, key.align_c);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s = lt().cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  lt().cublasLtMatmulPreferenceDestroy(pref);
  check_lt(s, "algorithm heuristic");
  MOE_CHECK(found > 0, op, ": cuBLASLt has no algorithm for ", key.bf16 ? "bf16" : "f32", " m=", key.m, " n=", key.n,
            " k=", key.k);
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void GemmLt::run(cudaStream_t stream, const char* op, bool bf16, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                 const void* A, int64_t lda, const void* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  if (k == 0) {  // an empty sum: C = beta * C (cuBLASLt's k = 0 case is left to us)
    if (!accumulate) MOE_CUDA_CHECK(cudaMemset2DAsync(C, static_cast<size_t>(ldc) * 4, 0, static_cast<size_t>(m) * 4,
                                                      static_cast<size_t>(n), stream));
    return;
  }
  const Key key{bf16, transa, transb, m, n, k, lda, ldb, ldc, pointer_alignment(A), pointer_alignment(B), pointer_alignment(C)};
  const Plan& p = plan(key, op);
  check_lt(lt().cublasLtMatmul(handle_, p.desc, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &p.algo, workspace_,
                          workspace_bytes_, stream),
           op);
}

double GemmLt::best_algorithm_seconds(cudaStream_t stream, bool bf16, bool transa, bool transb, int64_t m, int64_t n,
                                      int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb, float* C,
                                      int64_t ldc, int candidates, int reps) {
  const Key key{bf16, transa, transb, m, n, k, lda, ldb, ldc, pointer_alignment(A), pointer_alignment(B), pointer_alignment(C)};
  const Plan& p = plan(key, "best_algorithm_seconds");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(lt().cublasLtMatmulPreferenceCreate(&pref), "preference");
  const uint64_t ws = workspace_bytes_;
  check_lt(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), "workspace");
  set_alignments(pref, key.align_a, key.align_b, key.align_c);
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(candidates));
  int found = 0;
  check_lt(lt().cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, candidates, results.data(), &found),
           "algorithm heuristic");
  lt().cublasLtMatmulPreferenceDestroy(pref);
  cudaEvent_t t0, t1;
  MOE_CUDA_CHECK(cudaEventCreate(&t0));
  MOE_CUDA_CHECK(cudaEventCreate(&t1));
  const float alpha = 1.0f, beta = 0.0f;
  double best = 0;
  for (int i = 0; i < found; ++i) {
    auto run = [&] {
      return lt().cublasLtMatmul(handle_, p.desc, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &results[static_cast<size_t>(i)].algo,
                            workspace_, workspace_bytes_, stream);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;
    MOE_CUDA_CHECK(cudaEventRecord(t0, stream));
    for (int r = 0; r < reps; ++r) check_lt(run(), "benchmark matmul");
    MOE_CUDA_CHECK(cudaEventRecord(t1, stream));
    MOE_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    const double s = ms * 1e-3 / reps;
    if (best == 0 || s < best) best = s;
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return best;
}

namespace {

void check_operands(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  check_device({&a, &b, &out}, op);
  MOE_CHECK(a.dtype == DType::kF32 || a.dtype == DType::kBF16, op, ": operands must be f32 or bf16 on cuda, got ",
            dtype_name(a.dtype));
  check_gemm_dtypes(a, b, out, op);
}

}  // namespace

// y(M,N) = x(M,K) w(N,K)^T. Column-major: Y(N,M) = W^T(N,K) X(K,M), W stored (K,N) ld K.
void linear_fwd(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate) {
  check_operands(x, w, y, "linear_fwd");
  const GemmDims d = linear_fwd_dims(x, w, y);
  ctx.gemm->run(ctx.stream, "linear_fwd", x.dtype == DType::kBF16, true, false, d.n, d.m, d.k, w.data, d.k, x.data, d.k,
                static_cast<float*>(y.data), d.n, accumulate);
}

// dx(M,K) = dy(M,N) w(N,K). Column-major: DX(K,M) = W(K,N) DY(N,M).
void linear_bwd_data(Context& ctx, const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate) {
  check_operands(dy, w, dx, "linear_bwd_data");
  const GemmDims d = linear_bwd_data_dims(dy, w, dx);
  ctx.gemm->run(ctx.stream, "linear_bwd_data", dy.dtype == DType::kBF16, false, false, d.k, d.m, d.n, w.data, d.k, dy.data,
                d.n, static_cast<float*>(dx.data), d.k, accumulate);
}

// dw(N,K) (+)= dy(M,N)^T x(M,K). Column-major: DW(K,N) (+)= X(K,M) DY^T(M,N).
void linear_bwd_weight(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate) {
  check_operands(dy, x, dw, "linear_bwd_weight");
  const GemmDims d = linear_bwd_weight_dims(dy, x, dw);
  ctx.gemm->run(ctx.stream, "linear_bwd_weight", dy.dtype == DType::kBF16, false, true, d.k, d.n, d.m, x.data, d.k, dy.data,
                d.n, static_cast<float*>(dw.data), d.k, accumulate);
}

}  // namespace moe::cuda
