// SPDX-License-Identifier: Apache-2.0
#include "ops/ops_util.h"

#include "ops/backend_ascend.h"

namespace lmca::ops {

std::vector<std::string> built_backends() {
  std::vector<std::string> out{"cpu"};
  if (ascend::built()) out.emplace_back("ascend");
  return out;
}

std::string built_backends_str() {
  std::string s;
  for (const auto& b : built_backends()) s += (s.empty() ? "" : ", ") + b;
  return s;
}

std::string device_string(py::handle device, const char* name) {
  if (py::isinstance<py::str>(device)) return device.cast<std::string>();
  const py::object torch_device = py::module_::import("torch").attr("device");
  if (!py::isinstance(device, torch_device)) {
    type_error("argument '", name, "' must be a torch.device or str, got ",
               std::string(py::str(py::type::of(device).attr("__name__"))));
  }
  return py::str(device).cast<std::string>();
}

int64_t parse_int(py::handle value, const char* name) {
  if (py::isinstance<py::bool_>(value) || py::isinstance<py::float_>(value) ||
      !(py::isinstance<py::int_>(value) || py::hasattr(value, "__index__") ||
        py::hasattr(value, "__int__"))) {
    type_error("argument '", name, "' must be an int, got ",
               std::string(py::repr(value)));
  }
  return py::int_(py::reinterpret_borrow<py::object>(value)).cast<int64_t>();
}

bool parse_direction_is_d2h(py::handle direction, const char* name) {
  const int64_t v = parse_int(direction, name);
  if (v != 0 && v != 1) {
    value_error("argument '", name, "' = ", v,
                " is not a TransferDirection: valid values are "
                "TransferDirection.H2D (0, LMCache -> paged) and "
                "TransferDirection.D2H (1, paged -> LMCache)");
  }
  return v == 1;
}

int64_t parse_kv_format(py::handle fmt, const char* name) {
  const int64_t v = parse_int(fmt, name);
  if (!kv_format_supported(v)) {
    value_error("argument '", name, "' = ", std::string(py::str(fmt)),
                " (", v,
                ") is not supported: valid EngineKVFormat values are "
                "NL_X_TWO_NB_BS_NH_HS (1), NL_X_NB_TWO_BS_NH_HS (2), "
                "NL_X_NB_BS_HS (3), NL_X_TWO_NB_NH_BS_HS (6), "
                "NL_X_NB_TWO_NH_BS_HS (7)");
  }
  return v;
}

void check_defined(const at::Tensor& t, const char* name) {
  if (!t.defined()) type_error("argument '", name, "' must be a tensor");
}

void check_int64(const at::Tensor& t, const char* name) {
  check_defined(t, name);
  if (t.scalar_type() != at::kLong) {
    type_error("argument '", name, "' must have dtype torch.int64, got ",
               t.scalar_type());
  }
}

void check_cpu(const at::Tensor& t, const char* name, const char* why) {
  if (!t.device().is_cpu()) {
    runtime_error("argument '", name, "' must be a CPU tensor (", why,
                  "), got device '", t.device().str(), "'");
  }
}

void check_positive(int64_t v, const char* name) {
  if (v <= 0) value_error("argument '", name, "' = ", v, " must be > 0");
}

at::Tensor host_int64(const at::Tensor& t, const char* name, const char* why) {
  check_int64(t, name);
  check_cpu(t, name, why);
  if (t.dim() > 1) {
    value_error("argument '", name, "' must be 1-D, got shape ", t.sizes());
  }
  return t.contiguous();
}

void check_slots_in_range(const int64_t* slots, int64_t n, int64_t capacity,
                          const char* name, int64_t index_base,
                          const std::string& what_is_valid) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= capacity) {
      value_error(name, "[", index_base + i, "] = ", slots[i],
                  " is out of range: ", what_is_valid,
                  " (negative entries are skipped)");
    }
  }
}

void check_host_slots(const at::Tensor& slots, int64_t first, int64_t capacity,
                      const char* name, const std::string& what_is_valid) {
  if (!slots.device().is_cpu()) return;
  const at::Tensor c = slots.contiguous();
  const int64_t n = c.numel();
  first = std::min(std::max<int64_t>(first, 0), n);
  check_slots_in_range(c.data_ptr<int64_t>() + first, n - first, capacity, name,
                       first, what_is_valid);
}

std::vector<int64_t> pointer_table(py::handle obj, const char* name,
                                   std::vector<at::Tensor>* keep_tensors) {
  std::vector<int64_t> ptrs;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    int64_t i = 0;
    for (py::handle item : obj) {
      if (!THPVariable_Check(item.ptr())) {
        type_error("argument '", name, "' must be a 1-D int64 tensor of ",
                   "addresses or a list of tensors; item ", i, " is ",
                   std::string(py::repr(item)));
      }
      at::Tensor t = THPVariable_Unpack(item.ptr());
      if (keep_tensors) keep_tensors->push_back(t);
      ptrs.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
      ++i;
    }
  } else if (THPVariable_Check(obj.ptr())) {
    at::Tensor t = THPVariable_Unpack(obj.ptr());
    at::Tensor h = host_int64(t, name, "the pointer table is read on the host");
    const int64_t* p = h.data_ptr<int64_t>();
    ptrs.assign(p, p + h.numel());
  } else {
    type_error("argument '", name, "' must be a 1-D int64 tensor of ",
               "addresses or a list of tensors, got ",
               std::string(py::repr(obj)));
  }
  for (size_t i = 0; i < ptrs.size(); ++i) {
    if (ptrs[i] == 0) {
      value_error(name, "[", i, "] is a null pointer");
    }
  }
  return ptrs;
}

int64_t span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

}  // namespace lmca::ops
