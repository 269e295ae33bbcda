// The process groups of this rank (dp, ep, edp, pp), split from the world communicator by the
// rank ordering of config/layout.h.
#pragma once

#include <memory>
#include <string>

#include "parallel/communicator.h"
#include "config/layout.h"

namespace moe {

class Backend;

struct ProcessGroups {
  Layout layout;
  RankCoords coords;
  Communicator* world = nullptr;  // the communicator the groups were split from (not owned)
  std::unique_ptr<Communicator> dp, ep, edp, pp;
};
// Collective over world.
ProcessGroups make_process_groups(Communicator& world, const Layout& layout);

// The groups of `host` again, split from a device communicator over the same ranks (NCCL on
// cuda) for the tensors; `world` stays host's (agreement checks, logs). Collective.
struct DeviceGroups {
  std::unique_ptr<Communicator> device_world;
  ProcessGroups groups;
};
// parallel.communicator = "nccl": the NCCL groups of `host` on the cuda backend `ops`; otherwise
// nothing (the caller keeps `host`).
std::unique_ptr<DeviceGroups> device_groups(const std::string& communicator, ProcessGroups* host, Backend& ops);

}  // namespace moe
