// The NCCL communicator (built with -DMOE_CUDA=ON): every collective of the Communicator seam over
// device buffers of the cuda backend, stream-ordered on a communication stream of its own. Each
// operation first waits (on the device) for the work the backend's stream had enqueued, and its
// Request's wait() makes the backend's stream wait for it: the host never blocks, except in
// barrier(). Tags are ignored: messages between a pair match in the order they are issued, and the
// sends and receives of one exchange go between group_start() and group_end().
// Byte counters follow communicator.h's definitions, as for MPI.
#pragma once

#include <memory>

#include "kernels/ops.h"
#include "parallel/communicator.h"

namespace moe {

// Collective over `bootstrap` (MPI, or a SelfCommunicator at size 1): rank 0's ncclGetUniqueId is
// broadcast over it and every rank joins with ncclCommInitRank. `cuda` is the backend whose
// stream the operations are ordered against (not owned; it must outlive the communicator).
std::unique_ptr<Communicator> make_nccl_world(Communicator& bootstrap, Backend& cuda);
// "2.28.9": the NCCL library this process loaded.
std::string nccl_version();

}  // namespace moe
