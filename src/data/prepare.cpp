#include "data/prepare.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "core/check.h"

namespace moe {

PrepareResult prepare_text(const std::string& input_path, const std::string& out_dir, int64_t block,
                           int64_t valid_every) {
  std::ifstream in(input_path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open input text '", input_path, "'");
  std::vector<unsigned char> text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MOE_CHECK(text.size() >= 2, "input text '", input_path, "' is empty");
  std::filesystem::create_directories(out_dir);

  PrepareResult r;
  std::vector<uint16_t> train, valid;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool is_valid = (static_cast<int64_t>(i) / block) % valid_every == valid_every - 1;
    (is_valid ? valid : train).push_back(text[i]);
  }
  auto write = [&](const std::string& name, const std::vector<uint16_t>& tokens) {
    const std::string path = out_dir + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
    MOE_CHECK(out.good(), "cannot write '", path, "'");
  };
  write("train.bin", train);
  write("valid.bin", valid);
  r.train_tokens = static_cast<int64_t>(train.size());
  r.valid_tokens = static_cast<int64_t>(valid.size());

  // Empirical conditional entropy H(X_t | X_{t-1}) = -sum p(a,b) log p(b|a): the loss of the best
  // possible bigram model fitted to this very text.
  std::vector<double> pair(256 * 256, 0.0), first(256, 0.0), uni(256, 0.0);
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    pair[text[i] * 256u + text[i + 1]] += 1;
    first[text[i]] += 1;
  }
  for (unsigned char c : text) uni[c] += 1;
  const double n = static_cast<double>(text.size() - 1);
  for (int a = 0; a < 256; ++a)
    for (int b = 0; b < 256; ++b) {
      const double c = pair[static_cast<size_t>(a * 256 + b)];
      if (c > 0) r.bigram_entropy_nats -= c / n * std::log(c / first[static_cast<size_t>(a)]);
    }
  for (double c : uni)
    if (c > 0) r.unigram_entropy_nats -= c / static_cast<double>(text.size()) * std::log(c / static_cast<double>(text.size()));
  std::ofstream meta(out_dir + "/bigram_entropy.txt");
  meta << r.bigram_entropy_nats << "\n";
  return r;
}

}  // namespace moe
