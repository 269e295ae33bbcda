// The work items of the CPU GEMM tiles (gemm_items.cpp): one unit of scheduled work, run on one
// thread, and the one OpenMP region that runs an op's list of them (gemm_tiles.cpp plans the
// lists; its header comment has the determinism and scheduling rules). Internal to kernels/cpu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/gemm_dnnl.h"

namespace moe::cpu::tiles {

using cpu::gemm::Primitive;

// One unit of scheduled work, run on one thread: C (+)= A*B through `nfull` calls of `full`
// (each reducing `chunk` rows), then one call of `mid` (reducing mid_rows) and one of `tail`
// (reducing tail_rows), each if present, A and B advancing by a_row and b_row bytes per reduced
// row between calls (weight gradients; every other item is one call of `full`).
struct Item {
  const char* a = nullptr;
  const char* b = nullptr;
  float* c = nullptr;
  const Primitive* full = nullptr;
  const Primitive* first = nullptr;  // the first call's, when it differs from full's (overwrites)
  const Primitive* mid = nullptr;
  const Primitive* tail = nullptr;
  int64_t nfull = 1, chunk = 0, mid_rows = 0, tail_rows = 0;
  int64_t a_row = 0, b_row = 0;
  size_t es = 4;  // operand element size
  // Packed A (weight gradients): each call's A block, its reduction rows x a_cols elements at
  // leading dimension a_ld, is first copied to a dense per-thread buffer; a_transposed: as
  // a_cols rows of the call's reduction rows (bf16 for oneDNN's AMX kernels, which run a row-major
  // A ~30% faster than the transposed one).
  int64_t a_cols = 0, a_ld = 0;
  bool a_transposed = false;
  // Padded tail (AMX grouped weight gradients): the tail primitive reduces tail_pad >= tail_rows
  // rows; the call's A (transposed) and B rows are copied with zeros past tail_rows.
  int64_t tail_pad = 0;
  // Staged C (forward column tiles): C, c_rows x c_cols at leading dimension c_ld, is computed
  // in a dense per-thread buffer, copied in first when accumulating (c_in), then copied out.
  int64_t c_rows = 0, c_cols = 0, c_ld = 0;
  bool c_in = false;
  // ... copied out with streaming stores (a large output no one reads before the op ends).
  bool c_stream = false;
  // Padded rows (grouped forward / data gradient): the primitive computes c_pad_rows >= c_rows
  // rows into the staging buffer; only the first c_rows are copied out.
  int64_t c_pad_rows = 0;
  // Weight gradients: C is the tile's c_tile contiguous floats (a band of dw rows, full width).
  // Staged (see kStagedSumBytes): each call computes its product into the dense staging buffer,
  // which is then added to C. Overwrite (no accumulate): the first call writes C instead of
  // adding to it (straight from the staged primitive, or onto zeros for one that adds; a tile
  // summed in one call goes through the staging buffer and is streamed out), so a step's first
  // write of a gradient never reads the cold old values.
  int64_t c_tile = 0;
  bool staged = false, overwrite = false;
  // Our own micro-kernels instead of the primitives, which are then not created, where this
  // build has them: weight gradients (kWeight, gemm_wgrad.h: A read strided, C added to by the
  // kernel itself) and the bf16 data gradient of a long reduction (kLongData, gemm_long.h: the
  // rows `rows` of C = A * the pair rows `pairs`, A's rows `red` long, C's `cols` wide). kZero:
  // C's c_tile floats set to zero, no product (a band of a zero-row expert's weight gradient).
  enum class Kernel : uint8_t { kOneDnn, kWeight, kLongData, kZero };
  Kernel kernel = Kernel::kOneDnn;
  DType dtype = DType::kF32;
  const uint32_t* pairs = nullptr;
  int64_t rows = 0, red = 0, cols = 0;
  double cost = 0;  // for ordering: proportional to the flops
  int64_t seq = 0;  // position in the plan: breaks cost ties
};

// The list an op plans into (reused: no allocation after the first step).
std::vector<Item>& items();
// The ops are serialized: they share the item list, the per-thread buffers and the primitive cache.
std::mutex& op_mutex();
// Runs every item of `list` (reordered: largest first) on the ops' threads; rethrows the first error.
void run_items(std::vector<Item>& list);

}  // namespace moe::cpu::tiles
