// `moecore prepare`: plain text -> byte-level token files (uint16, ids 0..255), with a held-out
// validation slice, and the text's bigram conditional entropy as the bar a model must beat.
#pragma once

#include <string>

namespace moe {

struct PrepareResult {
  int64_t train_tokens = 0, valid_tokens = 0;
  double bigram_entropy_nats = 0;  // H(x_t | x_{t-1}) of the whole text, per token
  double unigram_entropy_nats = 0;
};

// Every `valid_every`-th block of `block` bytes goes to validation.
PrepareResult prepare_text(const std::string& input_path, const std::string& out_dir,
                           int64_t block = 16384, int64_t valid_every = 20);

}  // namespace moe
