#include "train/events.h"

#include <ctime>

#include "core/check.h"

namespace moe {

RunEvents::RunEvents(const std::string& path) {
  if (path.empty()) return;
  out_.open(path, std::ios::app);
  MOE_CHECK(out_.good(), "cannot append to '", path, "'");
}

void RunEvents::write(const std::string& event, const nlohmann::json& fields) {
  if (!out_.is_open()) return;
  nlohmann::ordered_json j;
  j["event"] = event;
  j["time"] = utc_timestamp();
  for (auto& [k, v] : fields.items()) j[k] = v;
  out_ << j.dump() << "\n" << std::flush;
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace moe
