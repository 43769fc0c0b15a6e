// SPDX-License-Identifier: Apache-2.0
// Multi-plane rows and whole block pages: the ops the multi-group connector
// uses for bundled kernel groups and opaque (vLLM-CPU, Mamba/GDN) pages.
#include "ops/backend_ascend.h"
#include "cpu/row_engine.h"
#include "ops/ops.h"
#include "ops/ops_util.h"

namespace lmca::ops {
namespace {

constexpr const char* kHostTable = "a host-side table";

// 1-D int64 CPU tensor with exactly `n` entries (n < 0: any length).
at::Tensor table_arg(const at::Tensor& t, const char* name, int64_t n,
                     const char* n_text) {
  at::Tensor h = host_int64(t, name, kHostTable);
  if (n >= 0 && h.numel() != n) {
    value_error("argument '", name, "' has ", h.numel(), " entries; expected ",
                n, " (", n_text, ")");
  }
  return h;
}

int64_t chunk_bytes(const at::Tensor& chunk) {
  check_defined(chunk, "chunk");
  if (!chunk.is_contiguous()) {
    value_error("argument 'chunk' must be contiguous, got shape ",
                chunk.sizes(), " strides ", chunk.strides());
  }
  return chunk.numel() * static_cast<int64_t>(chunk.element_size());
}

void check_chunk_size(int64_t have, int64_t need, const std::string& layout) {
  if (have < need) {
    value_error("argument 'chunk' holds ", have, " bytes but the layout (",
                layout, ") needs ", need, " bytes");
  }
}

void check_nonnull(const int64_t* p, int64_t n, const char* name,
                   int64_t per_layer) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] == 0) {
      value_error(name, "[", i, "] (layer ", i / per_layer, ", plane ",
                  i % per_layer, ") is a null pointer");
    }
  }
}

}  // namespace

void multi_plane_kv_transfer(const at::Tensor& chunk,
                             const at::Tensor& plane_ptrs,
                             const at::Tensor& plane_block_sizes,
                             const at::Tensor& plane_block_stride_bytes,
                             const at::Tensor& plane_row_bytes,
                             const at::Tensor& plane_num_blocks,
                             const at::Tensor& slot_mapping,
                             const at::Tensor& plane_slot_offsets,
                             bool to_chunk, int64_t num_layers) {
  const int64_t have = chunk_bytes(chunk);
  check_int64(slot_mapping, "slot_mapping");
  const Backend backend =
      pick_backend({{"chunk", &chunk}, {"slot_mapping", &slot_mapping}});
  check_positive(num_layers, "num_layers");
  const at::Tensor bs = table_arg(plane_block_sizes, "plane_block_sizes", -1, "");
  const int64_t P = bs.numel();
  if (P == 0) value_error("argument 'plane_block_sizes' is empty; need >= 1 plane");
  const at::Tensor stride = table_arg(plane_block_stride_bytes,
                                      "plane_block_stride_bytes", P, "one per plane");
  const at::Tensor rows = table_arg(plane_row_bytes, "plane_row_bytes", P, "one per plane");
  const at::Tensor nblk = table_arg(plane_num_blocks, "plane_num_blocks", P, "one per plane");
  const at::Tensor offs = table_arg(plane_slot_offsets, "plane_slot_offsets",
                                    P + 1, "number of planes + 1");
  const at::Tensor ptrs = table_arg(plane_ptrs, "plane_ptrs", num_layers * P,
                                    "num_layers x number of planes, layer-major");
  if (slot_mapping.dim() != 1) {
    value_error("argument 'slot_mapping' must be 1-D, got shape ", slot_mapping.sizes());
  }
  const int64_t *pbs = bs.data_ptr<int64_t>(), *pst = stride.data_ptr<int64_t>();
  const int64_t *prb = rows.data_ptr<int64_t>(), *pnb = nblk.data_ptr<int64_t>();
  const int64_t* po = offs.data_ptr<int64_t>();
  std::vector<PlaneGeom> geoms;
  std::vector<int64_t> prefix{0};
  for (int64_t p = 0; p < P; ++p) {
    if (pbs[p] <= 0 || prb[p] <= 0 || pnb[p] <= 0) {
      value_error("plane ", p, ": plane_block_sizes[", p, "] = ", pbs[p],
                  ", plane_row_bytes[", p, "] = ", prb[p],
                  ", plane_num_blocks[", p, "] = ", pnb[p], " must all be > 0");
    }
    if (pst[p] < pbs[p] * prb[p]) {
      value_error("plane_block_stride_bytes[", p, "] = ", pst[p],
                  " is below block_size x row_bytes = ", pbs[p] * prb[p],
                  "; valid: >= ", pbs[p] * prb[p], " (padding allowed)");
    }
    if (po[p + 1] < po[p]) {
      value_error("plane_slot_offsets must be non-decreasing; got [", p, "] = ",
                  po[p], " > [", p + 1, "] = ", po[p + 1]);
    }
    geoms.push_back(make_row_plane_geom(pbs[p], pst[p], prb[p], pnb[p]));
    prefix.push_back(prefix.back() + mp_plane_bytes(po[p + 1] - po[p], prb[p]));
  }
  if (po[0] != 0 || po[P] != slot_mapping.numel()) {
    value_error("plane_slot_offsets must start at 0 and end at "
                "slot_mapping.numel() = ", slot_mapping.numel(), "; got [0] = ",
                po[0], ", [", P, "] = ", po[P]);
  }
  const int64_t layer_bytes = prefix.back();
  check_chunk_size(have, num_layers * layer_bytes,
                   msg(num_layers, " layers x ", layer_bytes, " bytes per layer"));
  const int64_t* pp = ptrs.data_ptr<int64_t>();
  check_nonnull(pp, num_layers * P, "plane_ptrs", P);

  for (int64_t p = 0; p < P; ++p) {
    const at::Tensor plane_slots = slot_mapping.narrow(0, po[p], po[p + 1] - po[p]);
    // Indices in messages are positions in slot_mapping.
    if (plane_slots.device().is_cpu()) {
      const at::Tensor c = plane_slots.contiguous();
      check_slots_in_range(c.data_ptr<int64_t>(), c.numel(), slot_capacity(geoms[p]),
                           "slot_mapping", po[p],
                           msg("plane ", p, " has slots 0..", slot_capacity(geoms[p]) - 1,
                               " (plane_num_blocks=", pnb[p], " x plane_block_sizes=",
                               pbs[p], ")"));
    }
  }

  if (backend == Backend::kAscend) {
    ascend::MultiPlaneLaunch L;
    L.num_layers = num_layers;
    L.num_planes = P;
    L.plane_ptrs.assign(pp, pp + num_layers * P);
    L.geoms = geoms;
    L.slot_offsets.assign(po, po + P + 1);
    L.plane_prefix = prefix;
    L.slots = slot_mapping;
    L.chunk = chunk;
    L.to_chunk = to_chunk;
    ascend::multi_plane(L);
    return;
  }
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  cpu::RowJob job;
  job.num_layers = num_layers;
  job.to_chunk = to_chunk;
  for (int64_t p = 0; p < P; ++p) {
    job.planes.push_back(cpu::PlaneJob{geoms[p], sp + po[p], po[p + 1] - po[p], 0});
  }
  auto* base = static_cast<uint8_t*>(chunk.data_ptr());
  for (int64_t l = 0; l < num_layers; ++l) {
    for (int64_t p = 0; p < P; ++p) {
      job.paged_base.push_back(reinterpret_cast<uint8_t*>(pp[l * P + p]));
      job.chunk_base.push_back(base + mp_chunk_plane_offset(l, layer_bytes, prefix[p]));
    }
  }
  py::gil_scoped_release no_gil;
  cpu::run_row_job(job);
}

void block_page_transfer(const at::Tensor& chunk, const at::Tensor& layer_ptrs,
                         int64_t page_bytes, int64_t block_stride_bytes,
                         int64_t num_blocks, const at::Tensor& block_ids,
                         bool to_chunk) {
  const int64_t have = chunk_bytes(chunk);
  check_int64(block_ids, "block_ids");
  const Backend backend =
      pick_backend({{"chunk", &chunk}, {"block_ids", &block_ids}});
  const at::Tensor ptrs = table_arg(layer_ptrs, "layer_ptrs", -1, "");
  const int64_t L = ptrs.numel();
  if (L == 0) value_error("argument 'layer_ptrs' is empty; need >= 1 layer");
  check_positive(page_bytes, "page_bytes");
  check_positive(num_blocks, "num_blocks");
  if (block_stride_bytes < page_bytes) {
    value_error("argument 'block_stride_bytes' = ", block_stride_bytes,
                " must be >= page_bytes = ", page_bytes);
  }
  if (block_ids.dim() != 1) {
    value_error("argument 'block_ids' must be 1-D, got shape ", block_ids.sizes());
  }
  const int64_t N = block_ids.numel();
  check_chunk_size(have, L * N * page_bytes,
                   msg(L, " layers x ", N, " pages x ", page_bytes, " bytes"));
  const int64_t* pp = ptrs.data_ptr<int64_t>();
  check_nonnull(pp, L, "layer_ptrs", 1);
  const PlaneGeom g = make_page_geom(page_bytes, block_stride_bytes, num_blocks);

  check_host_slots(block_ids, 0, num_blocks, "block_ids",
                   msg("valid block ids are 0..", num_blocks - 1,
                       " (num_blocks = ", num_blocks, ")"));

  if (backend == Backend::kAscend) {
    ascend::BlockPagesLaunch La;
    La.num_layers = L;
    La.layer_ptrs.assign(pp, pp + L);
    La.geom = g;
    La.block_ids = block_ids;
    La.num_pages = N;
    La.chunk = chunk;
    La.to_chunk = to_chunk;
    ascend::block_pages(La);
    return;
  }
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  cpu::RowJob job;
  job.num_layers = L;
  job.to_chunk = to_chunk;
  job.planes.push_back(cpu::PlaneJob{g, ip, N, 0});
  auto* base = static_cast<uint8_t*>(chunk.data_ptr());
  for (int64_t l = 0; l < L; ++l) {
    job.paged_base.push_back(reinterpret_cast<uint8_t*>(pp[l]));
    job.chunk_base.push_back(base + page_chunk_offset(l, N, 0, page_bytes));
  }
  py::gil_scoped_release no_gil;
  cpu::run_row_job(job);
}

}  // namespace lmca::ops
