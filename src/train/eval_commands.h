// The bodies of `moecore eval` and `moecore generate` once a Trainer holds the model to use
// (e.g. after checkpoint::load_checkpoint). main.cpp only parses flags, builds the Trainer from
// the checkpoint's config, loads the checkpoint and calls these.
#pragma once

#include <iosfwd>
#include <string>

#include "train/evaluate.h"
#include "train/generate.h"
#include "train/trainer.h"

namespace moe {

// Validation loss and perplexity over data.valid_path of the trainer's config; batches <= 0:
// the whole validation set. Prints one line and returns the numbers.
EvalResult run_eval_command(Trainer& trainer, int64_t batches, std::ostream& out);

// Samples from a byte-level model (vocab_size 256): prints the prompt followed by the sample.
std::string run_generate_command(Trainer& trainer, const std::string& prompt, const GenerateOptions& options,
                                 std::ostream& out);

}  // namespace moe
