// SPDX-License-Identifier: Apache-2.0
// lmca_ascend_sim (test-only, never part of the lmcache_ascend package): the
// AscendC kernels run on simulated AI cores.
//
// Each op has the name, arguments and semantics of its lmcache_ascend.ops
// counterpart plus keyword-only machine arguments (block_dim, ub_bytes,
// tile_bytes), and returns the simulation's counters as a dict.  The call
// goes through the op layer's own validation and Ascend lowering, the NPU
// launchers' meta packing and the real kernel bodies (see sim_backend.cpp);
// only ACL / torch_npu are absent.  Inputs are CPU tensors (host memory
// plays the NPU's global memory).  A broken hardware rule raises
// RuntimeError naming the core, the AscendC call and the rule.
#include "ascend/kernels/kernel_meta.h"
#include "ops/ops.h"
#include "ops/ops_util.h"
#include "sim/sim_backend.h"
#include "sim/sim_violations.h"

namespace {

using lmca::sim::Config;
using lmca::sim::Stats;

py::dict to_dict(const Stats& s) {
  py::dict d;
  d["launches"] = s.launches;
  d["cores_run"] = s.cores_run;
  d["active_cores"] = s.active_cores;
  d["copies_in"] = s.copies_in;
  d["copies_out"] = s.copies_out;
  d["bytes_in"] = s.bytes_in;
  d["bytes_out"] = s.bytes_out;
  d["max_copy_bytes"] = s.max_copy_bytes;
  d["ub_peak_bytes"] = s.ub_peak_bytes;
  d["scalar_gm_reads"] = s.scalar_gm_reads;
  d["max_queue_occupancy"] = s.max_queue_occupancy;
  d["tile_bytes"] = s.tile_bytes;
  d["bursts_in"] = s.bursts_in;
  d["bursts_out"] = s.bursts_out;
  d["task_type"] = s.task_type;
  return d;
}

Config machine(int64_t block_dim, int64_t ub_bytes, int64_t tile_bytes,
               int64_t task_ratio, const std::string& soc, bool gather) {
  return Config{block_dim, ub_bytes, tile_bytes, task_ratio, soc, gather};
}

// op(args...) on a simulated machine given by the trailing arguments.
template <typename... A>
auto simulated(void (*op)(A...)) {
  return [op](A... args, int64_t block_dim, int64_t ub_bytes, int64_t tile_bytes,
              int64_t task_ratio, const std::string& soc, bool gather) {
    lmca::sim::Session session(
        machine(block_dim, ub_bytes, tile_bytes, task_ratio, soc, gather));
    op(args...);
    return to_dict(session.stats());
  };
}

constexpr const char* kModuleDoc = R"doc(
The AscendC kernels of lmcache_ascend.ops, compiled for the host against a
simulation of the AscendC API and run on simulated AI cores (one after
another, each with its own block index and Unified Buffer).  Ops mirror
lmcache_ascend.ops (same arguments, CPU tensors) plus keyword-only
block_dim (cores), ub_bytes (UB per core, default 192 KiB), tile_bytes
(-1: derived from ub_bytes as a launcher does; 0: what a launcher that
leaves the tiling word unset sends), task_ratio (1: AIV-only launch; 2: MIX
launch, GetBlockIdx over [0, 2 * block_dim)), soc (default Ascend910B1) and
gather (False: every span moved on its own, the kernels' former strategy).
They return counters (copies, DMA bursts, bytes, largest single copy, UB
peak, declared kernel type, ...).  Broken hardware rules raise
RuntimeError.  See docs/kernels.md, "AscendC simulation".
)doc";

}  // namespace

PYBIND11_MODULE(lmca_ascend_sim, m) {
  using namespace lmca::ops;
  py::module_::import("torch");
  m.doc() = kModuleDoc;
  // Checked by tests/kernels/sim_module.py against the running torch.
  m.attr("_torch_version") = LMCA_TORCH_VERSION;
  const int64_t kDim = Config{}.block_dim, kUb = Config{}.ub_bytes;
  const std::string kSoc = Config{}.soc;
#define LMCA_SIM_MACHINE                                                    \
  py::kw_only(), py::arg("block_dim") = kDim, py::arg("ub_bytes") = kUb,      \
      py::arg("tile_bytes") = -1, py::arg("task_ratio") = 1,                  \
      py::arg("soc") = kSoc, py::arg("gather") = true

  m.def("multi_layer_kv_transfer", simulated(&multi_layer_kv_transfer),
        py::arg("key_value"), py::arg("key_value_ptrs"),
        py::arg("slot_mapping"), py::arg("paged_memory_device"),
        py::arg("page_buffer_size"), py::arg("direction"),
        py::arg("engine_kv_format"), py::arg("block_size") = 0,
        py::arg("head_size") = 0, py::arg("skip_prefix_n_tokens") = 0,
        py::arg("block_stride_elems") = 0, LMCA_SIM_MACHINE);

  m.def("single_layer_kv_transfer", simulated(&single_layer_kv_transfer),
        py::arg("lmc_key_value_cache"), py::arg("vllm_key_value_cache"),
        py::arg("slot_mapping"), py::arg("direction"),
        py::arg("engine_kv_format"), py::arg("token_major") = false,
        LMCA_SIM_MACHINE);

  m.def("multi_layer_block_kv_transfer", simulated(&multi_layer_block_kv_transfer),
        py::arg("paged_buffer_ptrs_tensor"), py::arg("lmcache_objects_ptrs"),
        py::arg("block_ids"), py::arg("device"), py::arg("direction"),
        py::arg("shape_desc"), py::arg("lmcache_chunk_size"),
        py::arg("engine_kv_format"), py::arg("skip_prefix_n_blocks"),
        LMCA_SIM_MACHINE);

  m.def("multi_plane_kv_transfer", simulated(&multi_plane_kv_transfer),
        py::arg("chunk"), py::arg("plane_ptrs"), py::arg("plane_block_sizes"),
        py::arg("plane_block_stride_bytes"), py::arg("plane_row_bytes"),
        py::arg("plane_num_blocks"), py::arg("slot_mapping"),
        py::arg("plane_slot_offsets"), py::arg("to_chunk"),
        py::arg("num_layers"), LMCA_SIM_MACHINE);

  m.def("block_page_transfer", simulated(&block_page_transfer), py::arg("chunk"),
        py::arg("layer_ptrs"), py::arg("page_bytes"),
        py::arg("block_stride_bytes"), py::arg("num_blocks"),
        py::arg("block_ids"), py::arg("to_chunk"), LMCA_SIM_MACHINE);

  m.def(
      "run_planted_violation",
      [](const std::string& name, int64_t block_dim, int64_t ub_bytes, int64_t tile_bytes,
         int64_t task_ratio, const std::string& soc, bool gather) {
        return to_dict(lmca::sim::run_planted_violation(
            name, machine(block_dim, ub_bytes, tile_bytes, task_ratio, soc, gather)));
      },
      "Run a small kernel that breaks one modeled rule ('control' breaks "
      "none); the simulation raises RuntimeError for each violation.",
      py::arg("name"), LMCA_SIM_MACHINE);
#undef LMCA_SIM_MACHINE

  m.def("planted_violation_names", &lmca::sim::planted_violation_names);
  m.def("ub_tile_bytes", [](int64_t ub_bytes) { return lmca::ub_tile_bytes(ub_bytes); },
        "Largest tile such that two (double buffering) fit ub_bytes.",
        py::arg("ub_bytes"));
  m.def("launch_tile_bytes", [](int64_t ub_bytes) { return lmca::launch_tile_bytes(ub_bytes); },
        "UB tile a launcher derives from the UB capacity (two tiles plus headroom).",
        py::arg("ub_bytes"));
  m.attr("DEFAULT_BLOCK_DIM") = kDim;
  m.attr("DEFAULT_UB_BYTES") = kUb;
  m.attr("DEFAULT_TILE_BYTES") = lmca::kDefaultUbTileBytes;
}
