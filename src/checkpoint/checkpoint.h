// Checkpoints: everything a run needs to continue bit for bit, written atomically and verified on
// load.
//
// Layout (one directory per checkpoint, inside the checkpoint dir):
//   step_00000120/
//     manifest.json              format, step, data position, optimizer step count, resolved config
//                                (TOML), parameter layout (names, shapes, global offsets), and
//                                per shard file: byte size, CRC-32C of the file and of each tensor
//     rank_00000.safetensors     this rank's slice [begin, end) of the flat parameter, Adam m and
//                                Adam v buffers (tensors "params", "exp_avg", "exp_avg_sq"), plus
//                                the loss-free router biases ("router_bias.<moe layer>", rank 0)
// The manifest records each slice's global element range, so a checkpoint written by W ranks
// loads into any other layout (today W = 1; tests write W = 3 to check the reassembly).
//
// Atomicity: the save writes into ".tmp.step_NNNNNNNN.<pid>" in the same parent, fsyncs every
// file and the temp directory, renames it to step_NNNNNNNN, fsyncs the parent, and only then
// prunes older checkpoints (each renamed to ".trash.*" before removal, so a half-deleted one never
// looks complete). A crash at any moment leaves the previous complete checkpoint loadable; names
// starting with '.' are never considered complete.
//
// Deterministic crash points for tests: MOE_CRASH_AT=after_tensor:N | before_manifest |
// before_rename | before_dir_fsync | before_prune | during_prune makes the save _exit(77) there.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "config/config.h"

namespace moe {

class Transformer;
class AdamW;
struct ProcessGroups;

// What a checkpoint saves and restores: views of a run's parts. A Trainer converts to one
// (train/trainer.h), so this folder depends on the model, optimizer and groups, not the trainer.
struct TrainingState {
  const Config& config;
  Transformer& model;
  AdamW& optimizer;
  ProcessGroups* groups = nullptr;  // nullptr: one process
  int64_t steps_taken() const;      // the optimizer's step count
};

// CRC-32C (Castagnoli), the checksum of every tensor, file and manifest.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// The data position is a pure function of the step between resumes and batch-size changes:
// next_instance = anchor.next_instance + (step - anchor.step) * batch_size. The manifest records
// the anchor (the step and position of the last resume; (0, 0) for a run never resumed), and
// verification refuses a position that disagrees with it, naming the file and field.
struct DataAnchor {
  int64_t step = 0, next_instance = 0;
};

struct CheckpointInfo {
  std::string path;
  int64_t step = 0;           // optimizer steps taken
  int64_t next_instance = 0;  // data position: the next global training instance
  int64_t batch_size = 0;     // train.batch_size of the run that wrote it
  DataAnchor anchor;
  double elapsed_s = 0;       // training seconds up to this checkpoint, stitched across resumes
  std::string config_toml;    // the resolved config of the run that wrote it
  // Differences between the checkpoint's config and the loading one that keep shapes but change
  // the continuation (learning rate, batch size, seed...): resuming is allowed, not bit-exact.
  std::vector<std::string> warnings;
};

struct SaveOptions {
  int64_t keep_last = 3;   // complete checkpoints kept after this save (>= 1)
  int64_t num_shards = 1;  // rank files to write (the distributed runtime writes one per rank)
  DataAnchor anchor;       // the run's last resume (or (0, 0)); next_instance must agree with it
  double elapsed_s = 0;    // training seconds so far (recorded; a resume continues from it)
};

std::string checkpoint_name(int64_t step);  // "step_00000120"

// Saves the run's state as <dir>/step_NNNNNNNN; returns that path.
std::string save_checkpoint(const std::string& dir, const TrainingState& run, int64_t next_instance,
                            const SaveOptions& options = {});

// Complete checkpoints (step_* directories holding a manifest), oldest first; temp dirs skipped.
std::vector<std::string> list_checkpoints(const std::string& dir);
std::string latest_checkpoint(const std::string& dir);  // "" when there is none

// Reads the manifest and every file, checks sizes and checksums; loads nothing.
CheckpointInfo verify_checkpoint(const std::string& path);
// Verifies, then loads parameters, Adam moments, step count and router biases into the run.
// Refuses a checkpoint whose model shape or optimizer dtype differ (naming the key).
CheckpointInfo load_checkpoint(const std::string& path, const TrainingState& run);
// Loads the newest checkpoint in dir that verifies; a newer one that fails is reported on log
// (with the reason) and the next older one is tried. Throws when none loads.
CheckpointInfo resume_latest(const std::string& dir, const TrainingState& run, std::ostream& log);

// 64-bit FNV-1a over parameters, Adam m and v, router biases and the step count.
uint64_t training_state_hash(const TrainingState& run);

// Train-loop glue (train_loop.cpp keeps only calls to these).
std::string checkpoint_dir(const Config& config);
struct SavedCheckpoint {
  std::string path;
  uint64_t bytes = 0;
  double seconds = 0;
};
// resume: loads the latest good checkpoint (returns its step and data position, logs warnings).
// Otherwise a checkpoint dir holding an earlier run's checkpoints is moved to "<dir>.previous"
// (replacing an older one; pruning must never mix two runs), and it returns step 0, position 0.
CheckpointInfo begin_checkpointing(const Config& config, const TrainingState& run, bool resume, std::ostream& log);
// Saves when checkpoint.every divides step, or at the last step (checkpoint.at_end), and says
// what it saved (path empty: nothing). next_instance: the data position after this step;
// anchor and elapsed_s as in SaveOptions.
SavedCheckpoint maybe_save_checkpoint(const Config& config, const TrainingState& run, int64_t step, int64_t next_instance,
                                      bool last, const DataAnchor& anchor, double elapsed_s, std::ostream& log);

}  // namespace moe
