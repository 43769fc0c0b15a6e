// SPDX-License-Identifier: Apache-2.0
// Backend selection of lmcache_ascend.ops: the op layer's link-time seam.
//
// The op layer (lmca_op_layer, see CMakeLists.txt) declares pick_backend
// in ops_util.h and calls it; this file defines it for the shipped module
// (by the tensors' devices).  The test-only AscendC simulation module links
// the same op layer with its own definition instead (csrc/sim/sim_backend.cpp),
// so the op sources are compiled once and shared by both.
#include "ops/backend_ascend.h"
#include "ops/ops_util.h"

namespace lmca::ops {

namespace {

bool is_cpu_string(const std::string& dev) {
  return dev == "cpu" || dev.rfind("cpu:", 0) == 0;
}

bool is_npu_string(const std::string& dev) {
  return dev == "npu" || dev.rfind("npu:", 0) == 0;
}

// One non-CPU location found: decide whether the Ascend backend can serve it.
Backend non_cpu_backend(const std::string& what, const std::string& dev) {
  if (!ascend::built()) {
    runtime_error(what, " is on device '", dev,
                  "', but the NPU (Ascend) backend was not compiled into "
                  "lmcache_ascend.ops (built backends: ",
                  built_backends_str(),
                  "; rebuild with a CANN toolkit, ASCEND_HOME_PATH set). "
                  "Pass CPU tensors to use the CPU backend.");
  }
  if (!is_npu_string(dev)) {
    runtime_error(what, " is on device '", dev,
                  "'; lmcache_ascend.ops supports only 'cpu' and 'npu' "
                  "devices (built backends: ",
                  built_backends_str(), ")");
  }
  return Backend::kAscend;
}

}  // namespace

Backend pick_backend(const std::vector<NamedTensor>& tensors,
                     const std::string& device_arg_name,
                     const std::string& device_str) {
  Backend b = Backend::kCpu;
  if (!device_str.empty() && !is_cpu_string(device_str)) {
    b = non_cpu_backend(msg("argument '", device_arg_name, "'"), device_str);
  }
  for (const NamedTensor& nt : tensors) {
    if (nt.tensor == nullptr || !nt.tensor->defined()) continue;
    const std::string dev = nt.tensor->device().str();
    if (!is_cpu_string(dev)) {
      b = non_cpu_backend(msg("tensor '", nt.name, "'"), dev);
    }
  }
  return b;
}

}  // namespace lmca::ops
