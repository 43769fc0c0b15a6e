// SPDX-License-Identifier: Apache-2.0
// Python bindings of lmcache_ascend.ops.
//
// LMCache's DeviceOps.bind_native() binds every public callable or type of
// this module onto its device ops.  Export only real ops: LMCache's five
// DeviceOps ops under their LMCache names, our two extra transfer ops, and
// built_backends().  No enum types are exported, so LMCache's own
// TransferDirection / EngineKVFormat stay in place (ours accept them).
#include "ops/ops.h"
#include "ops/ops_util.h"
#include "cpu/row_engine.h"

namespace {

constexpr const char* kModuleDoc = R"doc(
Native KV copy ops of lmcache-ascend (CPU backend always; Ascend backend when
built with CANN).  Ops dispatch on their tensors' devices; a non-CPU tensor
without the Ascend backend raises RuntimeError.  All arguments are validated
before any byte is written.  See docs/kernels.md for layouts.
)doc";

constexpr const char* kMultiLayerDoc = R"doc(
Move token rows of every layer between LMCache's KV tensor and paged KV.

Same arguments and semantics as lmcache.v1.platform.torch_ops
.multi_layer_kv_transfer.  key_value is [2, NL, T, H] ([1, NL, T, H] for
MLA, last dim contiguous, other dims may be strided); key_value_ptrs holds
one paged-buffer address per layer (int64 tensor, or list of tensors);
slot_mapping is int64 [<= T], negative slots are skipped, tokens
[0, skip_prefix_n_tokens) are not moved.  direction: TransferDirection
H2D (0) = LMCache -> paged, D2H (1) = paged -> LMCache.  Formats:
NL_X_TWO_NB_BS_NH_HS, NL_X_NB_TWO_BS_NH_HS, NL_X_NB_BS_HS (MLA) and the HND
formats NL_X_TWO_NB_NH_BS_HS, NL_X_NB_TWO_NH_BS_HS (need head_size).
block_size 0 means one flat block of page_buffer_size rows (NHD two-major
and MLA only).  block_stride_elems > 0 is the padded distance between
blocks in elements (two-major formats: V starts num_blocks strides after K).
)doc";

constexpr const char* kSingleLayerDoc = R"doc(
Move token rows of one layer between an LMCache tensor and a paged layer.

lmc_key_value_cache: [T, H] (MLA), [T, 2, H] (token_major) or [2, T, H].
vllm_key_value_cache: the paged layer in engine_kv_format's shape; its block
(and K/V) dims may be strided.  Semantics as the torch baseline.
)doc";

constexpr const char* kBlockDoc = R"doc(
Move whole blocks of every layer between paged KV and LMCache chunk objects.

Mirrors LMCache's multi_layer_block_kv_transfer: object i holds the flat
blocks [i*bpo, (i+1)*bpo) of block_ids (bpo = lmcache_chunk_size /
shape_desc.bs) as [kv_size, nl, lmcache_chunk_size, nh*hs] (MLA: [nl,
chunk, hs]); the first skip_prefix_n_blocks blocks are not moved.
lmcache_objects_ptrs: list[int] host addresses or list[Tensor].
)doc";

constexpr const char* kMemcpyDoc = R"doc(
Copy nbytes from src to dest (both tensors, or both int addresses).
host_buffer_alignments must be a power of two.  On the CPU backend this is
a synchronous multi-threaded memcpy; with the Ascend backend it is an async
copy on the current NPU stream (addresses follow direction: H2D = host src
to device dest).
)doc";

constexpr const char* kBatchedDoc = R"doc(
Copy sizes[i] bytes from host address src_ptrs[i] to dst_ptrs[i] for all i
(multi-threaded).  Sizes <= 0 are skipped.
)doc";

constexpr const char* kMultiPlaneDoc = R"doc(
Move every selected row of L layers x P planes between paged planes and ONE
packed chunk, in one call.

Plane p of layer l has its base address at plane_ptrs[l*P + p] (int64 CPU
tensor, layer-major).  Per-plane int64 CPU tensors [P]: plane_block_sizes
(rows per block), plane_block_stride_bytes (bytes between blocks, >=
block_size*row_bytes, padding allowed), plane_row_bytes (bytes per row, any
positive value), plane_num_blocks (for bounds checks).  slot_mapping (int64)
is the concatenation of the P per-plane slot lists; plane p's list is
slot_mapping[plane_slot_offsets[p] : plane_slot_offsets[p+1]] (int64 CPU
[P+1], empty lists allowed).  Slot s of plane p is at byte
(s // bs_p) * stride_p + (s % bs_p) * row_bytes_p; negative slots (-1) are
skipped: their rows keep their place in the chunk and are neither read nor
written.

Packed chunk (contiguous, any dtype, read as bytes): layer-major, then
plane-major rows.  Row i of plane p of layer l starts at
    l * layer_bytes + sum_{q<p} n_q * row_bytes_q + i * row_bytes_p
with n_q = len(plane q's slot list) and layer_bytes = sum_q n_q*row_bytes_q.
to_chunk=True: paged -> chunk (store); False: chunk -> paged (load).
)doc";

constexpr const char* kBlockPageDoc = R"doc(
Move whole pages between paged pools of L layers and ONE packed chunk.

layer_ptrs: int64 CPU tensor [L] of pool base addresses.  Page of block b
of layer l is page_bytes bytes at layer_ptrs[l] + b * block_stride_bytes
(block_stride_bytes >= page_bytes).  block_ids: int64 [N]; ids < 0 are
skipped (their chunk slot keeps its place, untouched); ids must be <
num_blocks.  Packed chunk (contiguous): layer-major, then the N pages in
block_ids order: page i of layer l at (l * N + i) * page_bytes.
to_chunk=True: pages -> chunk (store); False: chunk -> pages (load).
)doc";

}  // namespace

PYBIND11_MODULE(_ops, m) {
  using namespace lmca::ops;
  // torch's Python types back the at::Tensor casters: make sure they exist
  // even when this module is imported before torch.
  py::module_::import("torch");
  m.doc() = kModuleDoc;
  // Checked by lmcache_ascend.ops against the torch it is loaded into.
  m.attr("_torch_version") = LMCA_TORCH_VERSION;

  m.def("multi_layer_kv_transfer", &multi_layer_kv_transfer, kMultiLayerDoc,
        py::arg("key_value"), py::arg("key_value_ptrs"),
        py::arg("slot_mapping"), py::arg("paged_memory_device"),
        py::arg("page_buffer_size"), py::arg("direction"),
        py::arg("engine_kv_format"), py::arg("block_size") = 0,
        py::arg("head_size") = 0, py::arg("skip_prefix_n_tokens") = 0,
        py::arg("block_stride_elems") = 0);

  m.def("single_layer_kv_transfer", &single_layer_kv_transfer, kSingleLayerDoc,
        py::arg("lmc_key_value_cache"), py::arg("vllm_key_value_cache"),
        py::arg("slot_mapping"), py::arg("direction"),
        py::arg("engine_kv_format"), py::arg("token_major") = false);

  m.def("multi_layer_block_kv_transfer", &multi_layer_block_kv_transfer,
        kBlockDoc, py::arg("paged_buffer_ptrs_tensor"),
        py::arg("lmcache_objects_ptrs"), py::arg("block_ids"),
        py::arg("device"), py::arg("direction"), py::arg("shape_desc"),
        py::arg("lmcache_chunk_size"), py::arg("engine_kv_format"),
        py::arg("skip_prefix_n_blocks"));

  m.def("lmcache_memcpy_async", &lmcache_memcpy_async, kMemcpyDoc,
        py::arg("dest"), py::arg("src"), py::arg("nbytes"),
        py::arg("direction"), py::arg("host_buffer_offset"),
        py::arg("host_buffer_alignments"));

  m.def("batched_memcpy", &batched_memcpy, kBatchedDoc, py::arg("src_ptrs"),
        py::arg("dst_ptrs"), py::arg("sizes"));

  m.def("multi_plane_kv_transfer", &multi_plane_kv_transfer, kMultiPlaneDoc,
        py::arg("chunk"), py::arg("plane_ptrs"), py::arg("plane_block_sizes"),
        py::arg("plane_block_stride_bytes"), py::arg("plane_row_bytes"),
        py::arg("plane_num_blocks"), py::arg("slot_mapping"),
        py::arg("plane_slot_offsets"), py::arg("to_chunk"),
        py::arg("num_layers"));

  m.def("block_page_transfer", &block_page_transfer, kBlockPageDoc,
        py::arg("chunk"), py::arg("layer_ptrs"), py::arg("page_bytes"),
        py::arg("block_stride_bytes"), py::arg("num_blocks"),
        py::arg("block_ids"), py::arg("to_chunk"));

  m.def("cpu_copy_threads", &lmca::cpu::probe_copy_threads,
        "Threads the CPU copy ops use now: torch's intra-op thread count "
        "when the module is built with OpenMP, else 1.");

  m.def("built_backends", &built_backends,
        "Backends compiled into this module: ['cpu'] or ['cpu', 'ascend'].");
}
