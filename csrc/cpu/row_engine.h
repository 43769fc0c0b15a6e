// SPDX-License-Identifier: Apache-2.0
// CPU copy engine: moves slot-addressed rows between paged planes and a chunk.
//
// Every CPU op (LMCache token rows, multi-plane rows, block pages, block KV
// transfer) is lowered by the op layer to one RowJob: L layers x P planes,
// each plane with its own geometry and slot list.  The engine finds maximal
// contiguous runs once per plane, then copies (layer, run) items on
// at::get_num_threads() threads with one memcpy per contiguous span.
#pragma once

#include <cstdint>
#include <vector>

#include "lmcache_ascend/addressing.h"

namespace lmca::cpu {

struct PlaneJob {
  PlaneGeom geom;
  const int64_t* slots = nullptr;  // host array; negative entries are skipped
  int64_t num_slots = 0;           // chunk rows of this plane = num_slots
  int64_t first_row = 0;           // rows < first_row are skipped (prefix)
};

struct RowJob {
  int64_t num_layers = 0;
  std::vector<PlaneJob> planes;           // P
  std::vector<uint8_t*> paged_base;       // [L * P], plane p of layer l
  std::vector<uint8_t*> chunk_base;       // [L * P], row 0 of plane p, layer l
  bool to_chunk = true;                   // true: paged -> chunk (store)
};

// Bytes the job will move (for tests/benchmarks of the planner).
int64_t row_job_bytes(const RowJob& job);

// Runs the job.  Preconditions (validated by the op layer): slots in range,
// pointers non-null, buffers large enough.  Safe to call without the GIL.
void run_row_job(const RowJob& job);

// Plain parallel memcpy list (batched_memcpy); sizes <= 0 are skipped.
void run_memcpy_list(const std::vector<uint8_t*>& dst,
                     const std::vector<const uint8_t*>& src,
                     const std::vector<int64_t>& sizes);

// Distinct threads that run a parallel_for of one item per intra-op thread:
// 1 when this module was built without OpenMP (copies then never use more
// than one core), else torch's current intra-op thread count.
int64_t probe_copy_threads();

}  // namespace lmca::cpu
