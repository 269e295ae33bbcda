#include "common/paths.h"

namespace moe::test {

const char* source_dir() { return MOE_SOURCE_DIR; }
const char* moecore_binary() { return MOE_BINARY_PATH; }
const char* mpiexec() { return MOE_MPIEXEC; }

}  // namespace moe::test
