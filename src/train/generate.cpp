#include "train/generate.h"
#include "kernels/host_view.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/buffer.h"
#include "core/check.h"
#include "core/rng.h"

namespace moe {

namespace {
constexpr uint64_t kSampleStream = 4;  // RngStream values 1-3 are taken; draws for sampling
}

int32_t sample_token(const std::vector<double>& logits, double temperature, int64_t top_k, double u) {
  const int64_t V = static_cast<int64_t>(logits.size());
  MOE_CHECK(V > 0, "sample_token: empty logits");
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
  });
  if (temperature <= 0) return order[0];
  const int64_t k = top_k > 0 ? std::min(top_k, V) : V;
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[static_cast<size_t>(order[0])];
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    p[static_cast<size_t>(i)] = std::exp((logits[static_cast<size_t>(order[static_cast<size_t>(i)])] - top) / temperature);
    total += p[static_cast<size_t>(i)];
  }
  double acc = 0;
  const double target = u * total;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[static_cast<size_t>(i)];
    if (target < acc) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(k - 1)];
}

std::vector<int32_t> generate(Transformer& model, int64_t batch, int64_t seq_len,
                              const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  const int64_t V = model.config().vocab_size;
  MOE_CHECK(!prompt.empty(), "generate: the prompt is empty");
  for (int32_t t : prompt) MOE_CHECK(t >= 0 && t < V, "generate: prompt token ", t, " is outside [0, ", V, ")");
  MOE_CHECK(o.temperature >= 0 && std::isfinite(o.temperature), "generate: temperature must be >= 0");
  MOE_CHECK(o.top_k >= 0, "generate: top_k must be >= 0");
  Backend& ops = model.ops();
  OwnedTensor ids(ops, DType::kI32, {batch, seq_len});
  OwnedTensor logits(ops, model.compute_dtype(), {batch * seq_len, V});
  std::vector<int32_t> host_ids(static_cast<size_t>(batch * seq_len));
  std::vector<int32_t> context = prompt, out;
  std::vector<double> row(static_cast<size_t>(V));
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(context.size()), seq_len);
    const int32_t* src = context.data() + context.size() - static_cast<size_t>(len);
    std::fill(host_ids.begin(), host_ids.end(), 0);
    std::copy(src, src + len, host_ids.begin());
    ops.upload(host_ids.data(), ids.t);
    model.forward_logits(ids, logits);
    const int64_t pos = len - 1;
    const HostView logits_row(ops, logits.t.slice(pos, pos + 1));
    for (int64_t v = 0; v < V; ++v)
      row[static_cast<size_t>(v)] = logits.t.dtype == DType::kF64 ? logits_row.as<double>()[v] : logits_row.as<float>()[v];
    const double u = random_uniform(o.seed, kSampleStream, static_cast<uint64_t>(n));
    const int32_t next = sample_token(row, o.temperature, o.top_k, u);
    context.push_back(next);
    out.push_back(next);
  }
  return out;
}

std::vector<int32_t> bytes_to_ids(const std::string& text) {
  std::vector<int32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ids_to_bytes(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t t : ids) s.push_back(static_cast<char>(static_cast<unsigned char>(t & 0xff)));
  return s;
}

}  // namespace moe
