// Libraries loaded at run time (dlopen) rather than linked: a CUDA build of moecore loads cuBLASLt
// (540 MB) and NCCL (220 MB) only when the cuda backend or an NCCL communicator is made, so every
// other process starts as fast as a CPU build's (0.15 s and 210 MB of page-ins each otherwise,
// measured with kernels_test), and starts at all where they are not installed.
#pragma once

#include <dlfcn.h>

#include <initializer_list>
#include <string>

#include "core/check.h"

namespace moe {

// The first of `names` that loads; fails naming `what` and the loader's last error.
inline void* open_library(std::initializer_list<const char*> names, const char* what) {
  std::string tried;
  for (const char* n : names) {
    if (void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL)) return h;
    tried += tried.empty() ? n : std::string(", ") + n;
  }
  const char* err = dlerror();
  MOE_FAIL(what, ": cannot load ", tried, " (", err ? err : "not found", "; is its folder on LD_LIBRARY_PATH?)");
}

inline void* library_symbol(void* handle, const char* name, const char* what) {
  void* p = dlsym(handle, name);
  MOE_CHECK(p != nullptr, what, ": the library has no symbol ", name, " (an older version?)");
  return p;
}

}  // namespace moe
