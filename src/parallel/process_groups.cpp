#include "parallel/process_groups.h"

#include "kernels/ops.h"
#ifdef MOE_WITH_CUDA
#include "parallel/nccl_communicator.h"
#endif

#include "core/check.h"

namespace moe {

ProcessGroups make_process_groups(Communicator& world, const Layout& l) {
  MOE_CHECK(world.size() == l.world(), "world size ", world.size(), " != pp=", l.pp, " x dp=", l.dp, " = ",
            l.world());
  ProcessGroups g;
  g.layout = l;
  g.world = &world;
  g.coords = rank_coords(l, world.rank());
  const RankCoords& c = g.coords;
  auto i = [](int64_t v) { return static_cast<int>(v); };
  g.dp = world.split(i(c.pp), i(c.dp));
  g.ep = world.split(i(c.pp * l.edp() + c.edp), i(c.ep));
  g.edp = world.split(i(c.pp * l.ep + c.ep), i(c.edp));
  g.pp = world.split(i(c.dp), i(c.pp));
  return g;
}

std::unique_ptr<DeviceGroups> device_groups(const std::string& communicator, ProcessGroups* host, Backend& ops) {
  if (communicator != "nccl" || host == nullptr) return nullptr;
#ifdef MOE_WITH_CUDA
  auto d = std::make_unique<DeviceGroups>();
  d->device_world = make_nccl_world(*host->world, ops);
  d->groups = make_process_groups(*d->device_world, host->layout);
  d->groups.world = host->world;
  return d;
#else
  (void)ops;
  MOE_FAIL("parallel.communicator = \"nccl\": this moecore was built without CUDA (configure with -DMOE_CUDA=ON)");
#endif
}

}  // namespace moe
