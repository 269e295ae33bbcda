#include "train/eval_commands.h"

#include <iomanip>
#include <limits>
#include <ostream>

#include "core/check.h"
#include "data/token_file.h"

namespace moe {

EvalResult run_eval_command(Trainer& trainer, int64_t batches, std::ostream& out) {
  const Config& c = trainer.config();
  MOE_CHECK(!split_paths(c.data.valid_path).empty(), "eval needs data.valid_path (the checkpoint's config has none; "
            "pass --set data.valid_path=FILE)");
  TokenDataset valid(split_paths(c.data.valid_path), c.data.token_dtype, c.model.vocab_size, c.train.seq_len,
                     "data.valid_path", c.model.pad_id);
  const EvalResult r = evaluate(trainer.model(), valid, c.train.micro_batch_size, batches);
  // Every digit of the doubles (they round-trip): runs are compared on these numbers.
  out << std::setprecision(std::numeric_limits<double>::max_digits10) << "validation loss " << r.loss
      << " nats/token, perplexity " << r.perplexity << std::setprecision(6) << " (" << r.tokens << " tokens of "
      << c.data.valid_path << ")\n";
  return r;
}

std::string run_generate_command(Trainer& trainer, const std::string& prompt, const GenerateOptions& options,
                                  std::ostream& out) {
  const Config& c = trainer.config();
  MOE_CHECK(c.model.vocab_size == 256, "generate prints bytes: it needs a byte-level model (vocab_size 256), got ",
            c.model.vocab_size);
  MOE_CHECK(!prompt.empty(), "generate needs a non-empty prompt");
  const std::string text =
      ids_to_bytes(generate(trainer.model(), c.train.micro_batch_size, c.train.seq_len, bytes_to_ids(prompt), options));
  out << prompt << text << "\n";
  return text;
}

}  // namespace moe
