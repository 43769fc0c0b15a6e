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

void blocklen_zero(GM_ADDR gm) {
  TPipe pipe;
  Bind q;
  pipe.InitBuffer(q, 2, 256);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopyPad(t, scratch(gm), DataCopyExtParams{1, 0, 0, 0, 0}, kNoPad);
}

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
    {"blocklen_zero", blocklen_zero},
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
    Launch launch(cfg.block_dim, cfg.ub_bytes);
    launch.add_region(gm.data(), kScratch, "scratch");
    run_cores(launch, [&] { p.body(gm.data()); });
    add_stats(launch.stats);
    return session.stats();
  }
  throw std::invalid_argument("unknown planted violation '" + name + "'");
}

}  // namespace lmca::sim
