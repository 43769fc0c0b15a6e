// SPDX-License-Identifier: Apache-2.0
// The ops exported by lmcache_ascend.ops (bound in pybind.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

namespace py = pybind11;

namespace lmca::ops {

// ---- LMCache 0.5.6 DeviceOps surface (ops_lmcache.cpp) ----
void multi_layer_kv_transfer(const at::Tensor& key_value,
                             py::handle key_value_ptrs,
                             const at::Tensor& slot_mapping,
                             py::handle paged_memory_device,
                             int64_t page_buffer_size, py::handle direction,
                             py::handle engine_kv_format, int64_t block_size,
                             int64_t head_size, int64_t skip_prefix_n_tokens,
                             int64_t block_stride_elems);

void single_layer_kv_transfer(const at::Tensor& lmc_key_value_cache,
                              const at::Tensor& vllm_key_value_cache,
                              const at::Tensor& slot_mapping,
                              py::handle direction,
                              py::handle engine_kv_format, bool token_major);

void multi_layer_block_kv_transfer(py::handle paged_buffer_ptrs_tensor,
                                   py::handle lmcache_objects_ptrs,
                                   py::handle block_ids, py::handle device,
                                   py::handle direction, py::handle shape_desc,
                                   int64_t lmcache_chunk_size,
                                   py::handle engine_kv_format,
                                   int64_t skip_prefix_n_blocks);

void lmcache_memcpy_async(py::handle dest, py::handle src, int64_t nbytes,
                          py::handle direction, int64_t host_buffer_offset,
                          int64_t host_buffer_alignments);

void batched_memcpy(py::handle src_ptrs, py::handle dst_ptrs,
                    py::handle sizes);

// ---- multi-plane and block-page ops (ops_planes.cpp) ----
void multi_plane_kv_transfer(const at::Tensor& chunk,
                             const at::Tensor& plane_ptrs,
                             const at::Tensor& plane_block_sizes,
                             const at::Tensor& plane_block_stride_bytes,
                             const at::Tensor& plane_row_bytes,
                             const at::Tensor& plane_num_blocks,
                             const at::Tensor& slot_mapping,
                             const at::Tensor& plane_slot_offsets,
                             bool to_chunk, int64_t num_layers);

void block_page_transfer(const at::Tensor& chunk, const at::Tensor& layer_ptrs,
                         int64_t page_bytes, int64_t block_stride_bytes,
                         int64_t num_blocks, const at::Tensor& block_ids,
                         bool to_chunk);

}  // namespace lmca::ops
