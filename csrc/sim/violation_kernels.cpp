// SPDX-License-Identifier: Apache-2.0
// Planted violations: tiny AscendC kernels, each breaking one modeled rule,
// so the tests can show the simulation catches it (and that "control", a
// correct copy written the same way, passes).  Written against the same
// "kernel_operator.h" as the real kernels.
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_operator.h"
#include "sim/sim_backend.h"
#include "sim/sim_violations.h"

namespace {

using namespace AscendC;
using Bind = TQueBind<TPosition::VECIN, TPosition::VECOUT, 1>;

constexpr uint32_t kScratch = 4096;  // bytes of GM the launch passes

GlobalTensor<uint8_t> scratch(GM_ADDR gm, uint32_t bytes = kScratch) {
  GlobalTensor<uint8_t> g;
  g.SetGlobalBuffer(gm, bytes);
  return g;
}

const DataCopyExtParams kRow{1, 6, 0, 0, 0};  // one unaligned 6-byte row
const DataCopyPadExtParams<uint8_t> kNoPad{false, 0, 0, 0};

// GM[0:6) -> UB -> GM[64 + 64 * core, +6), as the real kernels move a row.
void control(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  q.EnQue(t);
  t = q.DeQue<uint8_t>();
  DataCopyPad(scratch(gm)[64 + 64 * GetBlockIdx()], t, kRow);
  q.FreeTensor(t);
}

void misaligned_datacopy_length(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopy(t, scratch(gm), 6);  // DataCopy moves whole 32-byte blocks
}

void misaligned_datacopy_ub_address(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopy(t[8], scratch(gm), 32);  // UB address 8: not 32-byte aligned
}

void ub_overflow(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 128 * 1024);  // 256 KiB of a 192 KiB UB
}

void dequeue_empty(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  [[maybe_unused]] LocalTensor<uint8_t> t = q.DeQue<uint8_t>();
}

void enqueue_beyond_depth(GM_ADDR) {
  TPipe pipe;
  Bind q;  // depth 1
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> a = q.AllocTensor<uint8_t>();
  LocalTensor<uint8_t> b = q.AllocTensor<uint8_t>();
  q.EnQue(a);
  q.EnQue(b);
}

void alloc_beyond_count(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  [[maybe_unused]] LocalTensor<uint8_t> a = q.AllocTensor<uint8_t>();
  [[maybe_unused]] LocalTensor<uint8_t> b = q.AllocTensor<uint8_t>();
  [[maybe_unused]] LocalTensor<uint8_t> c = q.AllocTensor<uint8_t>();
}

void free_not_allocated(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  q.FreeTensor(t);
  q.FreeTensor(t);  // already freed
}

void use_after_free(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  q.FreeTensor(t);
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
}

void unbound_local_tensor(GM_ADDR gm) {
  LocalTensor<uint8_t> t;  // never came from a queue or buffer
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
}

void tensor_leaked(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  [[maybe_unused]] LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();  // never freed
}

// MTE3 reads what MTE2 wrote with no EnQue/DeQue between them.
void copy_out_without_handover(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  DataCopyPad(scratch(gm)[64], t, kRow);
}

// A GM -> VECIN queue hands MTE2's data to the vector unit, not to MTE3.
void vecin_queue_for_copy_out(GM_ADDR gm) {
  TPipe pipe;
  TQue<TPosition::VECIN, 1> q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  q.EnQue(t);
  t = q.DeQue<uint8_t>();
  DataCopyPad(scratch(gm)[64], t, kRow);
}

// A 6-byte row stored back with an aligned DataCopy: 26 undefined bytes.
void store_unwritten_ub(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  q.EnQue(t);
  t = q.DeQue<uint8_t>();
  DataCopy(scratch(gm)[64], t, 32);
}

void gm_out_of_bounds(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  // The GlobalTensor claims more than the launch passed.
  DataCopyPad(t, scratch(gm, 2 * kScratch)[kScratch], kRow, kNoPad);
}

// blockLen is 21 bits: [0, 2097151] (DataCopyPad docs).
void blocklen_too_long(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), DataCopyExtParams{1, 1u << 21, 0, 0, 0}, kNoPad);
}

// blockCount is at most 4095 (DataCopyPad docs).
void blockcount_too_large(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), DataCopyExtParams{4096, 1, 0, 0, 0}, kNoPad);
}

// Legal on A2/A3: a zero blockLen or blockCount is a NOP (DataCopyPad docs).
void zero_length_copies(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), DataCopyExtParams{1, 0, 0, 0, 0}, kNoPad);
  DataCopyPad(t, scratch(gm), DataCopyExtParams{0, 6, 0, 0, 0}, kNoPad);
  DataCopyPad(scratch(gm)[64], t, DataCopyExtParams{1, 0, 0, 0, 0});
  q.FreeTensor(t);
}

// Nine freed buffers of one queue hold nine MTE3_MTE2 event ids; a TPipe
// has QUE_MAX_EVENT = 8 per kind.
void free_events_exhausted(GM_ADDR) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 9, 32);
  LocalTensor<uint8_t> t[9];
  for (auto& x : t) x = q.AllocTensor<uint8_t>();
  for (auto& x : t) q.FreeTensor(x);
}

// Legal: ten queue buffers on VECIN, in queues whose events differ in kind
// (MTE3_MTE2 and V_MTE2), each used at once.
void ten_vecin_buffers_two_event_kinds(GM_ADDR) {
  TPipe pipe;
  Bind q;
  TQue<TPosition::VECIN, 1> v;
  pipe.InitBuffer(q, 5, 32);
  pipe.InitBuffer(v, 5, 32);
  LocalTensor<uint8_t> a[5], b[5];
  for (int i = 0; i < 5; ++i) {
    a[i] = q.AllocTensor<uint8_t>();
    b[i] = v.AllocTensor<uint8_t>();
  }
  for (int i = 0; i < 5; ++i) {
    q.FreeTensor(a[i]);
    v.FreeTensor(b[i]);
  }
}

// Legal: a depth-0 (in-place) queue, with its in-place AllocTensor/DeQue.
void inplace_queue(GM_ADDR gm) {
  TPipe pipe;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, 0> q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t;
  q.AllocTensor<uint8_t>(t);
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  q.EnQue(t);
  q.DeQue<uint8_t>(t);
  DataCopyPad(scratch(gm)[64 + 64 * GetBlockIdx()], t, kRow);
  q.FreeTensor(t);
}

// A depth-0 queue keeps two event ids per buffer for the TPipe's life:
// nine buffers need nine of each kind.
void inplace_queue_events_exhausted(GM_ADDR) {
  TPipe pipe;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, 0> q;
  pipe.InitBuffer(q, 9, 32);
}

// Legal: TBuf's position defaults to LCM (= VECCALC).
void tbuf_default_position(GM_ADDR) {
  static_assert(TPosition::LCM == TPosition::VECCALC, "LCM aliases VECCALC");
  TPipe pipe;
  TBuf<> buf;
  pipe.InitBuffer(buf, 64);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  t.SetValue(0, 7);
  if (t.GetValue(0) != 7) lmca::sim::current().fail("TBuf<> lost a byte");
}

// Splits 64 words of GM by GetBlockIdx() / GetBlockNum() without checking
// the index: under a MIX launch the extra vector cores read past the data.
void split_by_core(GM_ADDR gm, bool guard) {
  if (guard && GetBlockIdx() >= GetBlockNum()) return;
  GlobalTensor<int64_t> words;
  words.SetGlobalBuffer(reinterpret_cast<int64_t*>(gm), kScratch / 8 / 8);
  const int64_t n = kScratch / 8 / 8, per = (n + GetBlockNum() - 1) / GetBlockNum();
  for (int64_t i = GetBlockIdx() * per; i < (GetBlockIdx() + 1) * per && i < 2 * n; ++i) {
    (void)words.GetValue(static_cast<uint64_t>(i));
  }
}
void missing_core_guard(GM_ADDR gm) { split_by_core(gm, false); }
void core_guard(GM_ADDR gm) { split_by_core(gm, true); }

// Every core stores to the same bytes: unordered across cores.
void cross_core_write_race(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), kRow, kNoPad);
  q.EnQue(t);
  t = q.DeQue<uint8_t>();
  DataCopyPad(scratch(gm)[64], t, kRow);
  q.FreeTensor(t);
}

struct Planted {
  const char* name;
  void (*body)(GM_ADDR);
};

const Planted kPlanted[] = {
    {"control", control},
    {"misaligned_datacopy_length", misaligned_datacopy_length},
    {"misaligned_datacopy_ub_address", misaligned_datacopy_ub_address},
    {"ub_overflow", ub_overflow},
    {"dequeue_empty", dequeue_empty},
    {"enqueue_beyond_depth", enqueue_beyond_depth},
    {"alloc_beyond_count", alloc_beyond_count},
    {"free_not_allocated", free_not_allocated},
    {"use_after_free", use_after_free},
    {"unbound_local_tensor", unbound_local_tensor},
    {"tensor_leaked", tensor_leaked},
    {"copy_out_without_handover", copy_out_without_handover},
    {"vecin_queue_for_copy_out", vecin_queue_for_copy_out},
    {"store_unwritten_ub", store_unwritten_ub},
    {"gm_out_of_bounds", gm_out_of_bounds},
    {"blocklen_too_long", blocklen_too_long},
    {"blockcount_too_large", blockcount_too_large},
    {"zero_length_copies", zero_length_copies},
    {"free_events_exhausted", free_events_exhausted},
    {"ten_vecin_buffers_two_event_kinds", ten_vecin_buffers_two_event_kinds},
    {"inplace_queue", inplace_queue},
    {"inplace_queue_events_exhausted", inplace_queue_events_exhausted},
    {"tbuf_default_position", tbuf_default_position},
    {"missing_core_guard", missing_core_guard},
    {"core_guard", core_guard},
    {"cross_core_write_race", cross_core_write_race},
};

}  // namespace

namespace lmca::sim {

std::vector<std::string> planted_violation_names() {
  std::vector<std::string> out;
  for (const Planted& p : kPlanted) out.emplace_back(p.name);
  return out;
}

Stats run_planted_violation(const std::string& name, const Config& cfg) {
  for (const Planted& p : kPlanted) {
    if (name != p.name) continue;
    Session session(cfg);
    std::vector<uint8_t> gm(kScratch, 0x11);
    Launch launch(cfg.block_dim, cfg.ub_bytes, cfg.task_ratio, npu_arch_of(cfg.soc));
    launch.add_region(gm.data(), kScratch, "scratch");
    run_cores(launch, [&] { p.body(gm.data()); });
    add_stats(launch.stats);
    return session.stats();
  }
  throw std::invalid_argument("unknown planted violation '" + name + "'");
}

}  // namespace lmca::sim
