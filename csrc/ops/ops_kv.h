// SPDX-License-Identifier: Apache-2.0
// LMCache token-row format helpers shared by the op TUs: paged layer geometry
// (from the shared addressing header) and the lowering to a CPU RowJob.
#pragma once

#include <string>
#include <vector>

#include "cpu/row_engine.h"
#include "ops/ops_util.h"

namespace lmca::ops {


// Paged layer geometry of an LMCache token-row format, all in bytes.
struct KvLayer {
  int64_t fmt;
  int64_t num_kv;
  int64_t hidden_bytes;  // NH * HS * elem
  PlaneGeom geom;
  int64_t v_offset;      // V plane from the layer base
};

// Geometry from (format, blocks, heads, head bytes, requested block stride).
inline KvLayer make_kv_layer(int64_t fmt, int64_t num_blocks, int64_t block_size,
                      int64_t num_heads, int64_t head_bytes,
                      int64_t block_stride_bytes, int64_t chunk_row_stride,
                      const char* stride_name) {
  const int64_t tight =
      kv_tight_block_stride(fmt, block_size, num_heads, head_bytes);
  if (block_stride_bytes < 0 ||
      (block_stride_bytes > 0 && block_stride_bytes < tight)) {
    value_error("argument '", stride_name, "' gives a block stride of ",
                block_stride_bytes, " bytes, below the tight block size of ",
                tight, " bytes; valid: 0 (tight) or >= ", tight, " bytes");
  }
  KvLayer k;
  k.fmt = fmt;
  k.num_kv = kv_format_num_kv(fmt);
  k.hidden_bytes = num_heads * head_bytes;
  k.geom = make_kv_plane_geom(fmt, num_blocks, block_size, num_heads,
                              head_bytes, block_stride_bytes, chunk_row_stride);
  k.v_offset = kv_plane_offset(fmt, 1, num_blocks, block_size, num_heads,
                               head_bytes, k.geom.block_stride);
  return k;
}

inline std::string slot_range_text(const PlaneGeom& g) {
  return msg("valid slots are 0..", slot_capacity(g) - 1, " (num_blocks=",
             g.num_blocks, " x block_size=", g.block_size, ")");
}

// CPU lowering shared by the token-row ops: L layers x num_kv planes.
inline cpu::RowJob token_row_job(const KvLayer& k, const std::vector<int64_t>& ptrs,
                          int64_t num_layers, uint8_t* chunk,
                          int64_t chunk_kv_stride, int64_t chunk_layer_stride,
                          const int64_t* slots, int64_t num_slots,
                          int64_t skip, bool to_chunk) {
  cpu::RowJob job;
  job.num_layers = num_layers;
  job.to_chunk = to_chunk;
  for (int64_t kv = 0; kv < k.num_kv; ++kv) {
    job.planes.push_back(cpu::PlaneJob{k.geom, slots, num_slots, skip});
  }
  for (int64_t l = 0; l < num_layers; ++l) {
    for (int64_t kv = 0; kv < k.num_kv; ++kv) {
      job.paged_base.push_back(reinterpret_cast<uint8_t*>(ptrs[l]) +
                               kv * k.v_offset);
      job.chunk_base.push_back(
          chunk + lmc_chunk_plane_offset(kv, l, chunk_kv_stride,
                                         chunk_layer_stride));
    }
  }
  return job;
}

inline void run_cpu_job(const cpu::RowJob& job) {
  py::gil_scoped_release no_gil;
  cpu::run_row_job(job);
}

}  // namespace lmca::ops
