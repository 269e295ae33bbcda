// libFuzzer harness: token files (flat uint16/uint32 arrays and .npy files). Opening and reading
// every instance must either work or throw moe::Error naming the problem.
#include <cstddef>
#include <cstdint>

#include "data/token_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz_input_file(data, size, ".npy");
  for (const char* dtype : {"uint16", "uint32"}) {
    try {
      moe::TokenDataset d({path}, dtype, 1000, 3);
      int32_t ids[3], labels[3];
      for (int64_t i = 0; i < d.num_instances() && i < 64; ++i) d.instance(i, ids, labels);
    } catch (const moe::Error&) {
    }
  }
  return 0;
}
