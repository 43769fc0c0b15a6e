// SPDX-License-Identifier: Apache-2.0
// LMCache 0.5.6 DeviceOps surface: same names, argument order, defaults and
// semantics as lmcache.v1.platform.torch_ops, plus HND formats and padded
// blocks.  Each op validates everything, then lowers to the CPU row engine
// or to an Ascend launch.
#include <ATen/Functions.h>

#include "ops/backend_ascend.h"
#include "ops/ops.h"
#include "ops/ops_kv.h"

namespace lmca::ops {
namespace {

at::Tensor as_tensor_or_undefined(py::handle obj) {
  if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
  return at::Tensor();
}

}  // namespace

void multi_layer_kv_transfer(const at::Tensor& key_value,
                             py::handle key_value_ptrs,
                             const at::Tensor& slot_mapping,
                             py::handle paged_memory_device,
                             int64_t page_buffer_size, py::handle direction,
                             py::handle engine_kv_format, int64_t block_size,
                             int64_t head_size, int64_t skip_prefix_n_tokens,
                             int64_t block_stride_elems) {
  check_defined(key_value, "key_value");
  const bool d2h = parse_direction_is_d2h(direction, "direction");
  const int64_t fmt = parse_kv_format(engine_kv_format, "engine_kv_format");
  const std::string dev = device_string(paged_memory_device, "paged_memory_device");
  std::vector<at::Tensor> ptr_tensors;
  at::Tensor ptr_table = as_tensor_or_undefined(key_value_ptrs);
  std::vector<NamedTensor> named{{"key_value", &key_value},
                                 {"slot_mapping", &slot_mapping},
                                 {"key_value_ptrs", &ptr_table}};
  const Backend backend = pick_backend(named, "paged_memory_device", dev);

  const int64_t num_kv = kv_format_num_kv(fmt);
  if (key_value.dim() != 4 || key_value.size(0) != num_kv) {
    value_error("argument 'key_value' has shape ", key_value.sizes(),
                "; expected [", num_kv, ", num_layers, num_tokens, hidden] for "
                "this engine_kv_format");
  }
  if (key_value.size(3) > 1 && key_value.stride(3) != 1) {
    value_error("argument 'key_value' must be contiguous in its last dim, "
                "got strides ", key_value.strides());
  }
  check_int64(slot_mapping, "slot_mapping");
  if (slot_mapping.dim() != 1 || slot_mapping.numel() > key_value.size(2)) {
    value_error("argument 'slot_mapping' has shape ", slot_mapping.sizes(),
                "; expected 1-D with at most key_value.size(2) = ",
                key_value.size(2), " entries");
  }
  check_positive(page_buffer_size, "page_buffer_size");
  if (skip_prefix_n_tokens < 0) {
    value_error("argument 'skip_prefix_n_tokens' = ", skip_prefix_n_tokens,
                " must be >= 0");
  }
  if (block_size < 0) value_error("argument 'block_size' = ", block_size, " must be >= 0");
  const bool needs_bs = kv_format_is_hnd(fmt) || fmt == kFmtNbTwoBsNhHs ||
                        block_stride_elems != 0;
  if (block_size == 0 && needs_bs) {
    value_error("argument 'block_size' = 0, but this engine_kv_format / "
                "block_stride_elems needs the block size (> 0)");
  }
  const int64_t bs = block_size > 0 ? block_size : page_buffer_size;
  if (page_buffer_size % bs != 0) {
    value_error("argument 'page_buffer_size' = ", page_buffer_size,
                " is not a multiple of block_size = ", bs);
  }
  const int64_t es = static_cast<int64_t>(key_value.element_size());
  const int64_t hidden = key_value.size(3);
  int64_t nh = 1, head_bytes = hidden * es;
  if (kv_format_is_hnd(fmt)) {
    if (head_size <= 0 || hidden % head_size != 0) {
      value_error("argument 'head_size' = ", head_size, " must be > 0 and "
                  "divide key_value.size(3) = ", hidden, " for HND formats");
    }
    nh = hidden / head_size;
    head_bytes = head_size * es;
  }
  const KvLayer k = make_kv_layer(fmt, page_buffer_size / bs, bs, nh,
                                  head_bytes, block_stride_elems * es,
                                  key_value.stride(2) * es,
                                  "block_stride_elems");
  const int64_t num_layers = key_value.size(1);
  const int64_t n = slot_mapping.numel();
  const int64_t kv_stride = key_value.stride(0) * es;
  const int64_t layer_stride = key_value.stride(1) * es;
  auto* chunk = static_cast<uint8_t*>(key_value.data_ptr());
  check_host_slots(slot_mapping, skip_prefix_n_tokens, slot_capacity(k.geom),
                   "slot_mapping", slot_range_text(k.geom));

  if (backend == Backend::kAscend) {
    ascend::TokenRowsLaunch L;
    L.geom = k.geom;
    L.num_kv = k.num_kv;
    L.v_plane_offset = k.v_offset;
    L.num_layers = num_layers;
    if (ptr_table.defined()) {
      check_int64(ptr_table, "key_value_ptrs");
      L.layer_ptrs = ptr_table;
    } else {
      const auto ptrs = pointer_table(key_value_ptrs, "key_value_ptrs", nullptr);
      L.layer_ptrs = at::tensor(ptrs, at::kLong);
    }
    if (L.layer_ptrs.numel() < num_layers) {
      value_error("argument 'key_value_ptrs' has ", L.layer_ptrs.numel(),
                  " entries but key_value has ", num_layers, " layers");
    }
    L.chunk = chunk;
    L.chunk_on_host = key_value.device().is_cpu();
    L.chunk_span = span_bytes(key_value);
    L.chunk_kv_stride = kv_stride;
    L.chunk_layer_stride = layer_stride;
    L.slots = slot_mapping;
    L.num_tokens = n;
    L.skip_prefix = skip_prefix_n_tokens;
    L.to_chunk = d2h;
    ascend::token_rows(L);
    return;
  }

  const std::vector<int64_t> ptrs =
      pointer_table(key_value_ptrs, "key_value_ptrs", &ptr_tensors);
  for (size_t i = 0; i < ptr_tensors.size(); ++i) {
    check_cpu(ptr_tensors[i], "key_value_ptrs", "CPU backend");
  }
  if (static_cast<int64_t>(ptrs.size()) < num_layers) {
    value_error("argument 'key_value_ptrs' has ", ptrs.size(),
                " entries but key_value has ", num_layers, " layers");
  }
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  run_cpu_job(token_row_job(k, ptrs, num_layers, chunk, kv_stride,
                            layer_stride, sp, n, skip_prefix_n_tokens, d2h));
}

void single_layer_kv_transfer(const at::Tensor& lmc, const at::Tensor& vllm,
                              const at::Tensor& slot_mapping,
                              py::handle direction,
                              py::handle engine_kv_format, bool token_major) {
  check_defined(lmc, "lmc_key_value_cache");
  check_defined(vllm, "vllm_key_value_cache");
  const bool d2h = parse_direction_is_d2h(direction, "direction");
  const int64_t fmt = parse_kv_format(engine_kv_format, "engine_kv_format");
  const Backend backend = pick_backend({{"lmc_key_value_cache", &lmc},
                                        {"vllm_key_value_cache", &vllm},
                                        {"slot_mapping", &slot_mapping}});
  if (lmc.element_size() != vllm.element_size()) {
    type_error("lmc_key_value_cache dtype ", lmc.scalar_type(),
               " and vllm_key_value_cache dtype ", vllm.scalar_type(),
               " differ in element size");
  }
  const int64_t es = static_cast<int64_t>(vllm.element_size());
  const bool mla = kv_format_is_mla(fmt), hnd = kv_format_is_hnd(fmt);
  const bool two_major = kv_format_two_major(fmt);
  // Paged dims: [2, NB, A, B, HS] / [NB, 2, A, B, HS] / MLA [NB, BS, HS] with
  // (A, B) = (BS, NH) for NHD and (NH, BS) for HND.
  const int64_t want_dim = mla ? 3 : 5;
  if (vllm.dim() != want_dim || (!mla && vllm.size(two_major ? 0 : 1) != 2)) {
    value_error("argument 'vllm_key_value_cache' has shape ", vllm.sizes(),
                "; expected a ", want_dim, "-D paged layer for this "
                "engine_kv_format");
  }
  const int64_t blk_dim = mla ? 0 : (two_major ? 1 : 0);
  const int64_t nb = vllm.size(blk_dim);
  const int64_t hs = vllm.size(want_dim - 1);
  const int64_t bs = mla ? vllm.size(1) : vllm.size(hnd ? 3 : 2);
  const int64_t nh = mla ? 1 : vllm.size(hnd ? 2 : 3);
  const int64_t hidden = nh * hs;
  const KvLayer k = make_kv_layer(fmt, nb, bs, nh, hs * es,
                                  vllm.stride(blk_dim) * es, 0,
                                  "vllm_key_value_cache (block stride)");
  // The inner dims must be laid out exactly as the format says.
  bool inner_ok = vllm.stride(want_dim - 1) == 1 || hs == 1;
  if (!mla) {
    const int64_t s_bs = vllm.stride(hnd ? 3 : 2) * es;
    const int64_t s_nh = vllm.stride(hnd ? 2 : 3) * es;
    inner_ok = inner_ok && (bs == 1 || s_bs == k.geom.row_stride) &&
               (nh == 1 || s_nh == (hnd ? k.geom.seg_stride : hs * es));
  } else {
    inner_ok = inner_ok && (bs == 1 || vllm.stride(1) * es == k.geom.row_stride);
  }
  if (!inner_ok) {
    value_error("argument 'vllm_key_value_cache' has strides ", vllm.strides(),
                " for shape ", vllm.sizes(), "; only the block (and K/V) dims "
                "may be strided");
  }
  const int64_t v_offset = mla ? 0 : vllm.stride(two_major ? 0 : 1) * es;
  // LMCache side: MLA [T, H]; token_major [T, 2, H]; else [2, T, H].
  const int64_t lmc_dim = mla ? 2 : 3;
  const int64_t tok_dim = (mla || token_major) ? 0 : 1;
  const bool lmc_ok = lmc.dim() == lmc_dim && lmc.size(lmc_dim - 1) == hidden &&
                      (mla || lmc.size(token_major ? 1 : 0) == 2) &&
                      (hidden == 1 || lmc.stride(lmc_dim - 1) == 1);
  if (!lmc_ok) {
    value_error("argument 'lmc_key_value_cache' has shape ", lmc.sizes(),
                " strides ", lmc.strides(), "; expected ",
                mla ? "[num_tokens, " : (token_major ? "[num_tokens, 2, " : "[2, num_tokens, "),
                hidden, "] with a contiguous last dim");
  }
  check_int64(slot_mapping, "slot_mapping");
  if (slot_mapping.dim() != 1 || slot_mapping.numel() > lmc.size(tok_dim)) {
    value_error("argument 'slot_mapping' has shape ", slot_mapping.sizes(),
                "; expected 1-D with at most ", lmc.size(tok_dim), " entries");
  }
  PlaneGeom g = k.geom;
  g.chunk_row_stride = lmc.stride(tok_dim) * es;
  const int64_t lmc_kv_stride = mla ? 0 : lmc.stride(token_major ? 1 : 0) * es;
  const int64_t n = slot_mapping.numel();
  auto* chunk = static_cast<uint8_t*>(lmc.data_ptr());
  const int64_t vptr = reinterpret_cast<int64_t>(vllm.data_ptr());
  KvLayer kk = k;
  kk.geom = g;
  kk.v_offset = v_offset;
  check_host_slots(slot_mapping, 0, slot_capacity(g), "slot_mapping",
                   slot_range_text(g));

  if (backend == Backend::kAscend) {
    ascend::TokenRowsLaunch L;
    L.geom = g;
    L.num_kv = k.num_kv;
    L.v_plane_offset = v_offset;
    L.num_layers = 1;
    L.layer_ptrs = at::tensor(std::vector<int64_t>{vptr}, at::kLong);
    L.chunk = chunk;
    L.chunk_on_host = lmc.device().is_cpu();
    L.chunk_span = span_bytes(lmc);
    L.chunk_kv_stride = lmc_kv_stride;
    L.chunk_layer_stride = 0;
    L.slots = slot_mapping;
    L.num_tokens = n;
    L.to_chunk = d2h;
    ascend::token_rows(L);
    return;
  }
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  run_cpu_job(token_row_job(kk, {vptr}, 1, chunk, lmc_kv_stride, 0, sp, n, 0,
                            d2h));
}

}  // namespace lmca::ops
