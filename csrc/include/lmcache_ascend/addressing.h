// SPDX-License-Identifier: Apache-2.0
// Addressing math shared by every backend of lmcache_ascend.ops.
//
// The CPU kernels (csrc/cpu), the host-side validation (csrc/ops_*.cpp) and
// the AscendC kernels (csrc/ascend) all compute paged and chunk byte offsets
// with the functions below, so the offsets the CPU tests exercise are the
// offsets the NPU uses.  Plain C++: no STL, no exceptions, no allocation, so
// the header also compiles as AscendC device code; the AscendC translation
// unit defines LMCA_INLINE as `__aicore__ inline` before including it.
//
// Units: everything is in BYTES.  A "plane" is one paged buffer family (K of
// a layer, V of a layer, one multi-plane tensor, or a block-page pool); a row
// is what one slot addresses in it (a token's K row, a 584-byte DSA row, a
// whole page).  A row may be split into `num_segs` equal segments that are
// not adjacent in the paged buffer (HND: one segment per head).
#pragma once

#include <stdint.h>

#ifndef LMCA_INLINE
#define LMCA_INLINE inline
#endif

namespace lmca {

// LMCache 0.5.6 `lmcache_native.EngineKVFormat` values this code supports.
enum KvFormat : int64_t {
  kFmtTwoNbBsNhHs = 1,  // NL_X_TWO_NB_BS_NH_HS  per layer [2, NB, BS, NH, HS]
  kFmtNbTwoBsNhHs = 2,  // NL_X_NB_TWO_BS_NH_HS  per layer [NB, 2, BS, NH, HS]
  kFmtNbBsHs = 3,       // NL_X_NB_BS_HS (MLA)   per layer [NB, BS, HS]
  kFmtTwoNbNhBsHs = 6,  // NL_X_TWO_NB_NH_BS_HS  per layer [2, NB, NH, BS, HS]
  kFmtNbTwoNhBsHs = 7,  // NL_X_NB_TWO_NH_BS_HS  per layer [NB, 2, NH, BS, HS]
};

// Geometry of one plane, paged side and chunk side.
struct PlaneGeom {
  int64_t block_size;        // rows (slots) per block, >= 1
  int64_t num_blocks;        // blocks in the pool (bounds checks)
  int64_t block_stride;      // paged bytes between block b and b+1 (may pad)
  int64_t row_stride;        // paged bytes between row r and r+1 of a block
  int64_t num_segs;          // segments per row (HND: heads), >= 1
  int64_t seg_bytes;         // bytes of one segment; row = num_segs*seg_bytes
  int64_t seg_stride;        // paged bytes between segment s and s+1 of a row
  int64_t chunk_row_stride;  // chunk bytes between row i and i+1
  int64_t chunk_seg_stride;  // chunk bytes between segment s and s+1 of a row
};

// ---- slot -> (block, row) -> byte offset ----------------------------------

LMCA_INLINE int64_t slot_block(int64_t slot, int64_t block_size) {
  return slot / block_size;
}

LMCA_INLINE int64_t slot_row(int64_t slot, int64_t block_size) {
  return slot % block_size;
}

LMCA_INLINE int64_t block_first_slot(int64_t block, int64_t block_size) {
  return block * block_size;
}

LMCA_INLINE int64_t row_bytes(const PlaneGeom& g) {
  return g.num_segs * g.seg_bytes;
}

// Number of addressable slots of a plane (valid slots are [0, capacity)).
LMCA_INLINE int64_t slot_capacity(const PlaneGeom& g) {
  return g.num_blocks * g.block_size;
}

// Byte offset of (block, row, segment) from the plane's base pointer.
LMCA_INLINE int64_t paged_offset(const PlaneGeom& g, int64_t block, int64_t row,
                                 int64_t seg) {
  return block * g.block_stride + row * g.row_stride + seg * g.seg_stride;
}

// Byte offset of segment `seg` of slot `slot` from the plane's base pointer.
LMCA_INLINE int64_t paged_slot_offset(const PlaneGeom& g, int64_t slot,
                                      int64_t seg) {
  return paged_offset(g, slot_block(slot, g.block_size),
                      slot_row(slot, g.block_size), seg);
}

// Byte offset of segment `seg` of chunk row `row` from the plane's chunk base.
LMCA_INLINE int64_t chunk_offset(const PlaneGeom& g, int64_t row,
                                 int64_t seg) {
  return row * g.chunk_row_stride + seg * g.chunk_seg_stride;
}

// ---- contiguous runs -------------------------------------------------------
// A run is a stretch of consecutive chunk rows whose slots are consecutive
// inside one block; for each segment it is one contiguous byte span on both
// sides when the two predicates below hold.

LMCA_INLINE bool slot_extends_run(int64_t prev_slot, int64_t slot,
                                  int64_t block_size) {
  return prev_slot >= 0 && slot == prev_slot + 1 &&
         slot_row(slot, block_size) != 0;
}

LMCA_INLINE bool paged_rows_adjacent(const PlaneGeom& g) {
  return g.row_stride == g.seg_bytes;
}

LMCA_INLINE bool chunk_rows_adjacent(const PlaneGeom& g) {
  return g.chunk_row_stride == g.seg_bytes;
}

// Bytes one span covers for a run of n rows: the whole run when both sides
// are adjacent, else a single row segment.
LMCA_INLINE int64_t run_span_bytes(const PlaneGeom& g, int64_t n) {
  return (paged_rows_adjacent(g) && chunk_rows_adjacent(g)) ? n * g.seg_bytes
                                                            : g.seg_bytes;
}

// ---- LMCache token-row formats ---------------------------------------------

LMCA_INLINE bool kv_format_supported(int64_t fmt) {
  return fmt == kFmtTwoNbBsNhHs || fmt == kFmtNbTwoBsNhHs ||
         fmt == kFmtNbBsHs || fmt == kFmtTwoNbNhBsHs || fmt == kFmtNbTwoNhBsHs;
}

LMCA_INLINE bool kv_format_is_mla(int64_t fmt) { return fmt == kFmtNbBsHs; }

LMCA_INLINE bool kv_format_is_hnd(int64_t fmt) {
  return fmt == kFmtTwoNbNhBsHs || fmt == kFmtNbTwoNhBsHs;
}

// K and V live in two separate [NB, ...] halves of the layer buffer.
LMCA_INLINE bool kv_format_two_major(int64_t fmt) {
  return fmt == kFmtTwoNbBsNhHs || fmt == kFmtTwoNbNhBsHs;
}

LMCA_INLINE int64_t kv_format_num_kv(int64_t fmt) {
  return kv_format_is_mla(fmt) ? 1 : 2;
}

// Bytes of one K (or V) half of a block: BS * NH * HS elements.
LMCA_INLINE int64_t kv_half_block_bytes(int64_t block_size, int64_t num_heads,
                                        int64_t head_bytes) {
  return block_size * num_heads * head_bytes;
}

// Tight (unpadded) bytes between consecutive blocks of one layer buffer.
LMCA_INLINE int64_t kv_tight_block_stride(int64_t fmt, int64_t block_size,
                                          int64_t num_heads,
                                          int64_t head_bytes) {
  const int64_t half = kv_half_block_bytes(block_size, num_heads, head_bytes);
  return (fmt == kFmtNbTwoBsNhHs || fmt == kFmtNbTwoNhBsHs) ? 2 * half : half;
}

// Byte offset of the V plane from the layer base (K plane is at 0).
// Two-major: V follows all NB blocks of K, so padded blocks move it too.
// Blocks-first: V follows K inside each block.
LMCA_INLINE int64_t kv_plane_offset(int64_t fmt, int64_t kv,
                                    int64_t num_blocks, int64_t block_size,
                                    int64_t num_heads, int64_t head_bytes,
                                    int64_t block_stride) {
  if (kv == 0) return 0;
  if (kv_format_two_major(fmt)) return num_blocks * block_stride;
  return kv_half_block_bytes(block_size, num_heads, head_bytes);
}

// Paged-side geometry of the K (or V) plane of one layer, chunk side with one
// token row of NH*HS bytes every `chunk_row_stride` bytes.  block_stride == 0
// selects the tight stride.
LMCA_INLINE PlaneGeom make_kv_plane_geom(int64_t fmt, int64_t num_blocks,
                                         int64_t block_size, int64_t num_heads,
                                         int64_t head_bytes,
                                         int64_t block_stride,
                                         int64_t chunk_row_stride) {
  PlaneGeom g;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.block_stride = block_stride > 0
                       ? block_stride
                       : kv_tight_block_stride(fmt, block_size, num_heads,
                                               head_bytes);
  g.chunk_row_stride = chunk_row_stride;
  if (kv_format_is_hnd(fmt)) {
    // [NH, BS, HS] inside a block: a token row is NH segments of HS bytes.
    g.num_segs = num_heads;
    g.seg_bytes = head_bytes;
    g.seg_stride = block_size * head_bytes;
    g.row_stride = head_bytes;
    g.chunk_seg_stride = head_bytes;
  } else {
    // [BS, NH, HS] (or [BS, HS] for MLA): a token row is contiguous.
    g.num_segs = 1;
    g.seg_bytes = num_heads * head_bytes;
    g.seg_stride = 0;
    g.row_stride = num_heads * head_bytes;
    g.chunk_seg_stride = 0;
  }
  return g;
}

// Chunk byte offset of plane kv of layer `layer` in an LMCache KV tensor
// [num_kv, NL, T, H] with byte strides (kv_stride, layer_stride, .).
LMCA_INLINE int64_t lmc_chunk_plane_offset(int64_t kv, int64_t layer,
                                           int64_t kv_stride,
                                           int64_t layer_stride) {
  return kv * kv_stride + layer * layer_stride;
}

// ---- multi-plane rows -------------------------------------------------------

// One plane of a multi-plane layer: rows of row_bytes, block_size rows per
// block, blocks block_stride bytes apart (>= block_size * row_bytes).
LMCA_INLINE PlaneGeom make_row_plane_geom(int64_t block_size,
                                          int64_t block_stride,
                                          int64_t row_bytes_,
                                          int64_t num_blocks) {
  PlaneGeom g;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.block_stride = block_stride;
  g.row_stride = row_bytes_;
  g.num_segs = 1;
  g.seg_bytes = row_bytes_;
  g.seg_stride = 0;
  g.chunk_row_stride = row_bytes_;
  g.chunk_seg_stride = 0;
  return g;
}

// Packed multi-plane chunk: layer-major, then plane-major rows.  Layer l,
// plane p, row i lives at
//   l * layer_bytes + plane_prefix_bytes[p] + i * row_bytes[p]
// with plane_prefix_bytes[p] = sum_{q<p} n_q * row_bytes[q] and
// layer_bytes = plane_prefix_bytes[P].
LMCA_INLINE int64_t mp_plane_bytes(int64_t num_rows, int64_t row_bytes_) {
  return num_rows * row_bytes_;
}

LMCA_INLINE int64_t mp_chunk_plane_offset(int64_t layer, int64_t layer_bytes,
                                          int64_t plane_prefix_bytes) {
  return layer * layer_bytes + plane_prefix_bytes;
}

// ---- whole block pages -----------------------------------------------------

// A page pool seen as a plane whose rows are pages.  Padded pools have one
// row per block; a tight pool (stride == page) is one block of num_blocks
// rows, so that pages of consecutive block ids form one contiguous run.
// Either way the offset of page `id` is id * block_stride.
LMCA_INLINE PlaneGeom make_page_geom(int64_t page_bytes, int64_t block_stride,
                                     int64_t num_blocks) {
  if (block_stride == page_bytes) {
    return make_row_plane_geom(num_blocks, num_blocks * page_bytes, page_bytes,
                               1);
  }
  return make_row_plane_geom(1, block_stride, page_bytes, num_blocks);
}

// Packed page chunk: layer-major, then pages in block-id order.
LMCA_INLINE int64_t page_chunk_offset(int64_t layer, int64_t num_pages,
                                      int64_t page_index, int64_t page_bytes) {
  return layer * num_pages * page_bytes + page_index * page_bytes;
}

// ---- work split ------------------------------------------------------------

// Items [begin, end) of `total` handled by worker `idx` of `count` (even split,
// the first total % count workers take one extra item).
LMCA_INLINE int64_t split_begin(int64_t total, int64_t idx, int64_t count) {
  const int64_t base = total / count;
  const int64_t extra = total % count;
  return idx * base + (idx < extra ? idx : extra);
}

LMCA_INLINE int64_t split_end(int64_t total, int64_t idx, int64_t count) {
  return split_begin(total, idx + 1, count);
}

}  // namespace lmca
