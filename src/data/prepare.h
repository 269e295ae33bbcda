// `moecore prepare`: plain text -> byte-level token files (uint16, ids 0..255), with a held-out
// validation slice, and the text's bigram conditional entropy as the bar a model must beat.
#pragma once

#include <string>
#include <vector>

namespace moe {

struct PrepareResult {
  int64_t train_tokens = 0, valid_tokens = 0;
  int64_t block = 0;               // bytes per block actually used (shrunk for short texts)
  double bigram_entropy_nats = 0;  // H(x_t | x_{t-1}) of the whole text, per token
  double unigram_entropy_nats = 0;
  std::vector<std::string> warnings;  // a validation slice too short (or none), said plainly
};

// Every `valid_every`-th block of `block` bytes goes to validation (1/valid_every of the text).
// A text shorter than valid_every blocks gets blocks of text_bytes / valid_every bytes, so it
// still holds out its last block; a text too short for a slice of 2 tokens writes no valid.bin
// (training then has no validation) and says so. A slice shorter than one instance of
// train.seq_len 256 (the default) is written with a warning.
PrepareResult prepare_text(const std::string& input_path, const std::string& out_dir,
                           int64_t block = 16384, int64_t valid_every = 20);

}  // namespace moe
