// What this binary is: version, git commit and build flags (generated at build time by
// cmake/build_info.cmake). `moecore --version` prints it, events.jsonl records it, and ranks
// compare it before training (a run mixing builds is refused).
#pragma once

#include <string>

namespace moe {

const char* moecore_version();     // "0.1.0" (CMake project version)
const char* moecore_git_hash();    // 12 hex digits, "-dirty" when the tree had changes; "unknown" outside git
const char* moecore_build_flags(); // compiler, build type and the options that change results
// "moecore 0.1.0 (git 0123456789ab, g++ 12.2.0 Release -march=native)"
std::string build_description();

}  // namespace moe
