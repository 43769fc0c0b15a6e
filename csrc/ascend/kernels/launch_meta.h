// SPDX-License-Identifier: Apache-2.0
// Host side of the kernel meta arrays: packs a validated launch description
// (backend_ascend.h) into the int64 words the AscendC kernels read
// (kernel_meta.h).  Host-only (std::vector, ATen types); the simulation
// launchers (csrc/ascend/sim) use it, so the packing they exercise is the
// packing an NPU launcher built on it sends.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/backend_ascend.h"
#include "kernel_meta.h"

namespace lmca {

// tile_bytes: UB tile size (ub_tile_bytes of the SoC's UB); 0 = kernel default.
inline std::vector<int64_t> token_rows_meta(const ascend::TokenRowsLaunch& L,
                                            int64_t tile_bytes) {
  std::vector<int64_t> meta(kTokenRowsWords, 0);
  geom_to_words(L.geom, meta.data());
  meta[kTrNumLayers] = L.num_layers;
  meta[kTrNumKv] = L.num_kv;
  meta[kTrNumTokens] = L.num_tokens;
  meta[kTrSkipPrefix] = L.skip_prefix;
  meta[kTrVPlaneOffset] = L.v_plane_offset;
  meta[kTrChunkKvStride] = L.chunk_kv_stride;
  meta[kTrChunkLayerStride] = L.chunk_layer_stride;
  meta[kTrToChunk] = L.to_chunk ? 1 : 0;
  meta[kTrTileBytes] = tile_bytes;
  return meta;
}

inline std::vector<int64_t> multi_plane_meta(const ascend::MultiPlaneLaunch& L,
                                             int64_t tile_bytes) {
  const int64_t P = L.num_planes;
  std::vector<int64_t> meta(mp_meta_words(L.num_layers, P), 0);
  meta[kMpNumLayers] = L.num_layers;
  meta[kMpNumPlanes] = P;
  meta[kMpToChunk] = L.to_chunk ? 1 : 0;
  meta[kMpTileBytes] = tile_bytes;
  for (int64_t p = 0; p < P; ++p) {
    geom_to_words(L.geoms[p], meta.data() + mp_geom_base(p));
  }
  for (int64_t p = 0; p <= P; ++p) {
    meta[mp_offsets_base(P) + p] = L.slot_offsets[p];
    meta[mp_prefix_base(P) + p] = L.plane_prefix[p];
  }
  for (int64_t i = 0; i < L.num_layers * P; ++i) {
    meta[mp_ptrs_base(P) + i] = L.plane_ptrs[i];
  }
  return meta;
}

inline std::vector<int64_t> block_pages_meta(const ascend::BlockPagesLaunch& L,
                                             int64_t tile_bytes) {
  std::vector<int64_t> meta(kBpHeaderWords + L.num_layers, 0);
  geom_to_words(L.geom, meta.data());
  meta[kBpNumLayers] = L.num_layers;
  meta[kBpNumPages] = L.num_pages;
  meta[kBpPageBytes] = row_bytes(L.geom);
  meta[kBpToChunk] = L.to_chunk ? 1 : 0;
  meta[kBpTileBytes] = tile_bytes;
  for (int64_t l = 0; l < L.num_layers; ++l) {
    meta[kBpHeaderWords + l] = L.layer_ptrs[l];
  }
  return meta;
}

}  // namespace lmca
