// SPDX-License-Identifier: Apache-2.0
// Ascend backend of the simulation module.
//
// The op layer (lmca_op_layer, the same objects as in lmcache_ascend._ops)
// takes its Ascend path for every host tensor here (see pick_backend below) and
// calls these launchers with the launch descriptions it would hand to the
// NPU launchers.  They pack the kernel meta with the shared packers
// (kernels/launch_meta.h), register every GM buffer the kernel may touch
// (sized by its geometry, so an access past it is an error), and run the
// real AscendC kernels (kernels/copy_kernels.cpp) on the simulated cores,
// with host memory playing the NPU's global memory.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "ops/backend_ascend.h"
#include "ascend/kernels/launch_meta.h"
#include "ops/ops_util.h"
#include "sim/sim_backend.h"

// The AscendC entry points (copy_kernels.cpp, host build: GM_ADDR is uint8_t*).
extern "C" {
void lmca_token_rows_kernel(uint8_t* meta, uint8_t* layer_ptrs, uint8_t* chunk,
                            uint8_t* slots);
void lmca_multi_plane_kernel(uint8_t* meta, uint8_t* chunk, uint8_t* slots);
void lmca_block_pages_kernel(uint8_t* meta, uint8_t* chunk, uint8_t* block_ids);
}

namespace lmca::sim {
namespace {

thread_local Session* g_session = nullptr;

uint8_t* bytes(const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); }

// Bytes a paged plane's geometry can address from its base pointer.
int64_t plane_extent(const PlaneGeom& g) {
  return (g.num_blocks - 1) * g.block_stride +
         paged_offset(g, 0, g.block_size - 1, g.num_segs - 1) + g.seg_bytes;
}

// Index tensors are read by the kernel through GM: contiguous int64.
at::Tensor words(const at::Tensor& t) { return t.contiguous(); }

void add_words(Launch& launch, const at::Tensor& t, const char* name) {
  launch.add_region(t.data_ptr(), t.numel() * 8, name);
}

template <typename Body>
void simulate(Launch& launch, Body&& body) {
  run_cores(launch, body);
  add_stats(launch.stats);
}

// What the NPU launchers check on the host before a launch.
Tiling launch_tiling(const Config& cfg) {
  const std::string why = unsupported_soc_reason(cfg.soc);
  if (!why.empty()) ops::runtime_error("lmcache_ascend: ", why);
  return Tiling{tile_bytes_for(cfg), cfg.gather ? 1 : 0};
}

Launch make_launch(const Config& cfg) {
  return Launch(cfg.block_dim, cfg.ub_bytes, cfg.task_ratio, npu_arch_of(cfg.soc));
}

}  // namespace

int npu_arch_of(const std::string& soc) {
  if (soc.rfind("Ascend310P", 0) == 0) return kArch310P;
  if (soc.rfind("Ascend910B", 0) == 0 || soc.rfind("Ascend910_93", 0) == 0) return kArchA2;
  ops::value_error("soc = '", soc, "' is not modeled: valid are Ascend910B* and "
                   "Ascend910_93* (Atlas A2/A3, __NPU_ARCH__ 2201) and Ascend310P* "
                   "(__NPU_ARCH__ 2002)");
}

Session::Session(const Config& cfg) : prev_(g_session), cfg_(cfg) {
  if (cfg.block_dim < 1 || cfg.block_dim > 65535) {
    ops::value_error("block_dim = ", cfg.block_dim, " must be in [1, 65535]");
  }
  if (cfg.ub_bytes < kUbBlock || cfg.ub_bytes % kUbBlock != 0 ||
      cfg.ub_bytes > (int64_t{1} << 30)) {
    ops::value_error("ub_bytes = ", cfg.ub_bytes,
                     " must be a positive multiple of 32 (at most 1 GiB)");
  }
  if (cfg.tile_bytes < -1) {
    ops::value_error("tile_bytes = ", cfg.tile_bytes,
                     " must be -1 (derive from ub_bytes), 0 (kernel default) or > 0");
  }
  if (cfg.tile_bytes > 0) {  // the launchers' host check of their tiling word
    const std::string why = tile_bytes_problem(cfg.tile_bytes, cfg.ub_bytes);
    if (!why.empty()) ops::value_error("tile_bytes = ", cfg.tile_bytes, ": ", why);
  }
  if (cfg.task_ratio != 1 && cfg.task_ratio != 2) {
    ops::value_error("task_ratio = ", cfg.task_ratio, " must be 1 (AIV-only launch) "
                     "or 2 (MIX launch, AIC:AIV 1:2)");
  }
  npu_arch_of(cfg.soc);
  stats_.tile_bytes = tile_bytes_or_default(tile_bytes_for(cfg));
  g_session = this;
}

Session::~Session() { g_session = prev_; }

const Config& active_config() {
  if (g_session == nullptr) {
    throw std::runtime_error("AscendC simulation: no simulated machine is active");
  }
  return g_session->cfg_;
}

void add_stats(const Stats& s) {
  Stats& t = g_session->stats_;
  t.launches += s.launches;
  t.cores_run += s.cores_run;
  t.active_cores = std::max(t.active_cores, s.active_cores);
  t.copies_in += s.copies_in;
  t.copies_out += s.copies_out;
  t.bytes_in += s.bytes_in;
  t.bytes_out += s.bytes_out;
  t.max_copy_bytes = std::max(t.max_copy_bytes, s.max_copy_bytes);
  t.ub_peak_bytes = std::max(t.ub_peak_bytes, s.ub_peak_bytes);
  t.scalar_gm_reads += s.scalar_gm_reads;
  t.max_queue_occupancy = std::max(t.max_queue_occupancy, s.max_queue_occupancy);
  t.bursts_in += s.bursts_in;
  t.bursts_out += s.bursts_out;
  t.task_type = s.task_type;
}

int64_t tile_bytes_for(const Config& cfg) {
  return cfg.tile_bytes >= 0 ? cfg.tile_bytes : launch_tile_bytes(cfg.ub_bytes);
}

}  // namespace lmca::sim

namespace lmca::ascend {

bool built() { return true; }

void token_rows(const TokenRowsLaunch& L) {
  if (L.num_layers == 0 || L.num_tokens == 0) return;  // as the NPU launcher
  const sim::Config& cfg = sim::active_config();
  std::vector<int64_t> meta = token_rows_meta(L, sim::launch_tiling(cfg));
  const at::Tensor ptrs = sim::words(L.layer_ptrs);
  const at::Tensor slots = sim::words(L.slots);
  sim::Launch launch = sim::make_launch(cfg);
  launch.add_region(meta.data(), int64_t(meta.size()) * 8, "meta");
  sim::add_words(launch, ptrs, "layer_ptrs");
  sim::add_words(launch, slots, "slot_mapping");
  launch.add_region(L.chunk, L.chunk_span, "chunk");
  const int64_t* p = ptrs.data_ptr<int64_t>();
  for (int64_t l = 0; l < L.num_layers; ++l) {
    for (int64_t kv = 0; kv < L.num_kv; ++kv) {
      launch.add_region(sim::bytes(reinterpret_cast<void*>(p[l])) + kv * L.v_plane_offset,
                        sim::plane_extent(L.geom),
                        sim::cat("layer ", l, L.num_kv == 1 ? "" : (kv ? " V" : " K")));
    }
  }
  sim::simulate(launch, [&] {
    lmca_token_rows_kernel(sim::bytes(meta.data()), sim::bytes(ptrs.data_ptr()),
                           L.chunk, sim::bytes(slots.data_ptr()));
  });
}

void multi_plane(const MultiPlaneLaunch& L) {
  const int64_t P = L.num_planes;
  if (L.num_layers == 0 || L.slot_offsets[P] == 0) return;  // as the NPU launcher
  const sim::Config& cfg = sim::active_config();
  std::vector<int64_t> meta = multi_plane_meta(L, sim::launch_tiling(cfg));
  const at::Tensor slots = sim::words(L.slots);
  sim::Launch launch = sim::make_launch(cfg);
  launch.add_region(meta.data(), int64_t(meta.size()) * 8, "meta");
  sim::add_words(launch, slots, "slot_mapping");
  launch.add_region(L.chunk.data_ptr(), L.num_layers * L.plane_prefix[P], "chunk");
  for (int64_t l = 0; l < L.num_layers; ++l) {
    for (int64_t q = 0; q < P; ++q) {
      launch.add_region(reinterpret_cast<void*>(L.plane_ptrs[l * P + q]),
                        sim::plane_extent(L.geoms[q]),
                        sim::cat("layer ", l, " plane ", q));
    }
  }
  sim::simulate(launch, [&] {
    lmca_multi_plane_kernel(sim::bytes(meta.data()), sim::bytes(L.chunk.data_ptr()),
                            sim::bytes(slots.data_ptr()));
  });
}

void block_pages(const BlockPagesLaunch& L) {
  if (L.num_layers == 0 || L.num_pages == 0) return;  // as the NPU launcher
  const sim::Config& cfg = sim::active_config();
  std::vector<int64_t> meta = block_pages_meta(L, sim::launch_tiling(cfg));
  const at::Tensor ids = sim::words(L.block_ids);
  sim::Launch launch = sim::make_launch(cfg);
  launch.add_region(meta.data(), int64_t(meta.size()) * 8, "meta");
  sim::add_words(launch, ids, "block_ids");
  launch.add_region(L.chunk.data_ptr(), L.num_layers * L.num_pages * row_bytes(L.geom),
                    "chunk");
  for (int64_t l = 0; l < L.num_layers; ++l) {
    launch.add_region(reinterpret_cast<void*>(L.layer_ptrs[l]), sim::plane_extent(L.geom),
                      sim::cat("layer ", l, " pool"));
  }
  sim::simulate(launch, [&] {
    lmca_block_pages_kernel(sim::bytes(meta.data()), sim::bytes(L.chunk.data_ptr()),
                            sim::bytes(ids.data_ptr()));
  });
}

// Not an AscendC kernel (aclrtMemcpyAsync on the NPU): host memory plays
// device memory, so a plain copy.
void memcpy_async(uint64_t dst, uint64_t src, int64_t nbytes, bool) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
               static_cast<size_t>(nbytes));
}

}  // namespace lmca::ascend

namespace lmca::ops {

// This module's side of the op layer's backend seam (the shipped module links
// csrc/ops/backend_by_device.cpp instead): host memory plays the NPU's
// memory, so every CPU tensor takes the Ascend path, with the same
// validation and lowering as on an NPU host.
Backend pick_backend(const std::vector<NamedTensor>& tensors,
                     const std::string& device_arg_name,
                     const std::string& device_str) {
  auto is_cpu = [](const std::string& d) { return d == "cpu" || d.rfind("cpu:", 0) == 0; };
  if (!device_str.empty() && !is_cpu(device_str)) {
    runtime_error("argument '", device_arg_name, "' is '", device_str,
                  "'; the AscendC simulation runs on host memory: pass 'cpu'");
  }
  for (const NamedTensor& nt : tensors) {
    if (nt.tensor == nullptr || !nt.tensor->defined()) continue;
    if (!nt.tensor->device().is_cpu()) {
      runtime_error("tensor '", nt.name, "' is on device '", nt.tensor->device().str(),
                    "'; the AscendC simulation runs on host memory: pass CPU tensors");
    }
  }
  return Backend::kAscend;
}

}  // namespace lmca::ops
