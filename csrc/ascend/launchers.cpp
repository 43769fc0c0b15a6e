// SPDX-License-Identifier: Apache-2.0
// Host launchers of the Ascend backend (built only with CANN + torch_npu).
//
// Each launcher packs the validated launch description into an int64 meta
// array with the shared packers (kernels/launch_meta.h, which the simulation
// also uses) and the UB tile sized from the SoC's UB capacity, moves it and
// any host-resident index tensors to the NPU, stages a host-resident chunk
// through device memory,
// and enqueues the AscendC kernel on the current torch_npu stream through
// OpCommand, so it is ordered with the surrounding torch_npu work.
#include <ATen/ATen.h>
#include <torch_npu/csrc/core/npu/NPUFunctions.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>
#include <torch_npu/csrc/framework/OpCommand.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "aclrtlaunch_lmca_block_pages_kernel.h"
#include "aclrtlaunch_lmca_multi_plane_kernel.h"
#include "aclrtlaunch_lmca_token_rows_kernel.h"
#include "ascend/kernels/launch_meta.h"
#include "ops/backend_ascend.h"
#include "tiling/platform/platform_ascendc.h"

namespace lmca::ascend {

bool built() { return true; }

namespace {

c10::Device npu_device() {
  return c10::Device(c10::DeviceType::PrivateUse1,
                     static_cast<c10::DeviceIndex>(c10_npu::current_device()));
}

platform_ascendc::PlatformAscendC* platform() {
  return platform_ascendc::PlatformAscendCManager::GetInstance(aclrtGetSocName());
}

uint32_t vector_cores() {
  static const uint32_t n = static_cast<uint32_t>(platform()->GetCoreNumAiv());
  return n;
}

// Tiling of every launch, from the SoC's UB capacity (GetCoreMemSize), checked
// once on the host; a SoC the kernels cannot run on is refused here, before
// any launch (the kernels need DataCopyPad between GM and UB).
const Tiling& tiling() {
  static const Tiling t = [] {
    const std::string soc = aclrtGetSocName() ? aclrtGetSocName() : "";
    const std::string why = unsupported_soc_reason(soc);
    if (!why.empty()) throw std::runtime_error("lmcache_ascend: " + why);
    uint64_t ub = 0;
    platform()->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub);
    const int64_t ub_bytes = static_cast<int64_t>(ub);
    Tiling out{launch_tile_bytes(ub_bytes), 1};
    const std::string bad = tile_bytes_problem(out.tile_bytes, ub_bytes);
    if (!bad.empty()) {
      throw std::runtime_error("lmcache_ascend: SoC " + soc + " reports " +
                               std::to_string(ub) + " bytes of UB per core; " + bad);
    }
    return out;
  }();
  return t;
}

at::Tensor on_npu(const at::Tensor& t) {
  return t.device().is_cpu() ? t.contiguous().to(npu_device()) : t.contiguous();
}

at::Tensor words_on_npu(const std::vector<int64_t>& words) {
  return on_npu(at::tensor(words, at::kLong));
}

void* addr(const at::Tensor& t) { return t.data_ptr(); }

void check_launch(uint32_t ret, const char* kernel) {
  if (ret != 0) {
    throw std::runtime_error(std::string("lmcache_ascend: launching ") +
                             kernel + " failed with error " +
                             std::to_string(ret));
  }
}

// Device view of a chunk: host chunks are uploaded (a store must keep the
// rows it does not write) and, for stores, downloaded after the kernel.
struct DeviceChunk {
  at::Tensor host;     // undefined when the chunk is already on the NPU
  at::Tensor staging;  // device copy of a host chunk
  void* ptr = nullptr;
};

DeviceChunk device_chunk(uint8_t* chunk, bool on_host, int64_t span) {
  DeviceChunk d;
  if (!on_host) {
    d.ptr = chunk;
    return d;
  }
  d.host = at::from_blob(chunk, {span}, at::TensorOptions().dtype(at::kByte));
  d.staging = d.host.to(npu_device());
  d.ptr = d.staging.data_ptr();
  return d;
}

void finish_chunk(DeviceChunk& d, bool to_chunk) {
  // Blocking copy: the caller may read the host chunk right after return.
  if (d.host.defined() && to_chunk) d.host.copy_(d.staging);
}

template <typename Fn>
void enqueue(const char* name, Fn fn) {
  const aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
  at_npu::native::OpCommand cmd;
  cmd.Name(name);
  cmd.SetCustomHandler([fn, stream]() -> int {
    fn(stream);
    return 0;
  });
  cmd.Run();
}

}  // namespace

void token_rows(const TokenRowsLaunch& L) {
  if (L.num_layers == 0 || L.num_tokens == 0) return;
  const at::Tensor meta_t = words_on_npu(token_rows_meta(L, tiling()));
  const at::Tensor ptrs = on_npu(L.layer_ptrs);
  const at::Tensor slots = on_npu(L.slots);
  DeviceChunk chunk = device_chunk(L.chunk, L.chunk_on_host, L.chunk_span);
  void* chunk_ptr = chunk.ptr;
  enqueue("lmca_token_rows", [=](aclrtStream stream) {
    check_launch(ACLRT_LAUNCH_KERNEL(lmca_token_rows_kernel)(
                     vector_cores(), stream, addr(meta_t), addr(ptrs),
                     chunk_ptr, addr(slots)),
                 "lmca_token_rows_kernel");
  });
  finish_chunk(chunk, L.to_chunk);
}

void multi_plane(const MultiPlaneLaunch& L) {
  const int64_t P = L.num_planes;
  if (L.num_layers == 0 || L.slot_offsets[P] == 0) return;
  const at::Tensor meta_t = words_on_npu(multi_plane_meta(L, tiling()));
  const at::Tensor slots = on_npu(L.slots);
  const int64_t span = L.num_layers * L.plane_prefix[P];
  DeviceChunk chunk = device_chunk(static_cast<uint8_t*>(L.chunk.data_ptr()),
                                   L.chunk.device().is_cpu(), span);
  void* chunk_ptr = chunk.ptr;
  enqueue("lmca_multi_plane", [=](aclrtStream stream) {
    check_launch(ACLRT_LAUNCH_KERNEL(lmca_multi_plane_kernel)(
                     vector_cores(), stream, addr(meta_t), chunk_ptr,
                     addr(slots)),
                 "lmca_multi_plane_kernel");
  });
  finish_chunk(chunk, L.to_chunk);
}

void block_pages(const BlockPagesLaunch& L) {
  if (L.num_layers == 0 || L.num_pages == 0) return;
  const at::Tensor meta_t = words_on_npu(block_pages_meta(L, tiling()));
  const at::Tensor ids = on_npu(L.block_ids);
  const int64_t span = L.num_layers * L.num_pages * row_bytes(L.geom);
  DeviceChunk chunk = device_chunk(static_cast<uint8_t*>(L.chunk.data_ptr()),
                                   L.chunk.device().is_cpu(), span);
  void* chunk_ptr = chunk.ptr;
  enqueue("lmca_block_pages", [=](aclrtStream stream) {
    check_launch(ACLRT_LAUNCH_KERNEL(lmca_block_pages_kernel)(
                     vector_cores(), stream, addr(meta_t), chunk_ptr,
                     addr(ids)),
                 "lmca_block_pages_kernel");
  });
  finish_chunk(chunk, L.to_chunk);
}

void memcpy_async(uint64_t dst, uint64_t src, int64_t nbytes, bool h2d) {
  enqueue("lmca_memcpy_async", [=](aclrtStream stream) {
    const aclError ret = aclrtMemcpyAsync(
        reinterpret_cast<void*>(dst), static_cast<size_t>(nbytes),
        reinterpret_cast<const void*>(src), static_cast<size_t>(nbytes),
        h2d ? ACL_MEMCPY_HOST_TO_DEVICE : ACL_MEMCPY_DEVICE_TO_HOST, stream);
    if (ret != ACL_ERROR_NONE) {
      throw std::runtime_error("lmcache_ascend: aclrtMemcpyAsync failed with " +
                               std::to_string(ret));
    }
  });
}

}  // namespace lmca::ascend
