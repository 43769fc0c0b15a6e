// SPDX-License-Identifier: Apache-2.0
// AscendC kernel bodies: token rows (LMCache formats), multi-plane rows and
// whole block pages.  All three move "runs" (consecutive chunk rows whose
// slots are consecutive inside one block) through UB with a depth-2 queue, so
// the GM->UB copy of tile k+1 overlaps the UB->GM copy of tile k.
//
// Written against a deliberately small AscendC subset (GlobalTensor,
// LocalTensor, TPipe, TQueBind InitBuffer/AllocTensor/EnQue/DeQue/FreeTensor,
// DataCopyPad with DataCopyExtParams/DataCopyPadExtParams, GetBlockIdx,
// GetBlockNum) and free of #ifdef forks: the same bodies are built by CANN's
// ascendc toolchain for the NPU and by the host compiler against the AscendC
// simulation (csrc/ascend/sim), whose directory then comes first on the
// include path so that "kernel_operator.h" below resolves to it.  Every
// offset comes from lmcache_ascend/addressing.h, the header the CPU kernels
// use.
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
    gm.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(addr), words);
  }
  __aicore__ inline int64_t operator()(int64_t i) const { return gm.GetValue(i); }
};

__aicore__ inline __gm__ uint8_t* gm_bytes(int64_t address) {
  return reinterpret_cast<__gm__ uint8_t*>(address);
}

// Copies byte spans GM -> UB -> GM in tiles of tile_ bytes (host tiling,
// see ub_tile_bytes); the last tile of a span (or a span smaller than a
// tile, e.g. a 6-byte row) is a tail copy of the remaining bytes.
// DataCopyPad handles lengths that are not multiples of 32 bytes on the GM
// side.
class UbCopier {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, int64_t tile_bytes) {
    tile_ = tile_bytes;
    pipe->InitBuffer(queue_, kUbBuffers, static_cast<uint32_t>(tile_));
  }

  __aicore__ inline void Copy(__gm__ uint8_t* dst, __gm__ uint8_t* src,
                              int64_t bytes) {
    for (int64_t done = 0; done < bytes; done += tile_) {
      const int64_t left = bytes - done;
      const uint32_t n = static_cast<uint32_t>(left < tile_ ? left : tile_);
      AscendC::GlobalTensor<uint8_t> in;
      AscendC::GlobalTensor<uint8_t> out;
      in.SetGlobalBuffer(src + done, n);
      out.SetGlobalBuffer(dst + done, n);
      const AscendC::DataCopyExtParams params{1, n, 0, 0, 0};
      const AscendC::DataCopyPadExtParams<uint8_t> pad{false, 0, 0, 0};
      AscendC::LocalTensor<uint8_t> tile = queue_.AllocTensor<uint8_t>();
      AscendC::DataCopyPad(tile, in, params, pad);
      queue_.EnQue(tile);
      tile = queue_.DeQue<uint8_t>();
      AscendC::DataCopyPad(out, tile, params);
      queue_.FreeTensor(tile);
    }
  }

 private:
  // VECIN -> VECOUT binding: EnQue/DeQue order the MTE2 (in) and MTE3 (out)
  // pipes, which a plain VECIN TQue would not do for a copy-only kernel.
  // Depth 1: a tile is dequeued before the next is enqueued (the docs
  // recommend 1 then); the kUbBuffers buffers from InitBuffer still let the
  // copy-in of tile k+1 overlap the copy-out of tile k.
  AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, 1>
      queue_;
  int64_t tile_ = kDefaultUbTileBytes;
};

// Moves one run of n rows (chunk rows row.., slots slot..) of one plane.
class RunMover {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, bool to_chunk,
                              int64_t tile_bytes) {
    copier_.Init(pipe, tile_bytes);
    to_chunk_ = to_chunk;
  }

  __aicore__ inline void Move(const PlaneGeom& g, __gm__ uint8_t* paged,
                              __gm__ uint8_t* chunk, int64_t row, int64_t slot,
                              int64_t n) {
    const bool one_span = paged_rows_adjacent(g) && chunk_rows_adjacent(g);
    const int64_t pieces = one_span ? 1 : n;
    const int64_t bytes = run_span_bytes(g, one_span ? n : 1);
    for (int64_t seg = 0; seg < g.num_segs; ++seg) {
      for (int64_t k = 0; k < pieces; ++k) {
        __gm__ uint8_t* p = paged + paged_slot_offset(g, slot + k, seg);
        __gm__ uint8_t* c = chunk + chunk_offset(g, row + k, seg);
        if (to_chunk_) {
          copier_.Copy(c, p, bytes);
        } else {
          copier_.Copy(p, c, bytes);
        }
      }
    }
  }

 private:
  UbCopier copier_;
  bool to_chunk_ = true;
};

// Slot usable on the device: slots are validated on the host only when the
// host holds them, so the kernels also skip anything out of range.
__aicore__ inline bool slot_ok(const PlaneGeom& g, int64_t slot) {
  return slot >= 0 && slot < slot_capacity(g);
}

// LMCache token rows: items are (layer, kv, token), token fastest; each core
// takes an even share and merges consecutive tokens of one plane into runs.
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
                tile_bytes_or_default(meta_(kTrTileBytes)));
  }

  __aicore__ inline void Process() {
    const int64_t total = num_layers_ * num_kv_ * num_tokens_;
    const int64_t cores = AscendC::GetBlockNum();
    const int64_t core = AscendC::GetBlockIdx();
    const int64_t end = split_end(total, core, cores);
    int64_t item = split_begin(total, core, cores);
    while (item < end) {
      const int64_t t = item % num_tokens_;
      const int64_t plane = item / num_tokens_;  // layer * num_kv + kv
      const int64_t slot = t >= skip_ ? slots_(t) : -1;
      if (!slot_ok(g_, slot)) {
        ++item;
        continue;
      }
      int64_t n = 1;
      while (item + n < end && t + n < num_tokens_ &&
             slot_extends_run(slot + n - 1, slots_(t + n), g_.block_size)) {
        ++n;
      }
      const int64_t layer = plane / num_kv_;
      const int64_t kv = plane % num_kv_;
      mover_.Move(g_, gm_bytes(ptrs_(layer)) + kv * v_offset_,
                  chunk_ + lmc_chunk_plane_offset(kv, layer, chunk_kv_stride_,
                                                  chunk_layer_stride_),
                  t, slot, n);
      item += n;
    }
  }

 private:
  GmWords meta_, ptrs_, slots_;
  PlaneGeom g_;
  int64_t num_layers_, num_kv_, num_tokens_, skip_, v_offset_;
  int64_t chunk_kv_stride_, chunk_layer_stride_;
  __gm__ uint8_t* chunk_;
  RunMover mover_;
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
                tile_bytes_or_default(meta_(kMpTileBytes)));
  }

  __aicore__ inline void Process() {
    const int64_t total = num_layers_ * rows_;
    const int64_t cores = AscendC::GetBlockNum();
    const int64_t core = AscendC::GetBlockIdx();
    const int64_t end = split_end(total, core, cores);
    int64_t item = split_begin(total, core, cores);
    while (item < end) {
      const int64_t layer = item / rows_;
      const int64_t j = item % rows_;
      SelectPlane(j);
      const int64_t slot = slots_(j);
      if (!slot_ok(g_, slot)) {
        ++item;
        continue;
      }
      int64_t n = 1;
      while (item + n < end && j + n < plane_end_ &&
             slot_extends_run(slot + n - 1, slots_(j + n), g_.block_size)) {
        ++n;
      }
      const int64_t base = mp_chunk_plane_offset(
          layer, layer_bytes_, meta_(mp_prefix_base(num_planes_) + plane_));
      mover_.Move(g_, gm_bytes(meta_(mp_ptrs_base(num_planes_) +
                                     layer * num_planes_ + plane_)),
                  chunk_ + base, j - plane_begin_, slot, n);
      item += n;
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
  RunMover mover_;
};

// Whole pages: items are (layer, page index); a tight pool merges pages of
// consecutive block ids into one run, pages larger than a UB tile are copied
// in tiles with a tail.
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
                tile_bytes_or_default(meta_(kBpTileBytes)));
  }

  __aicore__ inline void Process() {
    const int64_t total = num_layers_ * num_pages_;
    const int64_t cores = AscendC::GetBlockNum();
    const int64_t core = AscendC::GetBlockIdx();
    const int64_t end = split_end(total, core, cores);
    int64_t item = split_begin(total, core, cores);
    while (item < end) {
      const int64_t layer = item / num_pages_;
      const int64_t i = item % num_pages_;
      const int64_t id = ids_(i);
      if (!slot_ok(g_, id)) {
        ++item;
        continue;
      }
      int64_t n = 1;
      while (item + n < end && i + n < num_pages_ &&
             slot_extends_run(id + n - 1, ids_(i + n), g_.block_size)) {
        ++n;
      }
      mover_.Move(g_, gm_bytes(meta_(kBpHeaderWords + layer)),
                  chunk_ + page_chunk_offset(layer, num_pages_, 0, page_bytes_),
                  i, id, n);
      item += n;
    }
  }

 private:
  GmWords meta_, ids_;
  PlaneGeom g_;
  int64_t num_layers_, num_pages_, page_bytes_;
  __gm__ uint8_t* chunk_;
  RunMover mover_;
};

}  // namespace lmca
