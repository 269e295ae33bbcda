// The strict backend: the cpu kernels behind a device the host cannot touch, so that device
// discipline is testable on a machine without a GPU.
//  - Memory: every allocation is a memfd mapped twice, read-write for the backend's thread and
//    PROT_NONE at the address handed out, so any host dereference of a strict tensor faults.
//    Fresh allocations hold 0xFF bytes (NaN in every float dtype, -1 in i32): nothing may rely
//    on memory being zeroed (cudaMalloc does not zero).
//  - Ordering: calls are enqueued and run in order on the backend's own worker thread, and only
//    as far as the host has waited (wait / synchronize; or when the queue is full), so a result
//    read without its wait is deterministically stale: a missing wait fails, every time.
//  - Errors an op raises on the worker are held and rethrown by the next wait or synchronize
//    (later calls are skipped meanwhile), as a GPU reports them.
//  - Every upload and download is counted (Backend::transfers).
#pragma once

#include <memory>

#include "kernels/ops.h"

namespace moe {

std::unique_ptr<Backend> make_strict_backend();

}  // namespace moe
