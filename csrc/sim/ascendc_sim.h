// SPDX-License-Identifier: Apache-2.0
// Host implementation of the AscendC API subset our kernels use, with the
// hardware's rules enforced as hard errors (lmca::sim::Violation).
//
// Modeled (semantics from CANN's public AscendC docs, Atlas A2/A3 vector
// core): GlobalTensor / LocalTensor, TPipe::InitBuffer for TQue / TQueBind /
// TBuf, AllocTensor / EnQue / DeQue / FreeTensor, DataCopy (32-byte units)
// and DataCopyPad with DataCopyExtParams / DataCopyPadExtParams (byte
// lengths), GetBlockIdx / GetBlockNum, LocalTensor and GlobalTensor
// GetValue, LocalTensor SetValue, PipeBarrier<PIPE_ALL>.  Anything else does
// not compile, so a kernel cannot silently step outside what is checked.
//
// Rules: UB capacity (per launch), InitBuffer lengths rounded up to 32 bytes,
// at most 64 buffers per TPipe, at most 8 event ids per HardEvent kind in
// use at once; UB addresses of DataCopy/DataCopyPad 32-byte aligned, DataCopy
// lengths in whole 32-byte blocks, GM addresses aligned to the element size,
// parameter ranges (zero-length DataCopyPad is a no-op), DataCopyPad absent
// on 310P; AllocTensor beyond the buffer count, EnQue beyond the depth, DeQue
// from an empty queue, FreeTensor of a tensor not allocated, use after
// FreeTensor or while enqueued, tensors left allocated at kernel end; local
// memory only through queues/buffers; GM only through GlobalTensor and only
// inside the buffers the launch passed (and the GlobalTensor's size); reads
// of UB bytes never written; pipe hazards on UB (a write by one pipe must be
// handed to another by a queue event or a barrier); GM races between cores.
// Each rule names the AscendC documentation it models (asc-devkit
// docs/zh/api/SIMD-API/基础API/..., and the CPU-debug implementation in
// impl/basic_api where the docs are silent).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "sim_core.h"

// Address-space and kernel qualifiers: plain host code here.
#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// Pipe ids of PipeBarrier (global namespace, as in the CCE headers).
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };

// Kernel type (Kernel-Tiling/设置Kernel类型.md; kernel_utils_macros.h).  The
// macro compiles to nothing for the NPU compiler's runtime; here it records
// the declaration so tests can check every kernel declares AIV-only.
enum KernelMetaType : uint8_t {
  KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIV_1_0,
  KERNEL_TYPE_MIX_AIC_1_0, KERNEL_TYPE_MIX_AIC_1_1, KERNEL_TYPE_MIX_AIC_1_2,
  KERNEL_TYPE_AICORE, KERNEL_TYPE_VECTORCORE, KERNEL_TYPE_MIX_AICORE,
  KERNEL_TYPE_MIX_VECTOR_CORE, KERNEL_TYPE_MAX
};
#define KERNEL_TASK_TYPE_DEFAULT(value) \
  (::lmca::sim::current().launch.stats.task_type = static_cast<int64_t>(value))

namespace AscendC {

// The real enumerators and values (impl/basic_api/common_types.h; docs
// 辅助数据结构/TPosition.md): LCM aliases VECCALC, SHM aliases SPM, TSCM = 13.
enum class TPosition : uint8_t {
  GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC,
  LCM = VECCALC, SPM, SHM = SPM, TSCM, C2PIPE2GM, C2PIPE2LOCAL, MAX
};
static_assert(static_cast<int>(TPosition::TSCM) == 13 &&
              static_cast<int>(TPosition::MAX) == 16, "real TPosition values");
using QuePosition = TPosition;

// GetBlockIdx.md: in [0, numBlocks) when only AIV (or AIC) cores run; with
// AIC:AIV 1:2 the vector cores' index spans [0, 2 * numBlocks).
// GetBlockNum.md: numBlocks of the launch in both cases.
inline int64_t GetBlockIdx() { return lmca::sim::current().idx; }
inline int64_t GetBlockNum() { return lmca::sim::current().launch.block_dim; }

namespace sim_detail {
using lmca::sim::Core;
using lmca::sim::Pipe;
using lmca::sim::UbBuffer;
using lmca::sim::kUbBlock;

inline int64_t ceil32(int64_t n) { return (n + kUbBlock - 1) / kUbBlock * kUbBlock; }

// What a LocalTensor designates: part of one buffer of the running core.
struct LocalRef {
  const Core* core = nullptr;
  int buf = -1;
  uint32_t gen = 0;
  int64_t off = 0;    // bytes from the buffer start
  int64_t bytes = 0;  // bytes from `off` to the end of the tensor
};

// LocalTensor简介.md / TQue AllocTensor.md, DeQue.md: local memory is reached
// through tensors a queue or TBuf hands out, valid until FreeTensor.
inline UbBuffer& resolve(Core& c, const LocalRef& r, const char* api) {
  if (r.buf < 0) {
    c.fail(api, ": LocalTensor was not obtained from AllocTensor, DeQue or "
                "TBuf::Get; local memory is reachable only through a queue "
                "or buffer");
  }
  if (r.core != &c) c.fail(api, ": LocalTensor belongs to another core's run");
  UbBuffer& b = c.bufs[r.buf];
  if (!b.alive) c.fail(api, ": LocalTensor outlived its TPipe");
  if (b.generation != r.gen || b.state == UbBuffer::State::Free) {
    c.fail(api, ": LocalTensor used after FreeTensor");
  }
  if (b.state == UbBuffer::State::Queued) {
    c.fail(api, ": LocalTensor used while it is in its queue (between EnQue "
                "and DeQue)");
  }
  return b;
}

// GM->UB or UB->GM as `count` blocks of `len` data bytes.
struct Bursts {
  int64_t count, len;
  int64_t gm_step;   // GM bytes from one block to the next
  int64_t ub_step;   // UB bytes from one block to the next
  int64_t ub_span;   // UB bytes one block occupies (lpad + len + rpad, 32-up)
  int64_t lpad = 0, rpad = 0;  // UB padding bytes around the data
};

// GlobalTensor SetGlobalBuffer.md: a GlobalTensor covers bufferSize elements;
// DataCopy docs: GM addresses aligned to the element size.
inline void check_gm(Core& c, uintptr_t gm, uint64_t avail, int64_t elem,
                     const Bursts& b, const char* api) {
  if (gm == 0) c.fail(api, ": GlobalTensor has no buffer (SetGlobalBuffer)");
  if (gm % elem != 0) {
    c.fail(api, ": GM address ", c.launch.where(gm), " is not aligned to the ",
           elem, "-byte element size");
  }
  const int64_t span = (b.count - 1) * b.gm_step + b.len;
  if (static_cast<uint64_t>(span) > avail) {
    c.fail(api, ": touches ", span, " GM bytes from ", c.launch.where(gm),
           " but the GlobalTensor holds ", avail, " (SetGlobalBuffer size)");
  }
  for (int64_t i = 0; i < b.count; ++i) {
    const uintptr_t s = gm + i * b.gm_step;
    if (!c.launch.inside(s, s + b.len)) {
      c.fail(api, ": GM bytes [", c.launch.where(s), ", +", b.len,
             ") lie outside every buffer passed to the kernel");
    }
  }
}

// DataCopy / DataCopyPad docs: UB addresses 32-byte aligned; each block
// occupies its 32-byte-rounded span (plus dstStride/srcStride blocks).
inline void check_ub(Core& c, const LocalRef& r, const UbBuffer& buf,
                     const Bursts& b, const char* api) {
  const int64_t addr = buf.offset + r.off;
  if (addr % kUbBlock != 0) {
    c.fail(api, ": UB address ", addr, " is not 32-byte aligned");
  }
  const int64_t span = (b.count - 1) * b.ub_step + b.ub_span;
  if (span > r.bytes) {
    c.fail(api, ": needs ", span, " UB bytes but the LocalTensor has ",
           r.bytes, " (from UB address ", addr, ")");
  }
}

inline void note_copy(Core& c, const Bursts& b, bool in) {
  auto& s = c.launch.stats;
  (in ? s.copies_in : s.copies_out) += 1;
  // Blocks without a GM gap are one contiguous GM range: one burst.
  (in ? s.bursts_in : s.bursts_out) += b.gm_step == b.len ? 1 : b.count;
  (in ? s.bytes_in : s.bytes_out) += b.count * b.len;
  s.max_copy_bytes = std::max<int64_t>(s.max_copy_bytes, b.len);
  c.did_copy = true;
}

// MTE2: GM -> UB.  Padding bytes get `pad` when is_pad, else stay undefined.
inline void gm_to_ub(const LocalRef& dst, uintptr_t gm, uint64_t avail,
                     int64_t elem, const Bursts& b, bool is_pad,
                     const void* pad, const char* api) {
  Core& c = lmca::sim::current();
  UbBuffer& buf = resolve(c, dst, api);
  check_ub(c, dst, buf, b, api);
  check_gm(c, gm, avail, elem, b, api);
  lmca::sim::ub_touch(c, buf, Pipe::MTE2, true, api);
  for (int64_t i = 0; i < b.count; ++i) {
    const int64_t u = buf.offset + dst.off + i * b.ub_step;
    uint8_t* ub = c.ub.data() + u;
    uint8_t* ok = c.written.data() + u;
    std::memset(ok, 0, b.ub_span);
    std::memcpy(ub + b.lpad, reinterpret_cast<const void*>(gm + i * b.gm_step), b.len);
    std::memset(ok + b.lpad, 1, b.len);
    if (is_pad) {
      for (int64_t k = 0; k < b.lpad; ++k) ub[k] = static_cast<const uint8_t*>(pad)[k % elem];
      for (int64_t k = 0; k < b.rpad; ++k) {
        ub[b.lpad + b.len + k] = static_cast<const uint8_t*>(pad)[k % elem];
      }
      std::memset(ok, 1, b.lpad);
      std::memset(ok + b.lpad + b.len, 1, b.rpad);
    }
    c.launch.log(gm + i * b.gm_step, gm + i * b.gm_step + b.len, int32_t(c.idx), false);
  }
  note_copy(c, b, true);
}

// MTE3: UB -> GM.  Every UB byte stored must have been written.
// DataCopyPad（UBToGM）.md: the bytes stored are what UB holds; bytes a
// GM->UB copy left as dummy padding are undefined (DataCopyPad（GMToUB）.md).
inline void ub_to_gm(uintptr_t gm, uint64_t avail, const LocalRef& src,
                     int64_t elem, const Bursts& b, const char* api) {
  Core& c = lmca::sim::current();
  UbBuffer& buf = resolve(c, src, api);
  check_ub(c, src, buf, b, api);
  check_gm(c, gm, avail, elem, b, api);
  lmca::sim::ub_touch(c, buf, Pipe::MTE3, false, api);
  for (int64_t i = 0; i < b.count; ++i) {
    const int64_t u = buf.offset + src.off + i * b.ub_step;
    const uint8_t* ok = c.written.data() + u;
    const int64_t undefined = b.len - std::count(ok, ok + b.len, uint8_t{1});
    if (undefined != 0) {
      c.fail(api, ": stores ", undefined, " UB bytes (block ", i, ", UB address ",
             u, ") that the kernel never wrote; their contents are undefined");
    }
  }
  for (int64_t i = 0; i < b.count; ++i) {
    const int64_t u = buf.offset + src.off + i * b.ub_step;
    std::memcpy(reinterpret_cast<void*>(gm + i * b.gm_step), c.ub.data() + u, b.len);
    c.launch.log(gm + i * b.gm_step, gm + i * b.gm_step + b.len, int32_t(c.idx), true);
  }
  note_copy(c, b, false);
}

inline void check_range(Core& c, const char* api, const char* field,
                        int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    c.fail(api, ": ", field, " = ", v, " is outside [", lo, ", ", hi, "]");
  }
}
}  // namespace sim_detail

// ---- tensors -----------------------------------------------------------------

template <typename T>
class GlobalTensor {
 public:
  __aicore__ inline void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize) {
    addr_ = buffer;
    size_ = bufferSize;
  }
  __aicore__ inline GlobalTensor operator[](uint64_t offset) const {
    if (offset > size_) {
      lmca::sim::current().fail("GlobalTensor[", offset, "]: beyond its ",
                                size_, " elements");
    }
    GlobalTensor r;
    r.SetGlobalBuffer(addr_ + offset, size_ - offset);
    return r;
  }
  // Scalar read through the scalar unit.
  __aicore__ inline T GetValue(uint64_t offset) const {
    auto& c = lmca::sim::current();
    if (addr_ == nullptr) c.fail("GlobalTensor::GetValue: no SetGlobalBuffer");
    if (offset >= size_) {
      c.fail("GlobalTensor::GetValue(", offset, "): beyond its ", size_,
             " elements");
    }
    const auto a = reinterpret_cast<uintptr_t>(addr_ + offset);
    if (a % sizeof(T) != 0) c.fail("GlobalTensor::GetValue: misaligned address");
    if (!c.launch.inside(a, a + sizeof(T))) {
      c.fail("GlobalTensor::GetValue: ", c.launch.where(a),
             " lies outside every buffer passed to the kernel");
    }
    c.launch.log(a, a + sizeof(T), int32_t(c.idx), false);
    c.launch.stats.scalar_gm_reads += 1;
    T v;
    std::memcpy(&v, addr_ + offset, sizeof(T));
    return v;
  }
  __aicore__ inline uint64_t GetSize() const { return size_; }
  // kernel_tensor.h: the no-offset overload returns a const pointer.
  __aicore__ inline const __gm__ T* GetPhyAddr() const { return addr_; }
  __aicore__ inline __gm__ T* GetPhyAddr(const uint64_t offset) const { return addr_ + offset; }

  // Simulation bookkeeping (not AscendC API).
  uintptr_t sim_addr() const { return reinterpret_cast<uintptr_t>(addr_); }
  uint64_t sim_bytes() const { return size_ * sizeof(T); }

 private:
  T* addr_ = nullptr;
  uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;  // unbound: every use fails

  __aicore__ inline LocalTensor operator[](uint32_t offset) const {
    const int64_t off = int64_t(offset) * int64_t(sizeof(T));
    if (off > ref_.bytes) {
      lmca::sim::current().fail("LocalTensor[", offset, "]: beyond its ",
                                ref_.bytes / int64_t(sizeof(T)), " elements");
    }
    LocalTensor r = *this;
    r.ref_.off += off;
    r.ref_.bytes -= off;
    return r;
  }
  // Scalar accesses (pipe S).
  __aicore__ inline T GetValue(uint32_t i) const {
    auto& c = lmca::sim::current();
    const int64_t at = scalar_at(c, i, "LocalTensor::GetValue");
    lmca::sim::ub_touch(c, c.bufs[ref_.buf], sim_detail::Pipe::S, false,
                        "LocalTensor::GetValue");
    if (std::count(&c.written[at], &c.written[at] + sizeof(T), uint8_t{1}) !=
        int64_t(sizeof(T))) {
      c.fail("LocalTensor::GetValue(", i, "): reads UB bytes never written");
    }
    T v;
    std::memcpy(&v, &c.ub[at], sizeof(T));
    return v;
  }
  __aicore__ inline void SetValue(uint32_t i, T v) const {
    auto& c = lmca::sim::current();
    const int64_t at = scalar_at(c, i, "LocalTensor::SetValue");
    lmca::sim::ub_touch(c, c.bufs[ref_.buf], sim_detail::Pipe::S, true,
                        "LocalTensor::SetValue");
    std::memcpy(&c.ub[at], &v, sizeof(T));
    std::memset(&c.written[at], 1, sizeof(T));
  }
  __aicore__ inline uint32_t GetSize() const {
    return static_cast<uint32_t>(ref_.bytes / int64_t(sizeof(T)));
  }

  // Simulation bookkeeping (not AscendC API).
  explicit LocalTensor(const sim_detail::LocalRef& r) : ref_(r) {}
  const sim_detail::LocalRef& sim_ref() const { return ref_; }

 private:
  int64_t scalar_at(lmca::sim::Core& c, uint32_t i, const char* api) const {
    const auto& b = sim_detail::resolve(c, ref_, api);
    const int64_t off = int64_t(i) * int64_t(sizeof(T));
    if (off + int64_t(sizeof(T)) > ref_.bytes) {
      c.fail(api, "(", i, "): beyond the LocalTensor's ",
             ref_.bytes / int64_t(sizeof(T)), " elements");
    }
    return b.offset + ref_.off + off;
  }
  sim_detail::LocalRef ref_;
};

// ---- data movement -----------------------------------------------------------

struct DataCopyParams {
  __aicore__ DataCopyParams() {}
  __aicore__ DataCopyParams(const uint16_t count, const uint16_t len,
                            const uint16_t srcStrideIn, const uint16_t dstStrideIn)
      : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn) {}
  uint16_t blockCount = 1;
  uint16_t blockLen = 0;  // 32-byte blocks
  // 32-byte blocks between bursts; kernel_struct_data_copy.h names them
  // srcGap/dstGap, with srcStride/dstStride as deprecated aliases.
  union {
    uint16_t srcGap = 0;
    uint16_t srcStride;
  };
  union {
    uint16_t dstGap = 0;
    uint16_t dstStride;
  };
};

struct DataCopyExtParams {
  __aicore__ DataCopyExtParams() {}
  __aicore__ DataCopyExtParams(const uint16_t count, const uint32_t len,
                               const uint32_t srcStrideIn, const uint32_t dstStrideIn,
                               const uint32_t rsvIn)
      : blockCount(count), blockLen(len), srcStride(srcStrideIn),
        dstStride(dstStrideIn), rsv(rsvIn) {}
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;   // bytes
  uint32_t srcStride = 0;  // GM side: bytes; UB side: 32-byte blocks
  uint32_t dstStride = 0;
  uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
  __aicore__ DataCopyPadExtParams() {}
  __aicore__ DataCopyPadExtParams(const bool isPadValue, const uint8_t leftPadValue,
                                  const uint8_t rightPadValue, T padValue)
      : isPad(isPadValue), leftPadding(leftPadValue),
        rightPadding(rightPadValue), paddingValue(padValue) {}
  bool isPad = false;
  uint8_t leftPadding = 0;   // elements
  uint8_t rightPadding = 0;  // elements
  T paddingValue = 0;
};

namespace sim_detail {
// DataCopy（GM与UB连续数据搬运）.md: blockCount [1, 4095], blockLen [1, 65535]
// 32-byte blocks; the count form moves count * sizeof(T) bytes, a multiple of 32.
template <typename T>
Bursts aligned_bursts(Core& c, const DataCopyParams& p, const char* api) {
  check_range(c, api, "blockCount", p.blockCount, 1, 4095);
  check_range(c, api, "blockLen (32-byte blocks)", p.blockLen, 1, 65535);
  const int64_t len = int64_t(p.blockLen) * kUbBlock;
  return Bursts{p.blockCount, len, len + int64_t(p.srcStride) * kUbBlock,
                len + int64_t(p.dstStride) * kUbBlock, len};
}

template <typename T>
DataCopyParams count_params(Core& c, uint32_t count, const char* api) {
  const int64_t bytes = int64_t(count) * int64_t(sizeof(T));
  if (bytes == 0 || bytes % kUbBlock != 0) {
    c.fail(api, ": moves whole 32-byte blocks, but ", count, " x ", sizeof(T),
           " bytes = ", bytes, " is not a positive multiple of 32 (use "
           "DataCopyPad for unaligned lengths)");
  }
  check_range(c, api, "count x element size / 32", bytes / kUbBlock, 1, 65535);
  return DataCopyParams(1, uint16_t(bytes / kUbBlock), 0, 0);
}

// DataCopyPad（GMToUB/UBToGM非对齐数据搬运）.md: supported on Atlas A2/A3,
// not on Atlas inference products (310P); blockCount in [0, 4095], blockLen
// in [0, 2097151] bytes, and on A2/A3 either being 0 makes the call a NOP.
// Returns false for a NOP.
inline bool check_ext(Core& c, const DataCopyExtParams& p, const char* api) {
  if (c.launch.npu_arch != lmca::sim::kArchA2) {
    c.fail(api, ": DataCopyPad between GM and UB does not exist on this SoC "
                "(__NPU_ARCH__ ", c.launch.npu_arch, ", Atlas inference / 310P)");
  }
  check_range(c, api, "blockCount", p.blockCount, 0, 4095);
  check_range(c, api, "blockLen (bytes)", p.blockLen, 0, (1 << 21) - 1);
  return p.blockCount != 0 && p.blockLen != 0;
}
}  // namespace sim_detail

// DataCopy: whole 32-byte blocks (strides in blocks on both sides).
template <typename T>
__aicore__ inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                                const DataCopyParams& p) {
  constexpr const char* api = "DataCopy (GM->UB)";
  auto& c = lmca::sim::current();
  const auto b = sim_detail::aligned_bursts<T>(c, p, api);  // src GM, dst UB
  sim_detail::gm_to_ub(dst.sim_ref(), src.sim_addr(), src.sim_bytes(), sizeof(T),
                       b, false, nullptr, api);
}

template <typename T>
__aicore__ inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                                const DataCopyParams& p) {
  constexpr const char* api = "DataCopy (UB->GM)";
  auto& c = lmca::sim::current();
  auto b = sim_detail::aligned_bursts<T>(c, p, api);
  std::swap(b.gm_step, b.ub_step);  // UB side uses srcStride, GM side dstStride
  sim_detail::ub_to_gm(dst.sim_addr(), dst.sim_bytes(), src.sim_ref(), sizeof(T), b, api);
}

template <typename T>
__aicore__ inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                                const uint32_t count) {
  DataCopy(dst, src, sim_detail::count_params<T>(lmca::sim::current(), count,
                                                 "DataCopy (GM->UB)"));
}

template <typename T>
__aicore__ inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                                const uint32_t count) {
  DataCopy(dst, src, sim_detail::count_params<T>(lmca::sim::current(), count,
                                                 "DataCopy (UB->GM)"));
}

// DataCopyPad: byte lengths; each block occupies a 32-byte-rounded UB span.
template <typename T>
__aicore__ inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                                   const DataCopyExtParams& p,
                                   const DataCopyPadExtParams<T>& pad) {
  constexpr const char* api = "DataCopyPad (GM->UB)";
  auto& c = lmca::sim::current();
  if (!sim_detail::check_ext(c, p, api)) return;
  const int64_t lp = int64_t(pad.leftPadding) * sizeof(T);
  const int64_t rp = int64_t(pad.rightPadding) * sizeof(T);
  sim_detail::check_range(c, api, "leftPadding (bytes)", lp, 0, 32);
  sim_detail::check_range(c, api, "rightPadding (bytes)", rp, 0, 32);
  const int64_t span = sim_detail::ceil32(lp + p.blockLen + rp);
  const sim_detail::Bursts b{p.blockCount, p.blockLen, int64_t(p.blockLen) + p.srcStride,
                             span + int64_t(p.dstStride) * sim_detail::kUbBlock, span, lp, rp};
  const T value = pad.paddingValue;
  sim_detail::gm_to_ub(dst.sim_ref(), src.sim_addr(), src.sim_bytes(), sizeof(T), b,
                       pad.isPad, &value, api);
}

template <typename T>
__aicore__ inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                                   const DataCopyExtParams& p) {
  constexpr const char* api = "DataCopyPad (UB->GM)";
  auto& c = lmca::sim::current();
  if (!sim_detail::check_ext(c, p, api)) return;
  const int64_t span = sim_detail::ceil32(p.blockLen);
  const sim_detail::Bursts b{p.blockCount, p.blockLen, int64_t(p.blockLen) + p.dstStride,
                             span + int64_t(p.srcStride) * sim_detail::kUbBlock, span};
  sim_detail::ub_to_gm(dst.sim_addr(), dst.sim_bytes(), src.sim_ref(), sizeof(T), b, api);
}

// Only the full barrier orders different pipes; a single-pipe barrier
// orders instructions of a pipe the simulation already runs in order.
// PipeBarrier(ISASI).md: PIPE_ALL waits for every pipe, ordering all prior UB
// accesses before later ones.
template <pipe_t pipe>
__aicore__ inline void PipeBarrier() {
  if constexpr (pipe == PIPE_ALL) {
    for (auto& b : lmca::sim::current().bufs) {
      b.visible = lmca::sim::kAllPipes;
      b.readers = 0;
    }
  }
}

}  // namespace AscendC

#include "ascendc_sim_pipe.h"
