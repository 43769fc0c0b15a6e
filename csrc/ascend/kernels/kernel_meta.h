// SPDX-License-Identifier: Apache-2.0
// Word layout of the int64 "meta" array each AscendC kernel receives in GM.
//
// Host launchers pack it (launch_meta.h; csrc/ascend/launchers.cpp), the
// kernels (copy_kernels.h) unpack it with geom_from_words; both include this
// header, so the two sides cannot drift.  Plain C++, usable as AscendC
// device code (LMCA_INLINE is defined by the kernel TU).
#pragma once

#include "lmcache_ascend/addressing.h"

namespace lmca {

// ---- UB tiling -------------------------------------------------------------
// The copy kernels stage data through UB in tiles, kUbBuffers tiles at once
// (double buffering).  The tile size is tiling data: the launcher derives it
// from the SoC's UB capacity (GetCoreMemSize) with launch_tile_bytes(),
// checks it with tile_bytes_error(), and passes it in the meta word
// k*TileBytes.  A word left 0 gets kDefaultUbTileBytes, which fits the
// 192 KiB UB of Atlas A2/A3 vector cores only.
constexpr int64_t kUbBuffers = 2;
constexpr int64_t kUbBlockBytes = 32;  // UB addresses/sizes are in 32 B blocks
constexpr int64_t kDefaultUbTileBytes = 64 * 1024;
// DataCopyExtParams.blockLen is 21 bits wide: one copy moves < 2 MiB.
constexpr int64_t kMaxCopyBytes = (int64_t{1} << 21) - 1;
// DataCopyExtParams.blockCount is at most 4095.
constexpr int64_t kMaxCopyBlocks = 4095;
// UB the launcher leaves unused: the tiles never take the whole UB, so a
// framework or runtime reservation (e.g. for DumpTensor/printf) or a later
// small buffer still fits.  Capped at 1/8 of the UB for the tiny UBs the
// simulation tests with.
constexpr int64_t kUbHeadroomBytes = 8 * 1024;

// Largest tile such that kUbBuffers tiles fit in ub_bytes (0 if none does).
LMCA_INLINE int64_t ub_tile_bytes(int64_t ub_bytes) {
  int64_t tile = ub_bytes / kUbBuffers / kUbBlockBytes * kUbBlockBytes;
  const int64_t cap = kMaxCopyBytes / kUbBlockBytes * kUbBlockBytes;
  return tile < cap ? tile : cap;
}

LMCA_INLINE int64_t ub_headroom_bytes(int64_t ub_bytes) {
  const int64_t eighth = ub_bytes / 8 / kUbBlockBytes * kUbBlockBytes;
  return eighth < kUbHeadroomBytes ? eighth : kUbHeadroomBytes;
}

// The tile a launcher uses for a UB of ub_bytes (GetCoreMemSize(UB)).
LMCA_INLINE int64_t launch_tile_bytes(int64_t ub_bytes) {
  return ub_tile_bytes(ub_bytes - ub_headroom_bytes(ub_bytes));
}

// Host check of a tile word: 0 if usable on a UB of ub_bytes, else which
// condition fails (1: not a positive multiple of 32; 2: kUbBuffers tiles
// exceed the UB; 3: above one copy's blockLen limit).
LMCA_INLINE int tile_bytes_error(int64_t tile, int64_t ub_bytes) {
  if (tile <= 0 || tile % kUbBlockBytes != 0) return 1;
  if (tile * kUbBuffers > ub_bytes) return 2;
  if (tile > kMaxCopyBytes) return 3;
  return 0;
}

LMCA_INLINE int64_t tile_bytes_or_default(int64_t word) {
  return word > 0 ? word : kDefaultUbTileBytes;
}

// PlaneGeom as kGeomWords consecutive int64 words.
enum GeomWord : int64_t {
  kGwBlockSize = 0,
  kGwNumBlocks,
  kGwBlockStride,
  kGwRowStride,
  kGwNumSegs,
  kGwSegBytes,
  kGwSegStride,
  kGwChunkRowStride,
  kGwChunkSegStride,
  kGeomWords
};

LMCA_INLINE void geom_to_words(const PlaneGeom& g, int64_t* w) {
  w[kGwBlockSize] = g.block_size;
  w[kGwNumBlocks] = g.num_blocks;
  w[kGwBlockStride] = g.block_stride;
  w[kGwRowStride] = g.row_stride;
  w[kGwNumSegs] = g.num_segs;
  w[kGwSegBytes] = g.seg_bytes;
  w[kGwSegStride] = g.seg_stride;
  w[kGwChunkRowStride] = g.chunk_row_stride;
  w[kGwChunkSegStride] = g.chunk_seg_stride;
}

// `read(i)` returns word i of the meta array (GM reader on the device).
template <typename Reader>
LMCA_INLINE PlaneGeom geom_from_words(const Reader& read, int64_t base) {
  PlaneGeom g;
  g.block_size = read(base + kGwBlockSize);
  g.num_blocks = read(base + kGwNumBlocks);
  g.block_stride = read(base + kGwBlockStride);
  g.row_stride = read(base + kGwRowStride);
  g.num_segs = read(base + kGwNumSegs);
  g.seg_bytes = read(base + kGwSegBytes);
  g.seg_stride = read(base + kGwSegStride);
  g.chunk_row_stride = read(base + kGwChunkRowStride);
  g.chunk_seg_stride = read(base + kGwChunkSegStride);
  return g;
}

// Token-row kernel (LMCache formats): geometry, then these words.
enum TokenRowsWord : int64_t {
  kTrNumLayers = kGeomWords,
  kTrNumKv,
  kTrNumTokens,
  kTrSkipPrefix,
  kTrVPlaneOffset,
  kTrChunkKvStride,
  kTrChunkLayerStride,
  kTrToChunk,
  kTrTileBytes,
  kTrGather,  // 1: gather rows of several runs per tile (see copy_kernels.h)
  kTokenRowsWords
};

// Multi-plane kernel: header words, then P geometries, then slot offsets
// [P + 1], plane prefix bytes [P + 1] and plane pointers [L * P].
enum MultiPlaneWord : int64_t {
  kMpNumLayers = 0,
  kMpNumPlanes,
  kMpToChunk,
  kMpTileBytes,
  kMpGather,
  kMpHeaderWords
};

LMCA_INLINE int64_t mp_geom_base(int64_t plane) {
  return kMpHeaderWords + plane * kGeomWords;
}
LMCA_INLINE int64_t mp_offsets_base(int64_t num_planes) {
  return kMpHeaderWords + num_planes * kGeomWords;
}
LMCA_INLINE int64_t mp_prefix_base(int64_t num_planes) {
  return mp_offsets_base(num_planes) + num_planes + 1;
}
LMCA_INLINE int64_t mp_ptrs_base(int64_t num_planes) {
  return mp_prefix_base(num_planes) + num_planes + 1;
}
LMCA_INLINE int64_t mp_meta_words(int64_t num_layers, int64_t num_planes) {
  return mp_ptrs_base(num_planes) + num_layers * num_planes;
}

// Block-page kernel: geometry, then these words, then layer pointers [L].
enum BlockPagesWord : int64_t {
  kBpNumLayers = kGeomWords,
  kBpNumPages,
  kBpPageBytes,
  kBpToChunk,
  kBpTileBytes,
  kBpGather,
  kBpHeaderWords
};

}  // namespace lmca
