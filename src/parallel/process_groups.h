// The process groups of this rank (dp, ep, edp, pp), split from the world communicator by the
// rank ordering of parallel/layout.h.
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace moe {

struct ProcessGroups {
  Layout layout;
  RankCoords coords;
  Communicator* world = nullptr;  // the communicator the groups were split from (not owned)
  std::unique_ptr<Communicator> dp, ep, edp, pp;
};
// Collective over world.
ProcessGroups make_process_groups(Communicator& world, const Layout& layout);

}  // namespace moe
