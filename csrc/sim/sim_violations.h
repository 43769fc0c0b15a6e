// SPDX-License-Identifier: Apache-2.0
// Planted-violation kernels (violation_kernels.cpp).
#pragma once

#include <string>
#include <vector>

#include "sim/sim_backend.h"

namespace lmca::sim {

std::vector<std::string> planted_violation_names();

// Runs the named kernel on the machine `cfg` over a 4 KiB GM scratch buffer;
// raises Violation (RuntimeError) where the simulation catches it.
Stats run_planted_violation(const std::string& name, const Config& cfg);

}  // namespace lmca::sim
