// SPDX-License-Identifier: Apache-2.0
// Host side of the kernel meta arrays: packs a validated launch description
// (backend_ascend.h) into the int64 words the AscendC kernels read
// (kernel_meta.h).  Host-only (std::vector, ATen types); the NPU launchers
// (csrc/ascend/launchers.cpp) and the simulation's (csrc/sim) both use it,
// so the packing the simulation exercises is the packing the NPU gets.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/backend_ascend.h"
#include "kernel_meta.h"

#include <string>

namespace lmca {

// Tiling data of one launch: the UB tile (launch_tile_bytes of the SoC's UB;
// 0 = the kernel's default) and whether rows of several runs are gathered
// into one tile (1, what launchers send) or each span is moved on its own (0).
struct Tiling {
  int64_t tile_bytes = 0;
  int64_t gather = 1;
};

// The copy kernels use DataCopyPad between GM and UB, which Atlas inference
// products (Ascend310P*, __NPU_ARCH__ 2002) do not have (DataCopyPad docs):
// empty if `soc` can run them, else why not.
inline std::string unsupported_soc_reason(const std::string& soc) {
  if (soc.rfind("Ascend310P", 0) == 0) {
    return "SoC " + soc + " (Atlas 300I Duo / 310P) has no DataCopyPad between "
           "GM and UB, which every lmcache_ascend copy kernel uses; use an Atlas "
           "A2/A3 (Ascend910B*/Ascend910_93*) NPU";
  }
  return "";
}

// What is wrong with a tile word for a UB of ub_bytes (empty if nothing).
inline std::string tile_bytes_problem(int64_t tile, int64_t ub_bytes) {
  switch (tile_bytes_error(tile, ub_bytes)) {
    case 1:
      return "UB tile of " + std::to_string(tile) + " bytes: must be a positive "
             "multiple of 32";
    case 2:
      return "UB tile of " + std::to_string(tile) + " bytes: " +
             std::to_string(kUbBuffers) + " tiles exceed the " +
             std::to_string(ub_bytes) + "-byte UB";
    case 3:
      return "UB tile of " + std::to_string(tile) + " bytes: above the " +
             std::to_string(kMaxCopyBytes) + "-byte limit of one copy";
    default:
      return "";
  }
}

inline std::vector<int64_t> token_rows_meta(const ascend::TokenRowsLaunch& L,
                                            const Tiling& t) {
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
  meta[kTrTileBytes] = t.tile_bytes;
  meta[kTrGather] = t.gather;
  return meta;
}

inline std::vector<int64_t> multi_plane_meta(const ascend::MultiPlaneLaunch& L,
                                             const Tiling& t) {
  const int64_t P = L.num_planes;
  std::vector<int64_t> meta(mp_meta_words(L.num_layers, P), 0);
  meta[kMpNumLayers] = L.num_layers;
  meta[kMpNumPlanes] = P;
  meta[kMpToChunk] = L.to_chunk ? 1 : 0;
  meta[kMpTileBytes] = t.tile_bytes;
  meta[kMpGather] = t.gather;
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
                                             const Tiling& t) {
  std::vector<int64_t> meta(kBpHeaderWords + L.num_layers, 0);
  geom_to_words(L.geom, meta.data());
  meta[kBpNumLayers] = L.num_layers;
  meta[kBpNumPages] = L.num_pages;
  meta[kBpPageBytes] = row_bytes(L.geom);
  meta[kBpToChunk] = L.to_chunk ? 1 : 0;
  meta[kBpTileBytes] = t.tile_bytes;
  meta[kBpGather] = t.gather;
  for (int64_t l = 0; l < L.num_layers; ++l) {
    meta[kBpHeaderWords + l] = L.layer_ptrs[l];
  }
  return meta;
}

}  // namespace lmca
