// Paths a user gives (--config, data files, train.init_from, --checkpoint, export/import
// folders, HF shards) are checked for what they name before any reader opens them: opening a
// FIFO blocks, a directory opens as a stream that reads as garbage (or makes a size query fail
// with bad_alloc), and a dangling symlink looks like a missing file. Each check throws one line
// naming `what` (the key or option that gave the path) and the path.
#pragma once

#include <string>
#include <string_view>

namespace moe {

// A regular file (or a symlink to one) that is readable; empty files are refused unless
// allow_empty.
void check_input_file(const std::string& path, std::string_view what, bool allow_empty = false);
// A directory (or a symlink to one).
void check_input_dir(const std::string& path, std::string_view what);
// Whether something is at path at all (lstat: a dangling symlink exists).
bool path_entry_exists(const std::string& path);
// check_input_file, then the whole file as bytes.
std::string read_input_file(const std::string& path, std::string_view what, bool allow_empty = false);

}  // namespace moe
