#include "data/prepare.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "core/check.h"
#include "core/user_path.h"

namespace moe {

PrepareResult prepare_text(const std::string& input_path, const std::string& out_dir, int64_t block,
                           int64_t valid_every) {
  MOE_CHECK(block >= 1 && valid_every >= 2, "prepare: block >= 1 and valid_every >= 2");
  const std::string bytes = read_input_file(input_path, "prepare --input");
  const std::vector<unsigned char> text(bytes.begin(), bytes.end());
  MOE_CHECK(text.size() >= 2, "prepare --input '", input_path, "' holds ", text.size(),
            " byte(s): too short for a token and its label");
  std::filesystem::create_directories(out_dir);

  PrepareResult r;
  const int64_t n_bytes = static_cast<int64_t>(text.size());
  // Short texts: smaller blocks, so the last of valid_every blocks still exists.
  r.block = std::min(block, n_bytes / valid_every);
  std::vector<uint16_t> train, valid;
  for (int64_t i = 0; i < n_bytes; ++i) {
    const bool is_valid = r.block >= 2 && (i / r.block) % valid_every == valid_every - 1;
    (is_valid ? valid : train).push_back(text[static_cast<size_t>(i)]);
  }
  constexpr int64_t kDefaultSeqLen = 256;
  if (valid.empty()) {
    r.warnings.push_back("no validation slice: the text has " + std::to_string(n_bytes) + " bytes, fewer than " +
                         std::to_string(2 * valid_every) + " (1/" + std::to_string(valid_every) +
                         " of it must hold 2 tokens); no valid.bin was written, so training runs without validation");
  } else if (static_cast<int64_t>(valid.size()) <= kDefaultSeqLen) {
    r.warnings.push_back("the validation slice holds " + std::to_string(valid.size()) +
                         " tokens, not enough for one instance of the default train.seq_len = 256 (+1 label): train "
                         "with train.seq_len below " + std::to_string(valid.size()) + ", or give more text");
  }
  auto write = [&](const std::string& name, const std::vector<uint16_t>& tokens) {
    const std::string path = out_dir + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
    MOE_CHECK(out.good(), "cannot write '", path, "'");
  };
  write("train.bin", train);
  const std::string valid_path = out_dir + "/valid.bin";
  if (!valid.empty()) write("valid.bin", valid);
  else std::filesystem::remove(valid_path);  // never leave an earlier text's slice behind
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
