// The MPI world shared by the parallel tests (created in parallel_main.cpp).
#pragma once
#include "parallel/communicator.h"
namespace moe::test {
Communicator& world();
}
