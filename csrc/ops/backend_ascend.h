// SPDX-License-Identifier: Apache-2.0
// Host interface of the Ascend backend.
//
// The op layer validates arguments and fills these launch descriptions; the
// Ascend backend (csrc/ascend/launchers.cpp, built only with CANN) turns them
// into AscendC kernel launches on the current torch_npu stream.  CPU-only
// builds link csrc/backend_ascend_stub.cpp instead, whose built() is false;
// the op layer never calls the other functions then.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "lmcache_ascend/addressing.h"

namespace lmca::ascend {

// True when the AscendC kernels and launchers were compiled in.
bool built();

// LMCache token-row formats: num_kv planes (K, V) per layer sharing one slot
// list; plane kv of layer l is at layer_ptrs[l] + v_plane_offset * kv.
struct TokenRowsLaunch {
  PlaneGeom geom;
  int64_t num_kv = 2;
  int64_t v_plane_offset = 0;
  int64_t num_layers = 0;
  at::Tensor layer_ptrs;      // int64 [>= num_layers], device or host
  uint8_t* chunk = nullptr;   // row 0 of plane 0 of layer 0
  bool chunk_on_host = false; // host chunk: staged through device memory
  int64_t chunk_span = 0;     // bytes from `chunk` covering every row
  int64_t chunk_kv_stride = 0;
  int64_t chunk_layer_stride = 0;
  at::Tensor slots;           // int64 [>= num_tokens]
  int64_t num_tokens = 0;
  int64_t skip_prefix = 0;    // tokens [0, skip_prefix) are not moved
  bool to_chunk = true;
};

// Multi-plane rows, packed chunk (see docs/kernels.md).
struct MultiPlaneLaunch {
  int64_t num_layers = 0;
  int64_t num_planes = 0;
  std::vector<int64_t> plane_ptrs;        // [L * P] layer-major
  std::vector<PlaneGeom> geoms;           // [P]
  std::vector<int64_t> slot_offsets;      // [P + 1]
  std::vector<int64_t> plane_prefix;      // [P + 1] bytes; [P] = layer bytes
  at::Tensor slots;                       // int64 concatenated slot lists
  at::Tensor chunk;                       // contiguous, device or host
  bool to_chunk = true;
};

// Whole pages: layer l, page i of the packed chunk <-> block_ids[i] of layer l.
struct BlockPagesLaunch {
  int64_t num_layers = 0;
  std::vector<int64_t> layer_ptrs;  // [L]
  PlaneGeom geom;                   // make_page_geom(...)
  at::Tensor block_ids;             // int64 [N]
  int64_t num_pages = 0;
  at::Tensor chunk;                 // contiguous, device or host
  bool to_chunk = true;
};

void token_rows(const TokenRowsLaunch& launch);
void multi_plane(const MultiPlaneLaunch& launch);
void block_pages(const BlockPagesLaunch& launch);

// Async copy on the current NPU stream; h2d selects the copy kind.
void memcpy_async(uint64_t dst, uint64_t src, int64_t nbytes, bool h2d);

}  // namespace lmca::ascend
