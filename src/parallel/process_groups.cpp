#include "parallel/process_groups.h"

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

}  // namespace moe
