// Where tests find the repository (fixtures, configs), the moecore binary they run and mpirun.
// The paths are compiled into common/paths.cpp alone, so no other file's compile command names an
// absolute path and ccache shares their objects between clones of the repository (.ci/run).
#pragma once

namespace moe::test {

const char* source_dir();      // the repository's root
const char* moecore_binary();  // the moecore executable of this build
const char* mpiexec();         // CMake's MPIEXEC_EXECUTABLE ("" when none was found)

}  // namespace moe::test
