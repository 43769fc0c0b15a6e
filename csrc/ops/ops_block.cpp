// SPDX-License-Identifier: Apache-2.0
// LMCache 0.5.6 DeviceOps surface, part 2: the block-granular transfer used
// by LMCache's multiprocess path, and the raw copy helpers.
#include <ATen/Functions.h>

#include <cstring>

#include "ops/backend_ascend.h"
#include "ops/ops.h"
#include "ops/ops_kv.h"

namespace lmca::ops {
namespace {

int64_t attr_int(py::handle obj, const char* attr, int64_t dflt, bool required) {
  if (!py::hasattr(obj, attr)) {
    if (required) {
      type_error("argument 'shape_desc' has no attribute '", attr,
                 "'; expected a PageBufferShapeDesc");
    }
    return dflt;
  }
  py::object v = obj.attr(attr);
  if (v.is_none()) return dflt;
  return parse_int(v, msg("shape_desc.", attr).c_str());
}

// LMCache object list: list[int] addresses or list[Tensor].
struct Objects {
  std::vector<int64_t> ptrs;
  std::vector<at::Tensor> tensors;  // empty in pointer mode
};

Objects parse_objects(py::handle obj) {
  Objects out;
  if (!(py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj))) {
    type_error("argument 'lmcache_objects_ptrs' must be a list[int] or "
               "list[torch.Tensor], got ", std::string(py::repr(obj)));
  }
  int64_t i = 0;
  for (py::handle item : obj) {
    if (THPVariable_Check(item.ptr())) {
      at::Tensor t = THPVariable_Unpack(item.ptr());
      out.tensors.push_back(t);
      out.ptrs.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    } else {
      out.ptrs.push_back(parse_int(item, "lmcache_objects_ptrs[i]"));
    }
    if (out.ptrs.back() == 0) {
      value_error("lmcache_objects_ptrs[", i, "] is a null pointer");
    }
    ++i;
  }
  if (!out.tensors.empty() && out.tensors.size() != out.ptrs.size()) {
    type_error("argument 'lmcache_objects_ptrs' mixes tensors and ints");
  }
  return out;
}

at::Tensor parse_block_ids(py::handle obj) {
  if (THPVariable_Check(obj.ptr())) {
    at::Tensor t = THPVariable_Unpack(obj.ptr());
    check_int64(t, "block_ids");
    if (t.dim() != 1) {
      value_error("argument 'block_ids' must be 1-D, got shape ", t.sizes());
    }
    return t;
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    std::vector<int64_t> ids;
    for (py::handle item : obj) ids.push_back(parse_int(item, "block_ids[i]"));
    return at::tensor(ids, at::kLong);
  }
  type_error("argument 'block_ids' must be an int64 tensor or list[int], got ",
             std::string(py::repr(obj)));
}

}  // namespace

void multi_layer_block_kv_transfer(py::handle paged_buffer_ptrs_tensor,
                                   py::handle lmcache_objects_ptrs,
                                   py::handle block_ids_arg, py::handle device,
                                   py::handle direction, py::handle shape_desc,
                                   int64_t lmcache_chunk_size,
                                   py::handle engine_kv_format,
                                   int64_t skip_prefix_n_blocks) {
  const bool d2h = parse_direction_is_d2h(direction, "direction");
  const int64_t fmt = parse_kv_format(engine_kv_format, "engine_kv_format");
  const std::string dev = device_string(device, "device");
  const int64_t nl = attr_int(shape_desc, "nl", 0, true);
  const int64_t nb = attr_int(shape_desc, "nb", 0, true);
  const int64_t bs = attr_int(shape_desc, "bs", 0, true);
  const int64_t nh = kv_format_is_mla(fmt) ? 1 : attr_int(shape_desc, "nh", 0, true);
  const int64_t hs = attr_int(shape_desc, "hs", 0, true);
  int64_t es = attr_int(shape_desc, "element_size", 0, false);
  if (es <= 0 && py::hasattr(shape_desc, "dtype") &&
      !shape_desc.attr("dtype").is_none()) {
    es = parse_int(shape_desc.attr("dtype").attr("itemsize"), "shape_desc.dtype.itemsize");
  }
  const int64_t stride_elems = attr_int(shape_desc, "block_stride_elems", 0, false);
  const int64_t kv_size = attr_int(shape_desc, "kv_size", 0, false);
  check_positive(nl, "shape_desc.nl");
  check_positive(nb, "shape_desc.nb");
  check_positive(bs, "shape_desc.bs");
  check_positive(nh, "shape_desc.nh");
  check_positive(hs, "shape_desc.hs");
  check_positive(es, "shape_desc.element_size");
  const int64_t num_kv = kv_format_num_kv(fmt);
  if (kv_size > 0 && kv_size != num_kv) {
    value_error("shape_desc.kv_size = ", kv_size, " does not match "
                "engine_kv_format (", num_kv, " planes)");
  }
  if (lmcache_chunk_size <= 0 || lmcache_chunk_size % bs != 0) {
    value_error("argument 'lmcache_chunk_size' = ", lmcache_chunk_size,
                " must be a positive multiple of shape_desc.bs = ", bs);
  }
  if (skip_prefix_n_blocks < 0) {
    value_error("argument 'skip_prefix_n_blocks' = ", skip_prefix_n_blocks,
                " must be >= 0");
  }
  const Objects objs = parse_objects(lmcache_objects_ptrs);
  const at::Tensor block_ids = parse_block_ids(block_ids_arg);
  at::Tensor ptr_t;
  if (THPVariable_Check(paged_buffer_ptrs_tensor.ptr())) {
    ptr_t = THPVariable_Unpack(paged_buffer_ptrs_tensor.ptr());
  }
  std::vector<NamedTensor> named{{"block_ids", &block_ids},
                                 {"paged_buffer_ptrs_tensor", &ptr_t}};
  for (const at::Tensor& t : objs.tensors) named.push_back({"lmcache_objects_ptrs[i]", &t});
  const Backend backend = pick_backend(named, "device", dev);

  const int64_t bpo = lmcache_chunk_size / bs;
  const int64_t num_objects = static_cast<int64_t>(objs.ptrs.size());
  const int64_t n_ids = block_ids.numel();
  if (n_ids > num_objects * bpo) {
    value_error("argument 'block_ids' has ", n_ids, " entries but "
                "lmcache_objects_ptrs holds ", num_objects, " objects x ", bpo,
                " blocks (lmcache_chunk_size / shape_desc.bs)");
  }
  const int64_t row_b = nh * hs * es;
  const KvLayer k = make_kv_layer(fmt, nb, bs, nh, hs * es, stride_elems * es,
                                  row_b, "shape_desc.block_stride_elems");
  // LMCache object: [num_kv, NL, chunk_tokens, NH*HS], contiguous.
  const int64_t layer_stride = lmcache_chunk_size * row_b;
  const int64_t kv_stride = nl * layer_stride;
  const int64_t obj_bytes = num_kv * kv_stride;
  for (size_t i = 0; i < objs.tensors.size(); ++i) {
    const at::Tensor& t = objs.tensors[i];
    const int64_t have = t.numel() * static_cast<int64_t>(t.element_size());
    if (!t.is_contiguous() || have < obj_bytes) {
      value_error("lmcache_objects_ptrs[", i, "] must be a contiguous tensor "
                  "of at least ", obj_bytes, " bytes; got shape ", t.sizes(),
                  " (", have, " bytes), contiguous=", t.is_contiguous());
    }
  }

  if (block_ids.device().is_cpu()) {
    const at::Tensor c = block_ids.contiguous();
    const int64_t* ids = c.data_ptr<int64_t>();
    for (int64_t j = skip_prefix_n_blocks; j < n_ids; ++j) {
      if (ids[j] < 0 || ids[j] >= nb) {
        value_error("block_ids[", j, "] = ", ids[j], " is out of range: valid "
                    "block ids are 0..", nb - 1, " (shape_desc.nb = ", nb, ")");
      }
    }
  }

  if (backend == Backend::kAscend) {
    // One token-row launch per object; slots expanded on the ids' device.
    const at::Tensor ptrs = ptr_t.defined()
        ? ptr_t
        : at::tensor(pointer_table(paged_buffer_ptrs_tensor,
                                   "paged_buffer_ptrs_tensor", nullptr), at::kLong);
    at::Tensor slots = block_ids.unsqueeze(1)
                           .mul(bs)
                           .add(at::arange(bs, block_ids.options()).unsqueeze(0))
                           .reshape({-1});
    const int64_t skip_tokens = std::min(skip_prefix_n_blocks, n_ids) * bs;
    if (skip_tokens > 0) slots.narrow(0, 0, skip_tokens).fill_(-1);
    for (int64_t o = 0; o * bpo < n_ids; ++o) {
      ascend::TokenRowsLaunch L;
      L.geom = k.geom;
      L.num_kv = num_kv;
      L.v_plane_offset = k.v_offset;
      L.num_layers = nl;
      L.layer_ptrs = ptrs;
      L.chunk = reinterpret_cast<uint8_t*>(objs.ptrs[o]);
      L.chunk_on_host = objs.tensors.empty() || objs.tensors[o].device().is_cpu();
      L.chunk_span = obj_bytes;
      L.chunk_kv_stride = kv_stride;
      L.chunk_layer_stride = layer_stride;
      const int64_t rows = std::min(bpo, n_ids - o * bpo) * bs;
      L.slots = slots.narrow(0, o * bpo * bs, rows);
      L.num_tokens = rows;
      L.to_chunk = d2h;
      ascend::token_rows(L);
    }
    return;
  }

  std::vector<at::Tensor> ptr_tensors;
  const std::vector<int64_t> ptrs =
      pointer_table(paged_buffer_ptrs_tensor, "paged_buffer_ptrs_tensor", &ptr_tensors);
  if (static_cast<int64_t>(ptrs.size()) < nl) {
    value_error("argument 'paged_buffer_ptrs_tensor' has ", ptrs.size(),
                " entries but shape_desc.nl = ", nl);
  }
  const at::Tensor ids_t = block_ids.contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  // Each (object, kv) pair is one plane whose slot list covers the object's
  // chunk rows; rows of skipped or absent blocks are -1.
  std::vector<std::vector<int64_t>> obj_slots(num_objects,
                                              std::vector<int64_t>(bpo * bs, -1));
  for (int64_t j = skip_prefix_n_blocks; j < n_ids; ++j) {
    int64_t* dst = obj_slots[j / bpo].data() + (j % bpo) * bs;
    for (int64_t r = 0; r < bs; ++r) dst[r] = block_first_slot(ids[j], bs) + r;
  }
  cpu::RowJob job;
  job.num_layers = nl;
  job.to_chunk = d2h;
  for (int64_t o = 0; o < num_objects; ++o) {
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      job.planes.push_back(cpu::PlaneJob{k.geom, obj_slots[o].data(), bpo * bs, 0});
    }
  }
  for (int64_t l = 0; l < nl; ++l) {
    for (int64_t o = 0; o < num_objects; ++o) {
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        job.paged_base.push_back(reinterpret_cast<uint8_t*>(ptrs[l]) + kv * k.v_offset);
        job.chunk_base.push_back(reinterpret_cast<uint8_t*>(objs.ptrs[o]) +
                                 lmc_chunk_plane_offset(kv, l, kv_stride, layer_stride));
      }
    }
  }
  run_cpu_job(job);
}

void lmcache_memcpy_async(py::handle dest, py::handle src, int64_t nbytes,
                          py::handle direction, int64_t host_buffer_offset,
                          int64_t host_buffer_alignments) {
  if (host_buffer_alignments <= 0 ||
      (host_buffer_alignments & (host_buffer_alignments - 1)) != 0) {
    value_error("argument 'host_buffer_alignments' = ", host_buffer_alignments,
                " must be a power of two");
  }
  const bool d2h = parse_direction_is_d2h(direction, "direction");
  if (nbytes < 0) value_error("argument 'nbytes' = ", nbytes, " must be >= 0");
  if (host_buffer_offset < 0) {
    value_error("argument 'host_buffer_offset' = ", host_buffer_offset, " must be >= 0");
  }
  const bool dt = THPVariable_Check(dest.ptr()), st = THPVariable_Check(src.ptr());
  uint64_t dptr = 0, sptr = 0;
  Backend backend = Backend::kCpu;
  if (dt || st) {
    if (!(dt && st)) {
      type_error("Mixed types are not allowed: both dest and src must be "
                 "torch.Tensor if either of them is a tensor");
    }
    const at::Tensor d = THPVariable_Unpack(dest.ptr());
    const at::Tensor s = THPVariable_Unpack(src.ptr());
    backend = pick_backend({{"dest", &d}, {"src", &s}});
    if (nbytes % static_cast<int64_t>(d.element_size()) != 0) {
      value_error("argument 'nbytes' = ", nbytes, " must align with the dest "
                  "element size ", d.element_size());
    }
    const int64_t dn = d.numel() * static_cast<int64_t>(d.element_size());
    const int64_t sn = s.numel() * static_cast<int64_t>(s.element_size());
    if (!d.is_contiguous() || !s.is_contiguous() || nbytes > dn || nbytes > sn) {
      value_error("argument 'nbytes' = ", nbytes, " exceeds dest (", dn,
                  " bytes) or src (", sn, " bytes), or a tensor is not "
                  "contiguous (dest ", d.is_contiguous(), ", src ",
                  s.is_contiguous(), ")");
    }
    if (backend == Backend::kAscend) {
      // Tensors carry their devices: let torch_npu pick the copy kind.
      if (nbytes == 0) return;
      d.reshape({-1}).view(at::kByte).narrow(0, 0, nbytes).copy_(
          s.reshape({-1}).view(at::kByte).narrow(0, 0, nbytes), /*non_blocking=*/true);
      return;
    }
    dptr = reinterpret_cast<uint64_t>(d.data_ptr());
    sptr = reinterpret_cast<uint64_t>(s.data_ptr());
  } else {
    dptr = static_cast<uint64_t>(parse_int(dest, "dest"));
    sptr = static_cast<uint64_t>(parse_int(src, "src"));
    // Raw addresses carry no device: with the Ascend backend they follow the
    // direction (H2D: host src -> device dest); without it both are host.
    if (ascend::built()) backend = Backend::kAscend;
  }
  if (nbytes == 0) return;
  if (dptr == 0 || sptr == 0) {
    value_error(dptr == 0 ? "argument 'dest'" : "argument 'src'",
                " is a null pointer");
  }
  if (backend == Backend::kAscend) {
    ascend::memcpy_async(dptr, sptr, nbytes, !d2h);
    return;
  }
  py::gil_scoped_release no_gil;
  cpu::run_memcpy_list({reinterpret_cast<uint8_t*>(dptr)},
                       {reinterpret_cast<const uint8_t*>(sptr)}, {nbytes});
}

void batched_memcpy(py::handle src_ptrs, py::handle dst_ptrs, py::handle sizes) {
  auto as_ints = [](py::handle seq, const char* name) {
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq)) {
      type_error("argument '", name, "' must be a list[int], got ",
                 std::string(py::repr(seq)));
    }
    std::vector<int64_t> v;
    for (py::handle item : seq) v.push_back(parse_int(item, name));
    return v;
  };
  const auto s = as_ints(src_ptrs, "src_ptrs");
  const auto d = as_ints(dst_ptrs, "dst_ptrs");
  const auto n = as_ints(sizes, "sizes");
  if (s.size() != d.size() || s.size() != n.size()) {
    value_error("batched_memcpy expects equally sized src_ptrs, dst_ptrs, and "
                "sizes (got ", s.size(), ", ", d.size(), ", ", n.size(), ")");
  }
  std::vector<uint8_t*> dst;
  std::vector<const uint8_t*> src;
  for (size_t i = 0; i < n.size(); ++i) {
    if (n[i] > 0 && (s[i] == 0 || d[i] == 0)) {
      value_error(s[i] == 0 ? "src_ptrs[" : "dst_ptrs[", i,
                  "] is a null pointer (size ", n[i], ")");
    }
    dst.push_back(reinterpret_cast<uint8_t*>(d[i]));
    src.push_back(reinterpret_cast<const uint8_t*>(s[i]));
  }
  py::gil_scoped_release no_gil;
  cpu::run_memcpy_list(dst, src, n);
}

}  // namespace lmca::ops
