// The parts every specjax CPU kernel shares: float loads (bf16 widened), small operands as float32, and one pool of
// worker threads that the kernels' chunks run on (one pool per process, whichever kernel calls it).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

constexpr int kLanes = 16;      // one 512-bit vector of float32
constexpr int kGroup = 8;  // rows of x whose sums stay in registers together

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bfloat16 bits, rounded to nearest even (XLA's convert; a NaN stays a quiet NaN).
inline uint16_t F32ToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Round to bfloat16 and back: the value a bfloat16 array holds.
inline float HeldBf16(float f) { return bf16_to_f32(F32ToBf16(f)); }

// A float32 result stored as the output's type (bfloat16: rounded to nearest even).
inline void Store(float* out, float v) { *out = v; }
inline void Store(uint16_t* out, float v) { *out = F32ToBf16(v); }

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

#if defined(__AVX512F__)
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// AMD Zen cores (as GCC's -march=native names them). Their streamed reads of weights prefetched into L1 ran 1.3-2x
// slower than prefetched into L2 (the tied lm_head's product at 1-8 rows, the register tiles at 24-32 rows; a C++
// chain on a 2-core EPYC, docs/benchmarks.md, thirty-first session), where Intel cores chose L1 for those.
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr bool kZen = true;
#else
constexpr bool kZen = false;
#endif
// The cache level that the prefetches of the lm_head's table and of the tiles' columns target: L2 on Zen, L1 on
// the Intel cores they were tuned on (``PrefetchAhead``'s kLocality).
constexpr int kStreamLocality = kZen ? 2 : 3;

// Ask for the cache line ``bytes`` past ``p`` ahead of its use; ``kLocality`` 3 into L1, 2 into L2. A prefetch
// never faults, so the line may lie past a buffer's end (the address is formed as an integer).
template <int kLocality>
inline void PrefetchAhead(const void* p, int64_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes), 0, kLocality);
}

// ---------------------------------------------------------------------------------------------------------------
// A pool of worker threads for one product at a time. The caller publishes a job (a function over chunk indices)
// and takes chunks itself; workers that are awake take the others. A worker spins for a short while after its last
// chunk (the products of a decode step come back to back) and then sleeps. A caller that finds the pool busy (two
// devices of one process calling at once) runs its product on its own thread.
using ChunkFn = void (*)(const void* ctx, int chunk);

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
  }
  ~Pool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(ChunkFn fn, const void* ctx, int n) {
    uint64_t g = (state_.load() >> 32) + 1;
    Slot& s = slots_[g & 1];
    s.fn.store(fn, std::memory_order_relaxed);
    s.ctx.store(ctx, std::memory_order_relaxed);
    s.n.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(g << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    Take(g, fn, ctx, n);
    while (done_.load(std::memory_order_acquire) < n) Pause();
  }

 private:
  struct Slot {
    std::atomic<ChunkFn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int> n{0};
  };

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Take chunks of job ``g`` until none is left (or a newer job was published).
  void Take(uint64_t g, ChunkFn fn, const void* ctx, int n) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) != g || static_cast<int>(s & 0xffffffffu) >= n) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      fn(ctx, static_cast<int>(s & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void Work() {
    uint64_t seen = state_.load() >> 32;
    for (;;) {
      uint64_t g = WaitForJob(seen);
      if (stop_.load()) return;
      seen = g;
      Slot& s = slots_[g & 1];
      Take(g, s.fn.load(std::memory_order_acquire), s.ctx.load(std::memory_order_acquire),
           s.n.load(std::memory_order_acquire));
    }
  }

  uint64_t WaitForJob(uint64_t seen) {
    auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      uint64_t g = state_.load(std::memory_order_acquire) >> 32;
      if (g != seen || stop_.load(std::memory_order_relaxed)) return g;
      Pause();
      if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(300)) break;
    }
    std::unique_lock<std::mutex> lk(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t g;
    while ((g = state_.load(std::memory_order_seq_cst) >> 32) == seen && !stop_.load()) cv_.wait(lk);
    sleepers_.fetch_sub(1);
    return g;
  }

  std::vector<std::thread> workers_;
  Slot slots_[2];
  std::atomic<uint64_t> state_{0};  // job number << 32 | next chunk
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

inline std::mutex g_pool_mu;          // held by the one caller that uses the pool
inline std::unique_ptr<Pool> g_pool;  // null: one thread

inline int DefaultThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// XLA's intra-op pool (the running custom call's ``ffi::ThreadPool``), where ``Parallel`` runs this thread's chunks
// while an ``XlaPoolScope`` holds it; null: specjax's own pool.
inline thread_local xla::ffi::ThreadPool* t_xla_pool = nullptr;

struct XlaPoolScope {
  explicit XlaPoolScope(xla::ffi::ThreadPool* tp) { t_xla_pool = tp; }
  ~XlaPoolScope() { t_xla_pool = nullptr; }
  XlaPoolScope(const XlaPoolScope&) = delete;
  XlaPoolScope& operator=(const XlaPoolScope&) = delete;
};

// One job on XLA's pool: the caller and up to n - 1 of the pool's threads take its chunks; a task that starts after
// the last chunk was taken finds none left and returns (the job, shared with the tasks, outlives the call; the
// chunks' context is read only by the chunks themselves, all done before the caller returns).
struct XlaJob {
  std::atomic<int> next{0}, done{0};
  ChunkFn fn;
  const void* ctx;
  int n;
  void Take() {
    for (int i; (i = next.fetch_add(1)) < n;) {
      fn(ctx, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void ParallelOnXla(xla::ffi::ThreadPool* tp, ChunkFn fn, const void* ctx, int n) {
  auto job = std::make_shared<XlaJob>();
  job->fn = fn; job->ctx = ctx; job->n = n;
  const int helpers = static_cast<int>(std::min<int64_t>(tp->num_threads(), n - 1));
  for (int h = 0; h < helpers; ++h) tp->Schedule([job] { job->Take(); });
  job->Take();
  while (job->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

// Run ``fn`` over ``n`` chunks: on XLA's pool inside an ``XlaPoolScope``, else on specjax's pool when it is free,
// else on this thread.
inline void Parallel(ChunkFn fn, const void* ctx, int n) {
  if (t_xla_pool != nullptr && n > 1) {
    ParallelOnXla(t_xla_pool, fn, ctx, n);
    return;
  }
  std::unique_lock<std::mutex> lk(g_pool_mu, std::try_to_lock);
  if (lk.owns_lock() && g_pool && n > 1) {
    g_pool->Run(fn, ctx, n);
    return;
  }
  for (int i = 0; i < n; ++i) fn(ctx, i);
}

inline int PoolThreads() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return g_pool ? g_pool->threads() : 1;
}

// Chunks of [0, total) aligned to ``align``: about four per thread, none narrower than ``min_width``.
struct Split {
  int64_t width;
  int n;
};

inline Split MakeSplit(int64_t total, int64_t align, int64_t min_width) {
  int threads = PoolThreads();
  int64_t want = threads == 1 ? 1 : 4 * threads;
  int64_t width = (total + want - 1) / want;
  width = std::max<int64_t>(width, min_width);
  width = (width + align - 1) / align * align;
  int n = static_cast<int>((total + width - 1) / width);
  return {width, n < 1 ? 1 : n};
}

// The element types the kernels take for activations (float32, bfloat16) and for KV pools (those, or bfloat16 passed
// as its uint16 bits).
inline bool FloatType(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16;
}
inline bool PoolType(xla::ffi::DataType t) { return FloatType(t) || t == xla::ffi::DataType::U16; }

// A float32 or bfloat16 buffer (rows of x, queries, new keys) as float32: bf16 is widened into ``buf``.
inline const float* AsF32(xla::ffi::AnyBuffer x, std::vector<float>& buf) {
  if (x.element_type() == xla::ffi::DataType::F32) return static_cast<const float*>(x.untyped_data());
  const auto* p = static_cast<const uint16_t*>(x.untyped_data());
  buf.resize(x.element_count());
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = bf16_to_f32(p[i]);
  return buf.data();
}

}  // namespace specjax_cpu
