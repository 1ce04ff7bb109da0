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

// The kernels' vector code runs on AVX-512 or on AVX2 with FMA (``F16``, below); other CPUs take the scalar loops.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SPECJAX_VEC 1
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

constexpr int kLanes = 16;  // float32 lanes of one F16 (below)
#if defined(__AVX512F__) || !defined(SPECJAX_VEC)
constexpr int kGroup = 8;  // rows of x whose sums stay in registers together
#else
// AVX2: 16 registers of 8 lanes (3 rows x 32 bf16 columns take 12; dense.cc's kPanelTileR): SmolLM2's bf16 decode
// 1.21x -> 1.33x fp32's at batch 1, 0.57x -> 0.76x at batch 8 on the Zen 1 VM (fifty-ninth session)
constexpr int kGroup = 3;
#endif

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

// ---------------------------------------------------------------------------------------------------------------
// F16: sixteen float32 lanes, one 512-bit vector with AVX-512, a pair of 256-bit ones (lanes 0-7, 8-15) with AVX2.
// Every operation is lane by lane (a fused multiply-add rounds once either way) and the reductions below add the
// lanes in one fixed tree, so each output of a kernel is the same sequence of operations, with the same bits, on
// both (tests/test_cpu_dense.py pins the kernels against XLA's products on whichever this CPU has). Without them an
// AVX2 CPU ran the kernels' scalar loops: SmolLM2's fp32 decode step at 16% of the weight-read limit on a 2-core Zen
// 1 EPYC, 0.2x XLA's own dots (docs/benchmarks.md, fifty-ninth session).
#if defined(__AVX512F__)
constexpr int kVectorBits = 512;  // of one register
using F16 = __m512;
inline F16 VZero() { return _mm512_setzero_ps(); }
inline F16 VSet1(float v) { return _mm512_set1_ps(v); }
inline F16 VLoad(const float* p) { return _mm512_loadu_ps(p); }
// sixteen bf16 values widened
inline F16 VLoad(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void VStore(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 VFma(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }     // a * b + c
inline F16 VFnma(F16 a, F16 b, F16 c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a * b
inline F16 VAdd(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 VMul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 VMax(F16 a, F16 b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline F16 VRoundNearest(F16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a * 2^k for integral k in [-126, 127]
inline F16 VScale2(F16 a, F16 k) { return _mm512_scalef_ps(a, k); }
// lane masks (bit l: lane l)
inline unsigned VEqMask(F16 a, F16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline unsigned VLtMask(F16 a, F16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline unsigned VNanMask(F16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline F16 VZeroWhere(F16 a, unsigned mask) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~mask), a); }
inline F16 VSetWhere(F16 a, unsigned mask, float v) {  // v in the lanes whose bit of mask is set
  return _mm512_mask_mov_ps(a, static_cast<__mmask16>(mask), _mm512_set1_ps(v));
}
inline float VMaxLanes(F16 a) { return _mm512_reduce_max_ps(a); }  // exact in any order
// The 32 bf16 values of the 64-byte line at p widened: the even ones into a[0], the odd ones into a[1].
inline void VPairedLine(const uint16_t* p, F16 (&a)[2]) {
  const __m512i raw = _mm512_loadu_si512(p);
  a[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  a[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// 32 sums kept as [16 even columns, 16 odd ones] back in column order: columns 0-15 into in[0], 16-31 into in[1].
inline void VInColumnOrder(F16 (&in)[2]) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const F16 even = in[0], odd = in[1];
  in[0] = _mm512_permutex2var_ps(even, first, odd);
  in[1] = _mm512_permutex2var_ps(even, second, odd);
}
#elif defined(SPECJAX_VEC)
constexpr int kVectorBits = 256;
struct F16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline F16 VZero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 VSet1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline __m256 Widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
// Eight lanes of float32 values or of bf16 bits, widened.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return Widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F16 VLoad(const float* p) { return {Load8(p), Load8(p + 8)}; }
inline F16 VLoad(const uint16_t* p) { return {Load8(p), Load8(p + 8)}; }
inline void VStore(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 VFma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 VFnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 VAdd(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 VMul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 VMax(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 VRoundNearest(F16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// 2^k built in the exponent field (a normal float for k in [-126, 127]): a * 2^k rounds once, as scalef does.
inline __m256 Pow2(__m256 k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
inline F16 VScale2(F16 a, F16 k) { return {_mm256_mul_ps(a.lo, Pow2(k.lo)), _mm256_mul_ps(a.hi, Pow2(k.hi))}; }
template <int kCmp>
inline unsigned CmpMask(F16 a, F16 b) {
  return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kCmp))) |
         static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kCmp))) << 8;
}
inline unsigned VEqMask(F16 a, F16 b) { return CmpMask<_CMP_EQ_OQ>(a, b); }
inline unsigned VLtMask(F16 a, F16 b) { return CmpMask<_CMP_LT_OQ>(a, b); }
inline unsigned VNanMask(F16 a) { return CmpMask<_CMP_UNORD_Q>(a, a); }
inline __m256 KeepMask8(unsigned mask) {  // all ones in lane l where bit l of mask is clear
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i m = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(mask & 0xffu)), bits);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_setzero_si256()));
}
inline F16 VZeroWhere(F16 a, unsigned mask) {
  return {_mm256_and_ps(a.lo, KeepMask8(mask)), _mm256_and_ps(a.hi, KeepMask8(mask >> 8))};
}
inline F16 VSetWhere(F16 a, unsigned mask, float v) {
  const __m256 f = _mm256_set1_ps(v);
  return {_mm256_blendv_ps(f, a.lo, KeepMask8(mask)), _mm256_blendv_ps(f, a.hi, KeepMask8(mask >> 8))};
}
inline float VMaxLanes(F16 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_max_ps(a.lo, a.hi));
  return *std::max_element(l, l + 8);
}
// As the AVX-512 one: even columns (of the whole line) into a[0], odd into a[1].
inline void VPairedLine(const uint16_t* p, F16 (&a)[2]) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  a[0] = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  a[1] = {_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}
inline void VInColumnOrder(F16 (&in)[2]) {
  const F16 even = in[0], odd = in[1];
  // columns 0-3 | 8-11 and 4-7 | 12-15 of the first 16; the same for the second 16
  const __m256 a = _mm256_unpacklo_ps(even.lo, odd.lo), b = _mm256_unpackhi_ps(even.lo, odd.lo);
  const __m256 c = _mm256_unpacklo_ps(even.hi, odd.hi), d = _mm256_unpackhi_ps(even.hi, odd.hi);
  in[0] = {_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)};
  in[1] = {_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31)};
}
#else
constexpr int kVectorBits = 0;  // the scalar loops
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
