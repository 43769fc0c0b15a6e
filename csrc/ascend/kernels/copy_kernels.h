// SPDX-License-Identifier: Apache-2.0
// AscendC kernel bodies: token rows (LMCache formats), multi-plane rows and
// whole block pages.  Each core takes an even share of the kernel's rows and
// moves them through UB with a depth-1 queue over kUbBuffers tiles, so the
// GM->UB copy of tile k+1 overlaps the UB->GM copy of tile k.
//
// Rows whose slots are scattered over blocks are gathered: a tile holds the
// rows of several runs (consecutive slots inside one block), each run is one
// DataCopyPad on the paged side, and the chunk side of the whole tile, whose
// rows are consecutive, is one burst (or one strided copy).  Rows that do not
// fit a tile, or launches with gathering off, move span by span instead.
//
// Written against a deliberately small AscendC subset (GlobalTensor,
// LocalTensor, TPipe, TQueBind InitBuffer/AllocTensor/EnQue/DeQue/FreeTensor,
// DataCopyPad with DataCopyExtParams/DataCopyPadExtParams, GetBlockIdx,
// GetBlockNum) and free of #ifdef forks: the same bodies are built by CANN's
// ascendc toolchain for the NPU and by the host compiler against the AscendC
// simulation (csrc/sim), whose directory then comes first on the include
// path so that "kernel_operator.h" below resolves to it.  Every offset comes
// from lmcache_ascend/addressing.h, the header the CPU kernels use.
#pragma once

#include "kernel_operator.h"

#ifndef LMCA_INLINE
#define LMCA_INLINE __aicore__ inline
#endif

#include "kernel_meta.h"

namespace lmca {

// Scalar reads of an int64 GM array (pointer tables, slot lists, meta).
struct GmWords {
  mutable AscendC::GlobalTensor<int64_t> gm;
  __aicore__ inline void Bind(GM_ADDR addr, int64_t words) {
    gm.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(addr),
                       static_cast<uint64_t>(words));
  }
  __aicore__ inline int64_t operator()(int64_t i) const {
    return gm.GetValue(static_cast<uint64_t>(i));
  }
};

// Slot of chunk row r of one plane: words[base + r], or -1 below `skip`.
struct SlotList {
  const GmWords* words;
  int64_t base;
  int64_t skip;
  __aicore__ inline int64_t operator()(int64_t r) const {
    return r >= skip ? (*words)(base + r) : -1;
  }
};

__aicore__ inline __gm__ uint8_t* gm_bytes(int64_t address) {
  return reinterpret_cast<__gm__ uint8_t*>(address);
}

__aicore__ inline int64_t ceil_block(int64_t n) {
  return (n + kUbBlockBytes - 1) / kUbBlockBytes * kUbBlockBytes;
}

// Slot usable on the device: slots are validated on the host only when the
// host holds them, so the kernels also skip anything out of range.
__aicore__ inline bool slot_ok(const PlaneGeom& g, int64_t slot) {
  return slot >= 0 && slot < slot_capacity(g);
}

// Moves the rows of one plane between paged GM and chunk GM through UB.
class RowMover {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, bool to_chunk,
                              int64_t tile_bytes, bool gather) {
    tile_ = tile_bytes;
    to_chunk_ = to_chunk;
    gather_ = gather;
    pipe->InitBuffer(queue_, static_cast<uint8_t>(kUbBuffers),
                     static_cast<uint32_t>(tile_));
  }

  // Chunk rows [lo, hi) of plane g: row r has slot slots(r) (skipped unless
  // slot_ok) and lives at chunk + chunk_offset(g, r, seg).
  __aicore__ inline void Move(const PlaneGeom& g, __gm__ uint8_t* paged,
                              __gm__ uint8_t* chunk, int64_t lo, int64_t hi,
                              const SlotList& slots) {
    const int64_t per_tile = RowsPerTile(g);
    int64_t row = lo;
    while (row < hi) {
      const int64_t slot = slots(row);
      if (!slot_ok(g, slot)) {
        ++row;
        continue;
      }
      int64_t n = 1;
      if (per_tile == 0) {
        while (row + n < hi &&
               slot_extends_run(slot + n - 1, slots(row + n), g.block_size)) {
          ++n;
        }
        MoveRun(g, paged, chunk, row, slot, n);
      } else {
        n = BatchRows(g, row, hi, per_tile, slots);
        MoveBatch(g, paged, chunk, row, n, slots);
      }
      row += n;
    }
  }

 private:
  using Tile = AscendC::LocalTensor<uint8_t>;

  // Rows of plane g one tile holds when gathering (0: move span by span).
  // Every row segment takes a 32-byte-aligned UB slot, as DataCopyPad
  // requires of UB addresses.
  __aicore__ inline int64_t RowsPerTile(const PlaneGeom& g) const {
    if (!gather_) return 0;
    const int64_t b = g.seg_bytes;
    if (g.row_stride < b || g.chunk_row_stride < b) return 0;  // overlapping rows
    const int64_t gap_limit = int64_t{0xffffffff};
    if (g.row_stride - b > gap_limit || g.chunk_row_stride - b > gap_limit) return 0;
    const int64_t rows = tile_ / (g.num_segs * ceil_block(b));
    const int64_t cap = kMaxCopyBlocks / g.num_segs;
    return rows < cap ? rows : cap;
  }

  // Rows from `row` (its slot usable) that one tile takes: whole runs while
  // they fit, so gathering never cuts a run a tile could hold; a run longer
  // than a tile fills it and continues in the next.
  __aicore__ inline int64_t BatchRows(const PlaneGeom& g, int64_t row, int64_t hi,
                                      int64_t per_tile, const SlotList& slots) const {
    int64_t n = 0;
    while (n < per_tile && row + n < hi) {
      const int64_t first = slots(row + n);
      if (!slot_ok(g, first)) break;
      const int64_t room = per_tile - n;
      int64_t m = 1;
      while (m < room && row + n + m < hi &&
             slot_extends_run(first + m - 1, slots(row + n + m), g.block_size)) {
        ++m;
      }
      const bool cut = m == room && row + n + m < hi &&
                       slot_extends_run(first + m - 1, slots(row + n + m), g.block_size);
      if (cut && n > 0) break;
      n += m;
    }
    return n;
  }

  // One DataCopyPad of `count` blocks of `len` bytes, `gm_gap` bytes apart
  // in GM, one every `ub_pitch` bytes in UB (from UB byte ub_off); `in`:
  // GM -> UB, else UB -> GM.
  __aicore__ inline void Copy(bool in, Tile& tile, int64_t ub_off,
                              __gm__ uint8_t* gm, int64_t count, int64_t len,
                              int64_t gm_gap, int64_t ub_pitch) {
    AscendC::GlobalTensor<uint8_t> g;
    g.SetGlobalBuffer(gm, static_cast<uint64_t>((count - 1) * (len + gm_gap) + len));
    const int64_t ub_gap_bytes = count > 1 ? ub_pitch - ceil_block(len) : 0;
    const uint32_t ub_gap = static_cast<uint32_t>(ub_gap_bytes / kUbBlockBytes);
    const uint16_t blocks = static_cast<uint16_t>(count);
    const uint32_t bytes = static_cast<uint32_t>(len);
    const uint32_t gap = static_cast<uint32_t>(gm_gap);
    Tile at = tile[static_cast<uint32_t>(ub_off)];
    if (in) {
      const AscendC::DataCopyExtParams p{blocks, bytes, gap, ub_gap, 0};
      const AscendC::DataCopyPadExtParams<uint8_t> pad{false, 0, 0, 0};
      AscendC::DataCopyPad(at, g, p, pad);
    } else {
      const AscendC::DataCopyExtParams p{blocks, bytes, ub_gap, gap, 0};
      AscendC::DataCopyPad(g, at, p);
    }
  }

  // Rows [row0, row0 + rows) of the chunk: one copy when they are adjacent
  // (tight rows), else one strided copy per segment.
  __aicore__ inline void ChunkSide(bool in, Tile& tile, const PlaneGeom& g,
                                   __gm__ uint8_t* chunk, int64_t row0,
                                   int64_t rows) {
    const int64_t b = g.seg_bytes, segs = g.num_segs, pitch = ceil_block(b);
    const bool tight = (segs == 1 || g.chunk_seg_stride == b) &&
                       g.chunk_row_stride == segs * b;
    if (tight && pitch == b) {
      Copy(in, tile, 0, chunk + chunk_offset(g, row0, 0), 1, rows * segs * b, 0, 0);
    } else if (tight) {
      Copy(in, tile, 0, chunk + chunk_offset(g, row0, 0), rows * segs, b, 0, pitch);
    } else {
      for (int64_t s = 0; s < segs; ++s) {
        Copy(in, tile, s * pitch, chunk + chunk_offset(g, row0, s), rows, b,
             g.chunk_row_stride - b, segs * pitch);
      }
    }
  }

  // Runs of rows [row0, row0 + rows), all with usable slots: one copy per
  // run and segment on the paged side.
  __aicore__ inline void PagedSide(bool in, Tile& tile, const PlaneGeom& g,
                                   __gm__ uint8_t* paged, int64_t row0,
                                   int64_t rows, const SlotList& slots) {
    const int64_t b = g.seg_bytes, segs = g.num_segs, pitch = ceil_block(b);
    const bool one_block = segs == 1 && pitch == b && g.row_stride == b;
    int64_t k = 0;
    while (k < rows) {
      const int64_t slot = slots(row0 + k);
      int64_t n = 1;
      while (k + n < rows &&
             slot_extends_run(slot + n - 1, slots(row0 + k + n), g.block_size)) {
        ++n;
      }
      for (int64_t s = 0; s < segs; ++s) {
        __gm__ uint8_t* gm = paged + paged_slot_offset(g, slot, s);
        const int64_t ub_off = (k * segs + s) * pitch;
        if (one_block) {
          Copy(in, tile, ub_off, gm, 1, n * b, 0, 0);
        } else {
          Copy(in, tile, ub_off, gm, n, b, g.row_stride - b, segs * pitch);
        }
      }
      k += n;
    }
  }

  // Gathered tile: a store reads every run into UB and writes the chunk
  // rows at once; a load reads the chunk rows at once and scatters the runs.
  __aicore__ inline void MoveBatch(const PlaneGeom& g, __gm__ uint8_t* paged,
                                   __gm__ uint8_t* chunk, int64_t row0,
                                   int64_t rows, const SlotList& slots) {
    Tile tile = queue_.AllocTensor<uint8_t>();
    if (to_chunk_) {
      PagedSide(true, tile, g, paged, row0, rows, slots);
    } else {
      ChunkSide(true, tile, g, chunk, row0, rows);
    }
    queue_.EnQue(tile);
    tile = queue_.DeQue<uint8_t>();
    if (to_chunk_) {
      ChunkSide(false, tile, g, chunk, row0, rows);
    } else {
      PagedSide(false, tile, g, paged, row0, rows, slots);
    }
    queue_.FreeTensor(tile);
  }

  // Span by span: one run of n rows, per segment one span when rows are
  // adjacent on both sides, else one span per row; spans larger than a tile
  // move in tiles with a tail.
  __aicore__ inline void MoveRun(const PlaneGeom& g, __gm__ uint8_t* paged,
                                 __gm__ uint8_t* chunk, int64_t row,
                                 int64_t slot, int64_t n) {
    const bool one_span = paged_rows_adjacent(g) && chunk_rows_adjacent(g);
    const int64_t pieces = one_span ? 1 : n;
    const int64_t bytes = run_span_bytes(g, one_span ? n : 1);
    for (int64_t seg = 0; seg < g.num_segs; ++seg) {
      for (int64_t k = 0; k < pieces; ++k) {
        __gm__ uint8_t* p = paged + paged_slot_offset(g, slot + k, seg);
        __gm__ uint8_t* c = chunk + chunk_offset(g, row + k, seg);
        if (to_chunk_) {
          Span(c, p, bytes);
        } else {
          Span(p, c, bytes);
        }
      }
    }
  }

  __aicore__ inline void Span(__gm__ uint8_t* dst, __gm__ uint8_t* src,
                              int64_t bytes) {
    for (int64_t done = 0; done < bytes; done += tile_) {
      const int64_t left = bytes - done;
      const int64_t n = left < tile_ ? left : tile_;
      Tile tile = queue_.AllocTensor<uint8_t>();
      Copy(true, tile, 0, src + done, 1, n, 0, 0);
      queue_.EnQue(tile);
      tile = queue_.DeQue<uint8_t>();
      Copy(false, tile, 0, dst + done, 1, n, 0, 0);
      queue_.FreeTensor(tile);
    }
  }

  // VECIN -> VECOUT binding: EnQue/DeQue order the MTE2 (in) and MTE3 (out)
  // pipes, which a plain VECIN TQue would not do for a copy-only kernel.
  // Depth 1: a tile is dequeued before the next is enqueued (TQue简介.md
  // recommends 1 then); the kUbBuffers buffers from InitBuffer still let the
  // copy-in of tile k+1 overlap the copy-out of tile k.
  AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, 1>
      queue_;
  int64_t tile_ = kDefaultUbTileBytes;
  bool to_chunk_ = true;
  bool gather_ = true;
};

// Items [begin, end) of `total` for this core.  Callers return first when
// GetBlockIdx() >= GetBlockNum() (a MIX launch's extra vector cores).
struct CoreShare {
  int64_t begin, end;
  __aicore__ inline explicit CoreShare(int64_t total) {
    const int64_t cores = AscendC::GetBlockNum();
    const int64_t core = AscendC::GetBlockIdx();
    begin = split_begin(total, core, cores);
    end = split_end(total, core, cores);
  }
};

// LMCache token rows: items are (layer, kv, token), token fastest.
class TokenRowsKernel {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, GM_ADDR meta,
                              GM_ADDR layer_ptrs, GM_ADDR chunk,
                              GM_ADDR slots) {
    meta_.Bind(meta, kTokenRowsWords);
    g_ = geom_from_words(meta_, 0);
    num_layers_ = meta_(kTrNumLayers);
    num_kv_ = meta_(kTrNumKv);
    num_tokens_ = meta_(kTrNumTokens);
    skip_ = meta_(kTrSkipPrefix);
    v_offset_ = meta_(kTrVPlaneOffset);
    chunk_kv_stride_ = meta_(kTrChunkKvStride);
    chunk_layer_stride_ = meta_(kTrChunkLayerStride);
    ptrs_.Bind(layer_ptrs, num_layers_);
    slots_.Bind(slots, num_tokens_);
    chunk_ = reinterpret_cast<__gm__ uint8_t*>(chunk);
    mover_.Init(pipe, meta_(kTrToChunk) != 0,
                tile_bytes_or_default(meta_(kTrTileBytes)), meta_(kTrGather) != 0);
  }

  __aicore__ inline void Process() {
    const CoreShare share(num_layers_ * num_kv_ * num_tokens_);
    const SlotList slots{&slots_, 0, skip_};
    int64_t item = share.begin;
    while (item < share.end) {
      const int64_t plane = item / num_tokens_;  // layer * num_kv + kv
      const int64_t t0 = item % num_tokens_;
      const int64_t left = share.end - item;
      const int64_t t1 = num_tokens_ - t0 < left ? num_tokens_ : t0 + left;
      const int64_t layer = plane / num_kv_, kv = plane % num_kv_;
      mover_.Move(g_, gm_bytes(ptrs_(layer)) + kv * v_offset_,
                  chunk_ + lmc_chunk_plane_offset(kv, layer, chunk_kv_stride_,
                                                  chunk_layer_stride_),
                  t0, t1, slots);
      item += t1 - t0;
    }
  }

 private:
  GmWords meta_, ptrs_, slots_;
  PlaneGeom g_;
  int64_t num_layers_, num_kv_, num_tokens_, skip_, v_offset_;
  int64_t chunk_kv_stride_, chunk_layer_stride_;
  __gm__ uint8_t* chunk_;
  RowMover mover_;
};

// Multi-plane rows: items are (layer, j) with j indexing the concatenated
// slot lists, which is also the packed chunk's row order within a layer.
class MultiPlaneKernel {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, GM_ADDR meta,
                              GM_ADDR chunk, GM_ADDR slots) {
    meta_.Bind(meta, kMpHeaderWords);
    num_layers_ = meta_(kMpNumLayers);
    num_planes_ = meta_(kMpNumPlanes);
    meta_.Bind(meta, mp_meta_words(num_layers_, num_planes_));
    rows_ = meta_(mp_offsets_base(num_planes_) + num_planes_);
    layer_bytes_ = meta_(mp_prefix_base(num_planes_) + num_planes_);
    slots_.Bind(slots, rows_);
    chunk_ = reinterpret_cast<__gm__ uint8_t*>(chunk);
    mover_.Init(pipe, meta_(kMpToChunk) != 0,
                tile_bytes_or_default(meta_(kMpTileBytes)), meta_(kMpGather) != 0);
  }

  __aicore__ inline void Process() {
    const CoreShare share(num_layers_ * rows_);
    int64_t item = share.begin;
    while (item < share.end) {
      const int64_t layer = item / rows_;
      const int64_t j = item % rows_;
      SelectPlane(j);
      const int64_t left = share.end - item;
      const int64_t j1 = plane_end_ - j < left ? plane_end_ : j + left;
      const int64_t base = mp_chunk_plane_offset(
          layer, layer_bytes_, meta_(mp_prefix_base(num_planes_) + plane_));
      const SlotList slots{&slots_, plane_begin_, 0};
      mover_.Move(g_, gm_bytes(meta_(mp_ptrs_base(num_planes_) +
                                     layer * num_planes_ + plane_)),
                  chunk_ + base, j - plane_begin_, j1 - plane_begin_, slots);
      item += j1 - j;
    }
  }

 private:
  // Caches the geometry of the plane owning concatenated row j.
  __aicore__ inline void SelectPlane(int64_t j) {
    if (j >= plane_begin_ && j < plane_end_) return;
    const int64_t offs = mp_offsets_base(num_planes_);
    plane_ = 0;
    while (meta_(offs + plane_ + 1) <= j) ++plane_;
    plane_begin_ = meta_(offs + plane_);
    plane_end_ = meta_(offs + plane_ + 1);
    g_ = geom_from_words(meta_, mp_geom_base(plane_));
  }

  GmWords meta_, slots_;
  PlaneGeom g_;
  int64_t num_layers_, num_planes_, rows_, layer_bytes_;
  int64_t plane_ = 0, plane_begin_ = 0, plane_end_ = 0;
  __gm__ uint8_t* chunk_;
  RowMover mover_;
};

// Whole pages: items are (layer, page index); a tight pool makes pages of
// consecutive block ids one run, pages larger than a tile move in tiles.
class BlockPagesKernel {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, GM_ADDR meta,
                              GM_ADDR chunk, GM_ADDR block_ids) {
    meta_.Bind(meta, kBpHeaderWords);
    g_ = geom_from_words(meta_, 0);
    num_layers_ = meta_(kBpNumLayers);
    num_pages_ = meta_(kBpNumPages);
    page_bytes_ = meta_(kBpPageBytes);
    meta_.Bind(meta, kBpHeaderWords + num_layers_);
    ids_.Bind(block_ids, num_pages_);
    chunk_ = reinterpret_cast<__gm__ uint8_t*>(chunk);
    mover_.Init(pipe, meta_(kBpToChunk) != 0,
                tile_bytes_or_default(meta_(kBpTileBytes)), meta_(kBpGather) != 0);
  }

  __aicore__ inline void Process() {
    const CoreShare share(num_layers_ * num_pages_);
    const SlotList ids{&ids_, 0, 0};
    int64_t item = share.begin;
    while (item < share.end) {
      const int64_t layer = item / num_pages_;
      const int64_t i0 = item % num_pages_;
      const int64_t left = share.end - item;
      const int64_t i1 = num_pages_ - i0 < left ? num_pages_ : i0 + left;
      mover_.Move(g_, gm_bytes(meta_(kBpHeaderWords + layer)),
                  chunk_ + page_chunk_offset(layer, num_pages_, 0, page_bytes_),
                  i0, i1, ids);
      item += i1 - i0;
    }
  }

 private:
  GmWords meta_, ids_;
  PlaneGeom g_;
  int64_t num_layers_, num_pages_, page_bytes_;
  __gm__ uint8_t* chunk_;
  RowMover mover_;
};

}  // namespace lmca
