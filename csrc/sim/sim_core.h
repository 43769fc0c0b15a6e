// SPDX-License-Identifier: Apache-2.0
// Runtime state behind the AscendC simulation (ascendc_sim.h).
//
// A Launch is one kernel launch: the GM buffers the host handed to the
// kernel, every GM access the simulated cores made (for bounds and race
// checks) and counters.  A Core is the AI core currently running the kernel
// body: its Unified Buffer (bytes plus a per-byte "written" map), the queue
// and TBuf buffers carved out of it by TPipe::InitBuffer, and the pipe-hazard
// state of each buffer.  Cores run one after another on the calling thread;
// `current()` is the core whose body is executing.
//
// Every broken rule throws Violation (pybind11 maps it to RuntimeError) with
// the core, the API call and the rule in the message.  Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace lmca::sim {

class Violation : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Hardware parameters of the modeled SoC (Atlas A2/A3 vector core).
constexpr int64_t kDefaultUbBytes = 192 * 1024;
constexpr int64_t kUbBlock = 32;          // UB addressing unit
constexpr int kMaxBuffersPerKernel = 64;  // QBUF_MAX_LEN (impl/basic_api/kernel_macros.h)
// QUE_MAX_EVENT (kernel_macros.h): event ids per HardEvent kind a TPipe can
// hand out at once on __NPU_ARCH__ 2201 (A2/A3) and 2002 (310P).
constexpr int kQueMaxEvent = 8;
// __NPU_ARCH__ of the modeled chips: DataCopyPad between GM and UB exists on
// 2201 only (DataCopyPad docs: "Atlas 推理系列产品 AI Core: 不支持").
constexpr int kArchA2 = 2201;
constexpr int kArch310P = 2002;

// The HardEvent kinds the modeled queues use (impl/basic_api/kernel_event.h,
// GetQueEvt): EnQue/DeQue forward events and FreeTensor/AllocTensor
// backward events of TQueBind<VECIN, VECOUT>, TQue<VECIN>, TQue<VECOUT>.
enum class HardEvent : uint8_t { MTE2_MTE3, MTE3_MTE2, MTE2_V, V_MTE2, V_MTE3, MTE3_V, kKinds };
inline const char* event_name(HardEvent e) {
  static const char* const names[] = {"MTE2_MTE3", "MTE3_MTE2", "MTE2_V",
                                      "V_MTE2",    "V_MTE3",    "MTE3_V"};
  return names[int(e)];
}

// Pipes that touch UB in the modeled subset.  S (scalar) accesses are
// synchronous; MTE2 (GM->UB), MTE3 (UB->GM) and V run asynchronously and are
// ordered against each other only by queue events or PipeBarrier<PIPE_ALL>.
enum class Pipe : uint8_t { S = 0, V = 1, MTE2 = 2, MTE3 = 3 };
constexpr uint8_t pipe_bit(Pipe p) { return uint8_t(1u << uint8_t(p)); }
constexpr uint8_t kAllPipes = 0x0f;
inline const char* pipe_name(Pipe p) {
  switch (p) {
    case Pipe::S: return "S (scalar)";
    case Pipe::V: return "V (vector)";
    case Pipe::MTE2: return "MTE2 (GM->UB)";
    default: return "MTE3 (UB->GM)";
  }
}

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// One buffer carved out of UB by InitBuffer (a queue slot or a TBuf).
struct UbBuffer {
  enum class State : uint8_t { Free, Held, Queued };
  int64_t offset = 0;   // from UB start, 32-byte aligned
  int64_t bytes = 0;    // rounded up to 32
  int owner = -1;       // index into Core::owners
  State state = State::Free;
  uint32_t generation = 0;  // bumped by FreeTensor: stale handles fail
  bool alive = true;        // false once its TPipe is gone
  // Hazards: the last writing pipe, the pipes that write is visible to, and
  // pipes whose reads may still be in flight.
  int8_t writer = -1;
  uint8_t visible = kAllPipes;
  uint8_t readers = 0;
  bool holds_free_event = false;  // FreeTensor's event id, released by AllocTensor
};

// A queue or TBuf that owns buffers.
struct Owner {
  std::string what;  // "TQueBind<VECIN, VECOUT, depth 1>" etc.
  bool is_queue = true;
  int depth = 0;
  Pipe producer = Pipe::MTE2, consumer = Pipe::MTE3;
  HardEvent enque_event = HardEvent::MTE2_MTE3, free_event = HardEvent::MTE3_MTE2;
  std::vector<int> buffers;  // indices into Core::bufs
  std::vector<int> fifo;     // enqueued buffers, oldest first
  size_t next = 0;           // round-robin start for AllocTensor
  int held = 0;
};

struct Stats {
  int64_t launches = 0, cores_run = 0, active_cores = 0;
  int64_t copies_in = 0, copies_out = 0, bytes_in = 0, bytes_out = 0;
  int64_t max_copy_bytes = 0, ub_peak_bytes = 0, scalar_gm_reads = 0;
  int64_t max_queue_occupancy = 0, tile_bytes = 0;
  // DMA bursts: contiguous GM byte ranges per DataCopy/DataCopyPad (blocks
  // with no GM gap between them form one burst); copies_* count instructions.
  int64_t bursts_in = 0, bursts_out = 0;
  int64_t task_type = -1;  // KERNEL_TASK_TYPE_DEFAULT the kernel declared (-1: none)
};

struct GmRegion {
  uintptr_t begin, end;
  std::string name;
};

struct GmAccess {
  uintptr_t begin, end;
  int32_t core;
  bool write;
};

class Launch {
 public:
  // task_ratio: AIV bodies per logical core.  1 = AIV-only launch
  // (GetBlockIdx in [0, block_dim)); 2 = MIX launch with AIC:AIV 1:2, where
  // the vector cores' GetBlockIdx spans [0, 2 * block_dim) while GetBlockNum
  // stays block_dim (GetBlockIdx / GetBlockNum docs).
  Launch(int64_t block_dim, int64_t ub_bytes, int64_t task_ratio = 1,
         int npu_arch = kArchA2)
      : block_dim(block_dim), ub_bytes(ub_bytes), task_ratio(task_ratio),
        npu_arch(npu_arch) {}

  // A buffer the kernel may touch (a launch argument, or what a pointer
  // table points at); `bytes` is what its geometry allows, not more.
  void add_region(const void* p, int64_t bytes, std::string name) {
    if (bytes <= 0) return;
    const auto b = reinterpret_cast<uintptr_t>(p);
    regions_.push_back({b, b + static_cast<uintptr_t>(bytes), std::move(name)});
  }

  // "chunk+132", or for an address in no buffer the nearest one below it.
  std::string where(uintptr_t a) const {
    const GmRegion* below = nullptr;
    for (const GmRegion& r : regions_) {
      if (a >= r.begin && a < r.end) return cat(r.name, "+", a - r.begin);
      if (a >= r.end && (below == nullptr || r.end > below->end)) below = &r;
    }
    if (below != nullptr) {
      return cat(below->name, "+", a - below->begin, " (past its ",
                 below->end - below->begin, " bytes)");
    }
    return cat("0x", std::hex, a);
  }

  bool inside(uintptr_t b, uintptr_t e) const {
    for (const GmRegion& r : regions_) {
      if (b >= r.begin && e <= r.end) return true;
    }
    return false;
  }

  void log(uintptr_t b, uintptr_t e, int32_t core, bool write) {
    log_.push_back({b, e, core, write});
  }

  // Cores of one launch run concurrently with no ordering between them, and
  // MTE2/MTE3 of one core are ordered only through UB events: a GM byte
  // written in a launch must not be touched by anything else in it, except
  // rewritten by the same core's MTE3 (one pipe, in order).
  // GetBlockIdx.md, 同步控制/核间同步 (inter-core sync) docs: cores run in
  // parallel with no ordering unless the kernel synchronises them; within a
  // core, MTE2 and MTE3 are ordered only by events (核内同步 docs).
  void check_races() const {
    std::vector<GmAccess> v(log_);
    std::sort(v.begin(), v.end(), [](const GmAccess& a, const GmAccess& b) {
      return a.begin < b.begin;
    });
    std::vector<const GmAccess*> open;
    for (const GmAccess& x : v) {
      open.erase(std::remove_if(open.begin(), open.end(),
                                [&](const GmAccess* y) { return y->end <= x.begin; }),
                 open.end());
      for (const GmAccess* y : open) {
        if (!(x.write || y->write)) continue;
        if (x.write && y->write && x.core == y->core) continue;
        const GmAccess& w = x.write ? x : *y;
        const GmAccess& o = x.write ? *y : x;
        const uintptr_t lo = std::max(x.begin, y->begin);
        const uintptr_t hi = std::min(x.end, y->end);
        throw Violation(cat(
            "AscendC simulation: GM data race: core ", w.core, " writes ",
            hi - lo, " bytes at ", where(lo), " that ",
            o.core == w.core ? "the same core also reads"
                             : cat("core ", o.core, o.write ? " also writes" : " reads"),
            " in the same launch; cores run concurrently and MTE2/MTE3 are "
            "unordered without a barrier, so the result is undefined"));
      }
      open.push_back(&x);
    }
  }

  const int64_t block_dim;
  const int64_t ub_bytes;
  const int64_t task_ratio;
  const int npu_arch;
  Stats stats;

 private:
  std::vector<GmRegion> regions_;
  std::vector<GmAccess> log_;
};

class Core {
 public:
  Core(Launch& launch, int64_t idx)
      : launch(launch), idx(idx), ub(launch.ub_bytes, 0xa5), written(launch.ub_bytes, 0) {}
  // `ub` starts as junk (what a previous kernel left); `written` is what
  // the checks rely on.

  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    throw Violation(cat("AscendC simulation: core ", idx, " of ",
                        launch.block_dim * launch.task_ratio, ": ", parts...));
  }

  // Errors found in destructors (a leaked tensor at kernel end) cannot be
  // thrown there; they are raised when the core's body has returned.
  void defer(std::string message) {
    if (deferred.empty()) deferred = std::move(message);
  }

  Launch& launch;
  const int64_t idx;
  std::vector<uint8_t> ub;
  std::vector<uint8_t> written;  // 1 where UB holds bytes this kernel wrote
  std::vector<UbBuffer> bufs;
  std::vector<Owner> owners;
  int64_t ub_used = 0;
  int buffers_total = 0;
  int events_in_use[int(HardEvent::kKinds)] = {};  // of the live TPipe
  int pipes_alive = 0;
  uint32_t pipe_serial = 0;  // identifies the live TPipe
  bool did_copy = false;
  std::string deferred;

  // TPipe::AllocEventID / ReleaseEventID (kernel_tpipe_impl.h): a kind has
  // QUE_MAX_EVENT ids; taking one more is an error there (an assert in the
  // CPU-debug build, undefined synchronisation on the NPU).
  void alloc_event(HardEvent e, const char* api) {
    int& n = events_in_use[int(e)];
    if (n >= kQueMaxEvent) {
      fail(api, ": all ", kQueMaxEvent, " event ids of HardEvent::", event_name(e),
           " are in use (QUE_MAX_EVENT); each enqueued tensor holds one forward "
           "event and each freed but not re-allocated buffer one backward event");
    }
    ++n;
  }
  void release_event(HardEvent e) { --events_in_use[int(e)]; }
};

inline Core*& current_slot() {
  thread_local Core* c = nullptr;
  return c;
}

inline Core& current() {
  Core* c = current_slot();
  if (c == nullptr) {
    throw Violation(
        "AscendC simulation: AscendC API called outside a simulated kernel "
        "launch (no AI core is running)");
  }
  return *c;
}

// Makes `core` the running core for the lifetime of the guard.
class CoreScope {
 public:
  explicit CoreScope(Core& core) : prev_(current_slot()) { current_slot() = &core; }
  ~CoreScope() { current_slot() = prev_; }
  CoreScope(const CoreScope&) = delete;
  CoreScope& operator=(const CoreScope&) = delete;

 private:
  Core* prev_;
};

// Runs the kernel body once per AI core of the launch, each with its own
// block index and a fresh UB, then checks GM races across all cores.
template <typename Body>
void run_cores(Launch& launch, Body&& body) {
  for (int64_t i = 0; i < launch.block_dim * launch.task_ratio; ++i) {
    Core core(launch, i);
    {
      CoreScope scope(core);
      body();
    }
    if (!core.deferred.empty()) throw Violation(core.deferred);
    launch.stats.cores_run += 1;
    launch.stats.active_cores += core.did_copy ? 1 : 0;
  }
  launch.check_races();
  launch.stats.launches += 1;
}

// ---- UB hazards --------------------------------------------------------------

// Pipe `p` accesses buffer `b`.  A read (or write) needs the last write by
// another pipe to be visible to p (handed over by a queue event or a
// barrier); a write also needs other pipes' reads of b to be complete.
// 同步控制/核内同步 (intra-core synchronisation) docs: MTE2, MTE3, V and S run
// asynchronously; a queue's EnQue/DeQue and FreeTensor/AllocTensor events or
// PipeBarrier order their accesses to one buffer.
inline void ub_touch(Core& c, UbBuffer& b, Pipe p, bool write, const char* api) {
  if (b.writer >= 0 && !(b.visible & pipe_bit(p))) {
    c.fail(api, ": ", pipe_name(p), write ? " writes" : " reads",
           " a UB buffer whose last write by ", pipe_name(Pipe(b.writer)),
           " was not handed over to it (EnQue/DeQue on a queue from ",
           pipe_name(Pipe(b.writer)), " to ", pipe_name(p),
           ", or PipeBarrier<PIPE_ALL>): the pipes run concurrently");
  }
  if (write) {
    const uint8_t others = b.readers & uint8_t(~pipe_bit(p));
    if (others != 0) {
      Pipe r = Pipe::S;
      for (uint8_t i = 0; i < 4; ++i) {
        if (others & (1u << i)) r = Pipe(i);
      }
      c.fail(api, ": ", pipe_name(p), " overwrites a UB buffer that ",
             pipe_name(r), " may still be reading (FreeTensor/AllocTensor or "
             "PipeBarrier<PIPE_ALL> must separate them)");
    }
    b.writer = int8_t(p);
    b.visible = pipe_bit(p);
    b.readers = 0;
  } else if (p != Pipe::S) {  // scalar reads complete before the next op
    b.readers |= pipe_bit(p);
  }
}

}  // namespace lmca::sim
