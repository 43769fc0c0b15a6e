// SPDX-License-Identifier: Apache-2.0
// The simulated machine an op call runs on (block_dim cores, UB size, tile).
//
// The simulation module wraps each op call in a Session; the op layer then
// validates and lowers its arguments exactly as for an NPU and hands the
// launch description to the simulated Ascend backend (sim_backend.cpp),
// which reads the machine from the active Session and adds the launches'
// counters to it.
#pragma once

#include <cstdint>
#include <string>

#include "sim_core.h"

namespace lmca::sim {

struct Config {
  int64_t block_dim = 40;  // vector cores of a 20-AI-core Atlas A2
  int64_t ub_bytes = kDefaultUbBytes;
  int64_t tile_bytes = -1;  // -1: launch_tile_bytes(ub_bytes); 0: kernel default
  int64_t task_ratio = 1;   // 1: AIV-only launch; 2: MIX, AIC:AIV 1:2
  std::string soc = "Ascend910B1";
  bool gather = true;       // the tiling word launchers send (see copy_kernels.h)
};

// __NPU_ARCH__ of a SoC name the simulation models (ValueError otherwise).
int npu_arch_of(const std::string& soc);

class Session {
 public:
  explicit Session(const Config& cfg);  // raises ValueError on bad values
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  const Stats& stats() const { return stats_; }

 private:
  Stats stats_;
  Session* prev_;
  friend const Config& active_config();
  friend void add_stats(const Stats&);
  Config cfg_;
};

const Config& active_config();   // the innermost Session's machine
void add_stats(const Stats& s);  // accumulates into it
int64_t tile_bytes_for(const Config& cfg);

}  // namespace lmca::sim
