// SPDX-License-Identifier: Apache-2.0
// TPipe, TQue / TQueBind and TBuf of the AscendC simulation (included by
// ascendc_sim.h).
//
// InitBuffer carves 32-byte-rounded buffers out of the core's UB and fails
// on overflow or too many buffers.  Queue buffers cycle Free -> Held
// (AllocTensor) -> Queued (EnQue) -> Held (DeQue) -> Free (FreeTensor); any
// other transition is an error.  The queue's binding says which pipes its
// events order: EnQue/DeQue hand the producer's write to the consumer,
// FreeTensor/AllocTensor hand the consumer's reads back to the producer.
//   TQue<VECIN>  = GM -> VECIN      MTE2 -> V
//   TQue<VECOUT> = VECOUT -> GM     V -> MTE3
//   TQueBind<VECIN, VECOUT>         MTE2 -> MTE3 (copy-only kernels)
#pragma once

namespace AscendC {

class TPipe;
template <TPosition pos>
class TBuf;
using lmca::sim::HardEvent;

namespace sim_detail {
using lmca::sim::Owner;

// Index of a modeled queue binding, -1 if outside the subset.
constexpr int binding(TPosition src, TPosition dst) {
  if (src == TPosition::GM && dst == TPosition::VECIN) return 0;
  if (src == TPosition::VECOUT && dst == TPosition::GM) return 1;
  if (src == TPosition::VECIN && dst == TPosition::VECOUT) return 2;
  return -1;
}

inline Owner binding_owner(int kind, int depth) {
  static const char* const names[] = {"TQue<VECIN>", "TQue<VECOUT>",
                                      "TQueBind<VECIN, VECOUT>"};
  static const Pipe prod[] = {Pipe::MTE2, Pipe::V, Pipe::MTE2};
  static const Pipe cons[] = {Pipe::V, Pipe::MTE3, Pipe::MTE3};
  // GetQueEvt (kernel_event.h): forward (EnQue) and backward (FreeTensor)
  // events of each binding.
  static const HardEvent enq[] = {HardEvent::MTE2_V, HardEvent::V_MTE3, HardEvent::MTE2_MTE3};
  static const HardEvent fre[] = {HardEvent::V_MTE2, HardEvent::MTE3_V, HardEvent::MTE3_MTE2};
  Owner o;
  o.what = lmca::sim::cat(names[kind], " (depth ", depth, ")");
  o.depth = depth;
  o.producer = prod[kind];
  o.consumer = cons[kind];
  o.enque_event = enq[kind];
  o.free_event = fre[kind];
  return o;
}

// InitBuffer: num buffers of len bytes (rounded up to 32) for a new owner.
inline int carve(Core& c, const TPipe& pipe, int position, uint8_t num,
                 uint32_t len, Owner o, const char* api);

class Queue {
 public:
  bool init(const TPipe& pipe, uint8_t num, uint32_t len, int kind, int depth,
            int position) {
    Core& c = lmca::sim::current();
    if (core_ == &c && id_ >= 0) {
      c.fail("InitBuffer: the queue already has buffers (TPipe::Reset first)");
    }
    id_ = carve(c, pipe, position, num, len, binding_owner(kind, depth),
                "InitBuffer");
    core_ = &c;
    return true;
  }

  // TQue AllocTensor.md: takes a free buffer; none free means a deadlock.
  LocalRef alloc() {
    Core& c = check("AllocTensor");
    Owner& o = c.owners[id_];
    const size_t n = o.buffers.size();
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (o.next + k) % n;
      UbBuffer& b = c.bufs[o.buffers[i]];
      if (b.state != UbBuffer::State::Free) continue;
      b.state = UbBuffer::State::Held;
      o.next = i + 1;
      // AllocBuffer waits on and releases the buffer's FreeTensor event.
      if (b.holds_free_event) c.release_event(o.free_event);
      b.holds_free_event = false;
      // A fresh tensor holds whatever the previous user left: undefined.
      std::memset(c.written.data() + b.offset, 0, b.bytes);
      return LocalRef{&c, o.buffers[i], b.generation, 0, b.bytes};
    }
    c.fail("AllocTensor on ", o.what, ": all ", n, " buffers from InitBuffer "
           "are allocated or enqueued; on the NPU the core would wait forever");
  }

  // TQue EnQue.md: hands the tensor from the producing pipe to the consumer.
  void enque(const LocalRef& r) {
    Core& c = check("EnQue");
    UbBuffer& b = own(c, r, "EnQue");
    Owner& o = c.owners[id_];
    // TQue简介.md: n consecutive EnQue need depth >= n; depth 0 (in-place
    // queues) has no such bound and its events were taken by InitBuffer.
    if (o.depth > 0 && static_cast<int>(o.fifo.size()) >= o.depth) {
      c.fail("EnQue on ", o.what, ": ", o.fifo.size(), " tensor(s) already "
             "enqueued without DeQue; n consecutive EnQue need depth >= n");
    }
    if (o.depth > 0) c.alloc_event(o.enque_event, "EnQue");
    b.state = UbBuffer::State::Queued;
    o.fifo.push_back(r.buf);
    auto& s = c.launch.stats;
    s.max_queue_occupancy = std::max<int64_t>(s.max_queue_occupancy, o.fifo.size());
  }

  // TQue DeQue.md: waits for an enqueued tensor (none: a deadlock).
  LocalRef deque() {
    Core& c = check("DeQue");
    Owner& o = c.owners[id_];
    if (o.fifo.empty()) {
      c.fail("DeQue from an empty ", o.what, ": nothing was enqueued; on the "
             "NPU the core would wait forever");
    }
    const int i = o.fifo.front();
    o.fifo.erase(o.fifo.begin());
    if (o.depth > 0) c.release_event(o.enque_event);
    UbBuffer& b = c.bufs[i];
    b.state = UbBuffer::State::Held;
    // The EnQue/DeQue event: the producer's write is now visible to the
    // consumer (and only to it).
    if (b.writer == int8_t(o.producer)) b.visible |= lmca::sim::pipe_bit(o.consumer);
    return LocalRef{&c, i, b.generation, 0, b.bytes};
  }

  // TQue FreeTensor.md: returns a tensor AllocTensor/DeQue gave out.
  void free(const LocalRef& r) {
    Core& c = check("FreeTensor");
    if (r.buf < 0) c.fail("FreeTensor of a LocalTensor that was never allocated");
    UbBuffer& b = own(c, r, "FreeTensor");
    if (r.off != 0) {
      c.fail("FreeTensor needs the tensor AllocTensor/DeQue returned, not a "
             "view at offset ", r.off);
    }
    const Owner& o = c.owners[id_];
    // FreeBuffer takes a backward event id until the buffer is allocated
    // again (depth 0: the one InitBuffer took).
    if (o.depth > 0) {
      c.alloc_event(o.free_event, "FreeTensor");
      b.holds_free_event = true;
    }
    b.state = UbBuffer::State::Free;
    b.generation += 1;
    // The FreeTensor/AllocTensor event: the consumer is done with the buffer.
    b.readers &= uint8_t(~lmca::sim::pipe_bit(o.consumer));
    if (b.writer == int8_t(o.consumer)) b.visible |= lmca::sim::pipe_bit(o.producer);
  }

 private:
  Core& check(const char* api) const {
    Core& c = lmca::sim::current();
    if (core_ != &c || id_ < 0) c.fail(api, ": queue used before TPipe::InitBuffer");
    return c;
  }

  // A held (not enqueued, not freed) tensor of this queue.
  UbBuffer& own(Core& c, const LocalRef& r, const char* api) const {
    if (r.buf >= 0 && r.core == &c && c.bufs[r.buf].owner != id_) {
      c.fail(api, ": the tensor belongs to another queue or buffer (",
             c.owners[c.bufs[r.buf].owner].what, ")");
    }
    if (r.buf >= 0 && r.core == &c && c.bufs[r.buf].state == UbBuffer::State::Free) {
      c.fail(api, " of a tensor that is not allocated (never allocated, or "
                  "already freed)");
    }
    return resolve(c, r, api);
  }

  Core* core_ = nullptr;
  int id_ = -1;
};
}  // namespace sim_detail

class TPipe {
 public:
  // TPipe/Init.md, InitBuffer.md: one TPipe per kernel manages its UB and events.
  __aicore__ inline TPipe() : core_(&lmca::sim::current()) {
    if (core_->pipes_alive != 0) {
      core_->fail("a second TPipe was created while one is alive");
    }
    core_->pipes_alive = 1;
    serial_ = ++core_->pipe_serial;
  }

  // Buffers die with the pipe; tensors still allocated or enqueued mean
  // unpaired AllocTensor/FreeTensor or EnQue/DeQue.
  __aicore__ inline ~TPipe() {
    for (auto& b : core_->bufs) {
      if (!b.alive) continue;
      const auto& o = core_->owners[b.owner];
      if (o.is_queue && b.state != lmca::sim::UbBuffer::State::Free) {
        core_->defer(lmca::sim::cat(
            "AscendC simulation: core ", core_->idx, " of ",
            core_->launch.block_dim, ": kernel ended with a tensor of ", o.what,
            b.state == lmca::sim::UbBuffer::State::Queued
                ? " still enqueued (EnQue without DeQue)"
                : " still allocated (AllocTensor/DeQue without FreeTensor)"));
      }
      b.alive = false;
    }
    core_->ub_used = 0;
    core_->buffers_total = 0;
    std::fill(std::begin(core_->events_in_use), std::end(core_->events_in_use), 0);
    core_->pipes_alive = 0;
  }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <class Q>
  __aicore__ inline bool InitBuffer(Q& que, uint8_t num, uint32_t len) {
    return que.sim_init(*this, num, len);
  }
  template <TPosition pos>
  __aicore__ inline bool InitBuffer(TBuf<pos>& buf, uint32_t len) {
    return buf.sim_init(*this, len);
  }

  // Simulation bookkeeping (not AscendC API).
  const lmca::sim::Core* sim_core() const { return core_; }
  uint32_t sim_serial() const { return serial_; }

 private:
  lmca::sim::Core* core_;
  uint32_t serial_ = 0;
};

namespace sim_detail {
inline int carve(Core& c, const TPipe& pipe, int position, uint8_t num,
                 uint32_t len, Owner o, const char* api) {
  if (pipe.sim_core() != &c || pipe.sim_serial() != c.pipe_serial ||
      c.pipes_alive == 0) {
    c.fail(api, ": the TPipe is not this core's live pipe");
  }
  // TPipe/InitBuffer.md, kernel_tpipe_impl.h: num in [1, QBUF_MAX_LEN], len > 0.
  if (num == 0 || len == 0) c.fail(api, ": num = ", int(num), ", len = ", len, " must be > 0");
  const int64_t each = ceil32(len);
  const int64_t need = each * num;
  if (c.ub_used + need > c.launch.ub_bytes) {
    c.fail(api, ": Unified Buffer overflow: ", int(num), " x ", each,
           " bytes (len ", len, " rounded up to 32) with ", c.ub_used, " of ",
           c.launch.ub_bytes, " UB bytes already in use");
  }
  if (c.buffers_total + num > lmca::sim::kMaxBuffersPerKernel) {
    c.fail(api, ": more than ", lmca::sim::kMaxBuffersPerKernel,
           " buffers in one kernel");
  }
  // Depth-0 (in-place) queues take both event ids of every buffer here and
  // keep them for the TPipe's life (kernel_tpipe_impl.h, InitBuffer).
  if (o.is_queue && o.depth == 0) {
    for (int i = 0; i < num; ++i) {
      c.alloc_event(o.enque_event, api);
      c.alloc_event(o.free_event, api);
    }
  }
  const int id = static_cast<int>(c.owners.size());
  for (int i = 0; i < num; ++i) {
    UbBuffer b;
    b.offset = c.ub_used + i * each;
    b.bytes = each;
    b.owner = id;
    b.state = o.is_queue ? UbBuffer::State::Free : UbBuffer::State::Held;
    o.buffers.push_back(static_cast<int>(c.bufs.size()));
    c.bufs.push_back(b);
  }
  c.owners.push_back(std::move(o));
  c.ub_used += need;
  c.buffers_total += num;
  auto& s = c.launch.stats;
  s.ub_peak_bytes = std::max(s.ub_peak_bytes, c.ub_used);
  return id;
}
}  // namespace sim_detail

template <TPosition src, TPosition dst, int32_t depth, auto mask = 0>
class TQueBind {
  static_assert(sim_detail::binding(src, dst) >= 0,
                "queue binding outside the simulated subset");
  static_assert(depth >= 0, "queue depth must be >= 0");

 public:
  // Depth 0 is the in-place form (TQue简介.md): AllocTensor(LocalTensor&)
  // and DeQue(LocalTensor&); the others need depth >= 1, as in
  // kernel_tquebind_impl.h.
  template <typename T>
  __aicore__ inline LocalTensor<T> AllocTensor() {
    static_assert(depth != 0, "must use AllocTensor<LocalTensor&> api while tque's depth is zero");
    return LocalTensor<T>(q_.alloc());
  }
  template <typename T>
  __aicore__ inline void AllocTensor(LocalTensor<T>& tensor) {
    static_assert(depth == 0, "can not AllocTensor in place while tque's depth is non zero");
    tensor = LocalTensor<T>(q_.alloc());
  }
  template <typename T>
  __aicore__ inline void DeQue(LocalTensor<T>& tensor) {
    static_assert(depth == 0, "can not DeQue tensor in place while tque's depth is non zero");
    tensor = LocalTensor<T>(q_.deque());
  }
  template <typename T>
  __aicore__ inline bool EnQue(const LocalTensor<T>& tensor) {
    q_.enque(tensor.sim_ref());
    return true;
  }
  template <typename T>
  __aicore__ inline LocalTensor<T> DeQue() {
    static_assert(depth != 0, "must use DeQue<LocalTensor&> api while tque's depth is zero");
    return LocalTensor<T>(q_.deque());
  }
  template <typename T>
  __aicore__ inline void FreeTensor(LocalTensor<T>& tensor) {
    q_.free(tensor.sim_ref());
  }

  // Simulation bookkeeping (TPipe::InitBuffer).
  bool sim_init(const TPipe& pipe, uint8_t num, uint32_t len) {
    constexpr TPosition pos = src == TPosition::GM ? dst : src;
    return q_.init(pipe, num, len, sim_detail::binding(src, dst), depth,
                   static_cast<int>(pos));
  }

 private:
  sim_detail::Queue q_;
};

template <TPosition pos, int32_t depth, auto mask = 0>
class TQue : public TQueBind<pos == TPosition::VECOUT ? pos : TPosition::GM,
                             pos == TPosition::VECOUT ? TPosition::GM : pos,
                             depth, mask> {};

// A plain buffer: no events, so pipes sharing it need PipeBarrier<PIPE_ALL>.
// Its position defaults to LCM (= VECCALC), as in kernel_tpipe.h.
template <TPosition pos = TPosition::LCM>
class TBuf {
 public:
  template <typename T>
  __aicore__ inline LocalTensor<T> Get() {
    return Get<T>(static_cast<uint32_t>(bytes_ / int64_t(sizeof(T))));
  }
  template <typename T>
  __aicore__ inline LocalTensor<T> Get(uint32_t len) {
    lmca::sim::Core& c = lmca::sim::current();
    if (core_ != &c || id_ < 0) c.fail("TBuf::Get: used before TPipe::InitBuffer");
    const int buf = c.owners[id_].buffers[0];
    if (int64_t(len) * int64_t(sizeof(T)) > bytes_) {
      c.fail("TBuf::Get(", len, "): beyond its ", bytes_, " bytes");
    }
    return LocalTensor<T>(sim_detail::LocalRef{&c, buf, c.bufs[buf].generation, 0,
                                               int64_t(len) * int64_t(sizeof(T))});
  }

  bool sim_init(const TPipe& pipe, uint32_t len) {
    lmca::sim::Core& c = lmca::sim::current();
    if (core_ == &c && id_ >= 0) c.fail("InitBuffer: the TBuf already has a buffer");
    lmca::sim::Owner o;
    o.what = "TBuf";
    o.is_queue = false;
    id_ = sim_detail::carve(c, pipe, static_cast<int>(pos), 1, len, o, "InitBuffer");
    core_ = &c;
    bytes_ = c.bufs[c.owners[id_].buffers[0]].bytes;
    return true;
  }

 private:
  lmca::sim::Core* core_ = nullptr;
  int id_ = -1;
  int64_t bytes_ = 0;
};

}  // namespace AscendC
