// The plan as a JSON object, for the writers that add to it (plan_format.cpp, time_format.cpp);
// inside src/plan only, so that nlohmann/json stays out of the planner's interface.
#pragma once

#include <nlohmann/json.hpp>

#include "plan/plan.h"

namespace moe {

nlohmann::json plan_json(const Config& config, const Plan& plan);

}  // namespace moe
