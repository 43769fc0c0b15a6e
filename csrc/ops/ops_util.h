// SPDX-License-Identifier: Apache-2.0
// Argument parsing, validation and backend selection shared by the op TUs.
//
// Every check runs before any byte is written: ops parse and validate all
// arguments into plain structs first, then release the GIL and copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lmcache_ascend/addressing.h"

namespace py = pybind11;

namespace lmca::ops {

// Builds a message from any streamable parts.
template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

template <typename... Parts>
[[noreturn]] void value_error(const Parts&... parts) {
  throw py::value_error(msg(parts...));
}

template <typename... Parts>
[[noreturn]] void type_error(const Parts&... parts) {
  throw py::type_error(msg(parts...));
}

template <typename... Parts>
[[noreturn]] void runtime_error(const Parts&... parts) {
  throw std::runtime_error(msg(parts...));
}

enum class Backend { kCpu, kAscend };

// Backends compiled into this module, e.g. {"cpu"} or {"cpu", "ascend"}.
std::vector<std::string> built_backends();
std::string built_backends_str();

// A named tensor argument, for device selection and error messages.
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
};

// Picks the backend from the tensors' devices (and an optional explicit
// device string).  All on CPU -> CPU.  Anything else needs the Ascend backend;
// without it this raises RuntimeError naming the argument and its device.
Backend pick_backend(const std::vector<NamedTensor>& tensors,
                     const std::string& device_arg_name = "",
                     const std::string& device_str = "");

// str(torch.device) / str for a device argument given as torch.device or str.
std::string device_string(py::handle device, const char* name);

// TransferDirection (or int): returns true for D2H (paged -> LMCache chunk).
bool parse_direction_is_d2h(py::handle direction, const char* name);

// EngineKVFormat (or int): returns the value, checked to be supported.
int64_t parse_kv_format(py::handle fmt, const char* name);

// Python int (or int-convertible) argument.
int64_t parse_int(py::handle value, const char* name);

void check_int64(const at::Tensor& t, const char* name);
void check_cpu(const at::Tensor& t, const char* name, const char* why);
void check_positive(int64_t v, const char* name);
void check_defined(const at::Tensor& t, const char* name);

// Host int64 view of an index tensor (copied to contiguous if needed; kept
// alive by the returned tensor).  Requires dtype int64 and a CPU device.
at::Tensor host_int64(const at::Tensor& t, const char* name, const char* why);

// Raises ValueError if any non-negative slot is >= capacity.  `name` and
// `index_base` locate the offending entry in the caller's argument.
void check_slots_in_range(const int64_t* slots, int64_t n, int64_t capacity,
                          const char* name, int64_t index_base,
                          const std::string& what_is_valid);

// check_slots_in_range over entries [first, numel) of a 1-D int64 tensor
// when it lives on the host; device-resident lists are bounds-checked by the
// kernels instead (they skip out-of-range entries).
void check_host_slots(const at::Tensor& slots, int64_t first, int64_t capacity,
                      const char* name, const std::string& what_is_valid);

// Pointer table: list[Tensor] (data_ptr of each) or 1-D int64 tensor of
// addresses.  Returns the addresses; raises on null entries.
std::vector<int64_t> pointer_table(py::handle obj, const char* name,
                                   std::vector<at::Tensor>* keep_tensors);

// Total bytes spanned by a strided tensor (from its first element).
int64_t span_bytes(const at::Tensor& t);

}  // namespace lmca::ops
