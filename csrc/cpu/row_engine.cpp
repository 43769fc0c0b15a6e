// SPDX-License-Identifier: Apache-2.0
#include "cpu/row_engine.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>


// Non-temporal stores need x86-64 intrinsics; the AVX2 loop is compiled with
// a target attribute (GCC/Clang) and chosen at run time, so the module still
// builds for, and runs on, any x86-64 CPU.  Elsewhere (aarch64) spans are
// plain memcpy.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMCA_STREAM_STORES 1
#if defined(__GNUC__) || defined(__clang__)
#define LMCA_STREAM_AVX2 1
#else
#define LMCA_STREAM_AVX2 0
#endif
#else
#define LMCA_STREAM_STORES 0
#define LMCA_STREAM_AVX2 0
#endif

namespace lmca::cpu {
namespace {

// One maximal run of consecutive rows with consecutive slots in one block.
struct Run {
  int64_t plane;
  int64_t row;   // first chunk row
  int64_t slot;  // first slot
  int64_t n;     // rows
};

// Items are split so that one thread never owns a huge run alone; 1 MiB keeps
// per-item overhead negligible while giving every thread work.
constexpr int64_t kMaxItemBytes = 1 << 20;
// Target bytes per parallel task: below this, thread hand-off costs more
// than the copy.
constexpr int64_t kTaskBytes = 256 << 10;
// In a job that streams, spans from this length on use non-temporal stores:
// below it the memcpy'd partial lines at both ends are most of the span.
// 256 bytes still covers HND rows (one head x token) and multi-plane rows.
constexpr int64_t kStreamMinSpanBytes = 256;

// A job streams (non-temporal stores) when it moves at least this many bytes:
// by default every job, since a chunk's destination (LMCache's pool on a
// store, the paged cache on a load) is not read again soon.  Skipping the
// streams for a chunk that fits in the cache was tried (memcpy below half
// the L3): on a 32 MiB-L3 EPYC it stored a 7.3 MiB multi-plane chunk at
// 0.76x a plain copy_ against 0.92x streamed, so it is not the default.
// LMCA_CPU_STREAM_MIN_BYTES sets another threshold (read once per process).
int64_t stream_job_min_bytes() {
  static const int64_t value = [] {
    if (const char* env = std::getenv("LMCA_CPU_STREAM_MIN_BYTES")) {
      char* end = nullptr;
      const long long v = std::strtoll(env, &end, 10);
      if (end != env && *end == '\0' && v >= 0) return static_cast<int64_t>(v);
    }
    return int64_t{0};
  }();
  return value;
}

#if LMCA_STREAM_STORES
// Bytes up to dst's next 64-byte boundary (at most n): the loops below only
// ever write whole, aligned cache lines with non-temporal stores, because a
// partly written line leaves the write-combining buffer as a partial write,
// which memory has to merge.  With 16-byte alignment the multi-plane store,
// whose chunk rows are not line-aligned, ran at 1.22x a plain copy_ against
// 1.57x with this (34.5 MB chunk, 2 threads, 32 MiB-L3 EPYC).
inline size_t to_line(const uint8_t* dst, size_t n) {
  return std::min(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
}

void stream_copy_sse2(uint8_t* dst, const uint8_t* src, size_t n) {
  const size_t head = to_line(dst, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (size_t i = 0, lines = n / 64; i < lines; ++i, dst += 64, src += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
  std::memcpy(dst, src, n % 64);
}

#if LMCA_STREAM_AVX2
// Same as stream_copy_sse2 with half the instructions per line (1.09x the
// SSE2 loop on one EPYC thread, within noise of it with two).
__attribute__((target("avx2"))) void stream_copy_avx2(uint8_t* dst, const uint8_t* src,
                                                      size_t n) {
  const size_t head = to_line(dst, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (size_t i = 0, lines = n / 64; i < lines; ++i, dst += 64, src += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
  }
  std::memcpy(dst, src, n % 64);
}
#endif

using StreamFn = void (*)(uint8_t*, const uint8_t*, size_t);

StreamFn pick_stream_copy() {
#if LMCA_STREAM_AVX2
  // Also checks that the OS saves the YMM registers.
  if (__builtin_cpu_supports("avx2")) return stream_copy_avx2;
#endif
  return stream_copy_sse2;
}
#endif

// memcpy with non-temporal stores (x86-64); a plain memcpy elsewhere.
// The caller runs store_fence() before its copies may be read elsewhere.
void stream_copy(uint8_t* dst, const uint8_t* src, size_t n) {
#if LMCA_STREAM_STORES
  static const StreamFn fn = pick_stream_copy();
  fn(dst, src, n);
#else
  std::memcpy(dst, src, n);
#endif
}

// Non-temporal stores are weakly ordered: each thread fences its own before
// the parallel region ends, so the data is visible when the op returns.
inline void store_fence() {
#if LMCA_STREAM_STORES
  _mm_sfence();
#endif
}

inline void copy_span(uint8_t* dst, const uint8_t* src, int64_t n, bool stream) {
  if (stream && n >= kStreamMinSpanBytes) {
    stream_copy(dst, src, static_cast<size_t>(n));
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n));
  }
}

void collect_runs(int64_t plane, const PlaneJob& pj, std::vector<Run>& out) {
  const PlaneGeom& g = pj.geom;
  const int64_t rb = row_bytes(g);
  const int64_t max_rows = std::max<int64_t>(1, kMaxItemBytes / std::max<int64_t>(rb, 1));
  int64_t i = std::max<int64_t>(pj.first_row, 0);
  while (i < pj.num_slots) {
    const int64_t s = pj.slots[i];
    if (s < 0) {
      ++i;
      continue;
    }
    int64_t n = 1;
    while (i + n < pj.num_slots && n < max_rows &&
           slot_extends_run(pj.slots[i + n - 1], pj.slots[i + n], g.block_size)) {
      ++n;
    }
    out.push_back(Run{plane, i, s, n});
    i += n;
  }
}

inline void copy_bytes(uint8_t* paged, uint8_t* chunk, int64_t n,
                       bool to_chunk, bool stream) {
  if (to_chunk) {
    copy_span(chunk, paged, n, stream);
  } else {
    copy_span(paged, chunk, n, stream);
  }
}

void copy_run(const PlaneGeom& g, uint8_t* paged_base, uint8_t* chunk_base,
              const Run& r, bool to_chunk, bool stream) {
  const bool one_span = paged_rows_adjacent(g) && chunk_rows_adjacent(g);
  for (int64_t seg = 0; seg < g.num_segs; ++seg) {
    if (one_span) {
      copy_bytes(paged_base + paged_slot_offset(g, r.slot, seg),
                 chunk_base + chunk_offset(g, r.row, seg),
                 run_span_bytes(g, r.n), to_chunk, stream);
      continue;
    }
    for (int64_t k = 0; k < r.n; ++k) {
      copy_bytes(paged_base + paged_slot_offset(g, r.slot + k, seg),
                 chunk_base + chunk_offset(g, r.row + k, seg),
                 run_span_bytes(g, 1), to_chunk, stream);
    }
  }
}

}  // namespace

int64_t row_job_bytes(const RowJob& job) {
  int64_t per_layer = 0;
  std::vector<Run> runs;
  for (size_t p = 0; p < job.planes.size(); ++p) {
    runs.clear();
    collect_runs(static_cast<int64_t>(p), job.planes[p], runs);
    for (const Run& r : runs) per_layer += r.n * row_bytes(job.planes[p].geom);
  }
  return per_layer * job.num_layers;
}

void run_row_job(const RowJob& job) {
  const int64_t num_planes = static_cast<int64_t>(job.planes.size());
  std::vector<Run> runs;
  int64_t run_bytes = 0;
  for (int64_t p = 0; p < num_planes; ++p) {
    const size_t before = runs.size();
    collect_runs(p, job.planes[p], runs);
    for (size_t k = before; k < runs.size(); ++k) {
      run_bytes += runs[k].n * row_bytes(job.planes[p].geom);
    }
  }
  const int64_t per_layer = static_cast<int64_t>(runs.size());
  const int64_t total = per_layer * job.num_layers;
  if (total == 0) return;
  const int64_t avg = std::max<int64_t>(1, run_bytes / per_layer);
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / avg);
  const bool stream = run_bytes * job.num_layers >= stream_job_min_bytes();
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / per_layer;
      const Run& r = runs[item % per_layer];
      const int64_t idx = layer * num_planes + r.plane;
      copy_run(job.planes[r.plane].geom, job.paged_base[idx],
               job.chunk_base[idx], r, job.to_chunk, stream);
    }
    store_fence();
  });
}

void run_memcpy_list(const std::vector<uint8_t*>& dst,
                     const std::vector<const uint8_t*>& src,
                     const std::vector<int64_t>& sizes) {
  // Split big copies into kMaxItemBytes pieces so that one large buffer
  // still uses every thread.
  struct Piece {
    uint8_t* dst;
    const uint8_t* src;
    int64_t n;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t off = 0; off < sizes[i]; off += kMaxItemBytes) {
      pieces.push_back(Piece{dst[i] + off, src[i] + off,
                             std::min<int64_t>(kMaxItemBytes, sizes[i] - off)});
    }
  }
  const int64_t n = static_cast<int64_t>(pieces.size());
  if (n == 0) return;
  int64_t total_bytes = 0;
  for (const Piece& p : pieces) total_bytes += p.n;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, total_bytes / n));
  const bool stream = total_bytes >= stream_job_min_bytes();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      copy_span(pieces[i].dst, pieces[i].src, pieces[i].n, stream);
    }
    store_fence();
  });
}

int64_t probe_copy_threads() {
  std::mutex mu;
  std::set<std::thread::id> seen;
  const int64_t n = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace lmca::cpu
