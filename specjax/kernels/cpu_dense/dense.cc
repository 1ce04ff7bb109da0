// specjax's CPU products for the rows of a decode step, a verified tree or a draft step: XLA FFI custom calls.
//
//   specjax_dense:   x [R, C] . w [C, O] -> y [R, O] float32   (every decoder/head weight, as ``layers.dense``)
//   specjax_unembed: x [R, D] . t [V, D]^T -> y [R, V] float32 (a tied lm_head read as the embedding table)
//
// x and w are both float32 or both bfloat16 (read as bfloat16); products accumulate in float32 with fused
// multiply-adds, or, for bf16 on CPUs with avx512_bf16, with the bf16 dot instruction (vdpbf16ps: the exact products
// of a pair of elements along the contraction axis added in turn; no widening of w in registers). Why: XLA:CPU runs one matrix-vector product on one thread, so a batch-1 decode step streamed its
// weights at one core's read rate, and its bf16 dots ran no faster than fp32. Here a product is cut into chunks
// that a small pool of threads takes in turn: ``dense`` into up to four blocks of the contraction axis (each read
// front to back, sixteen rows of w at a time, into its own partial sums, added in block order), ``unembed`` into
// runs of table rows. Each block of w (run of table rows) serves eight rows of x at a time while it is in cache.
// Every output element is one fixed sequence of operations, so its bits do not depend on the number of rows, the
// number of threads, or which thread computed it (tests/test_cpu_dense.py).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;      // one 512-bit vector of float32
constexpr int kGroup = 8;  // rows of x whose sums stay in registers together
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;  // bf16 products on vdpbf16ps (below)
#else
constexpr bool kBf16Dot = false;
#endif

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

#if defined(__AVX512F__)
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

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

std::mutex g_pool_mu;          // held by the one caller that uses the pool
std::unique_ptr<Pool> g_pool;  // null: one thread

int DefaultThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// Run ``fn`` over ``n`` chunks: on the pool when it is free, else on this thread.
void Parallel(ChunkFn fn, const void* ctx, int n) {
  std::unique_lock<std::mutex> lk(g_pool_mu, std::try_to_lock);
  if (lk.owns_lock() && g_pool && n > 1) {
    g_pool->Run(fn, ctx, n);
    return;
  }
  for (int i = 0; i < n; ++i) fn(ctx, i);
}

int PoolThreads() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return g_pool ? g_pool->threads() : 1;
}

// Chunks of [0, total) aligned to ``align``: about four per thread, none narrower than ``min_width``.
struct Split {
  int64_t width;
  int n;
};

Split MakeSplit(int64_t total, int64_t align, int64_t min_width) {
  int threads = PoolThreads();
  int64_t want = threads == 1 ? 1 : 4 * threads;
  int64_t width = (total + want - 1) / want;
  width = std::max<int64_t>(width, min_width);
  width = (width + align - 1) / align * align;
  int n = static_cast<int>((total + width - 1) / width);
  return {width, n < 1 ? 1 : n};
}

// ---------------------------------------------------------------------------------------------------------------
// y[r, o] = sum_c x[r, c] * w[c, o]. The contraction axis is cut into DenseBlocks(C) blocks, a function of C alone; a
// chunk streams its block's rows of w front to back (sixteen rows at a time, one pass over y per sixteen rows) into
// its own partial sums, and the partials are added in block order. So each output element is the same sequence of
// fmas and adds whatever the rows or threads, and every chunk reads one contiguous stretch of w.
template <typename T>
struct DenseJob {
  const float* x;  // [R, C] float32
  const T* w;      // [C, O]
  float* y;        // [R, O]
  float* part;     // [blocks - 1, R, O]: the partial sums of blocks 1.. (block 0 writes y)
  int64_t rows, c_dim, o_dim;
  int blocks;
};

inline int DenseBlocks(int64_t c_dim) { return static_cast<int>(std::clamp<int64_t>(c_dim / 128, 1, 4)); }
inline int64_t BlockStart(int64_t c_dim, int blocks, int k) { return c_dim * k / blocks; }

// acc[r, o] (= 0 first) += x[r, c0:c1] w[c0:c1, o] for every column, B rows of w per pass.
template <typename T, int R, int B>
void DenseRows(const DenseJob<T>& j, float* __restrict acc, int64_t r0, int64_t c, int64_t o_vec) {
  const int64_t C = j.c_dim, O = j.o_dim;
  const T* __restrict w = j.w + c * O;
  acc += r0 * O;
  float xs[R][B];  // this block's x, copied so that no store to acc can alias it
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) xs[r][b] = j.x[(r0 + r) * C + c + b];
#if defined(__AVX512F__)
  for (int64_t o = 0; o < o_vec; o += kLanes) {
    __m512 a[B];
    for (int b = 0; b < B; ++b) a[b] = Load16(w + b * O + o);
    for (int r = 0; r < R; ++r) {
      float* yr = acc + r * O + o;
      __m512 s = _mm512_loadu_ps(yr);
      for (int b = 0; b < B; ++b) s = _mm512_fmadd_ps(_mm512_set1_ps(xs[r][b]), a[b], s);
      _mm512_storeu_ps(yr, s);
    }
  }
#else
  o_vec = 0;
#endif
  for (int r = 0; r < R; ++r) {
    float* yr = acc + r * O;
    for (int64_t o = o_vec; o < O; ++o) {
      float s = yr[o];
      for (int b = 0; b < B; ++b) s = __builtin_fmaf(xs[r][b], load(w + b * O, o), s);
      yr[o] = s;
    }
  }
}

// Rows c..c+B of w against every row of x, kGroup rows of x at a time: the block of w is read from memory by the
// first group and from cache by the others.
template <typename T, int B>
void DenseRowsAll(const DenseJob<T>& j, float* acc, int64_t c, int64_t o_vec) {
  for (int64_t r0 = 0; r0 < j.rows; r0 += kGroup) {
    switch (std::min<int64_t>(kGroup, j.rows - r0)) {
      case 1: DenseRows<T, 1, B>(j, acc, r0, c, o_vec); break;
      case 2: DenseRows<T, 2, B>(j, acc, r0, c, o_vec); break;
      case 3: DenseRows<T, 3, B>(j, acc, r0, c, o_vec); break;
      case 4: DenseRows<T, 4, B>(j, acc, r0, c, o_vec); break;
      case 5: DenseRows<T, 5, B>(j, acc, r0, c, o_vec); break;
      case 6: DenseRows<T, 6, B>(j, acc, r0, c, o_vec); break;
      case 7: DenseRows<T, 7, B>(j, acc, r0, c, o_vec); break;
      default: DenseRows<T, 8, B>(j, acc, r0, c, o_vec); break;
    }
  }
}

template <typename T>
void DenseChunk(const void* ctx, int k) {
  constexpr int B = 16;
  const auto& j = *static_cast<const DenseJob<T>*>(ctx);
  float* acc = k == 0 ? j.y : j.part + (k - 1) * j.rows * j.o_dim;
  const int64_t c0 = BlockStart(j.c_dim, j.blocks, k), c1 = BlockStart(j.c_dim, j.blocks, k + 1);
  const int64_t o_vec = j.o_dim / kLanes * kLanes;
  std::memset(acc, 0, j.rows * j.o_dim * sizeof(float));
  int64_t c = c0;
  for (; c + B <= c1; c += B) DenseRowsAll<T, B>(j, acc, c, o_vec);
  for (; c < c1; ++c) DenseRowsAll<T, 1>(j, acc, c, o_vec);
}

template <typename T>
void RunDense(const float* x, const T* w, float* y, int64_t R, int64_t C, int64_t O) {
  const int blocks = DenseBlocks(C);
  thread_local std::vector<float> part;
  part.resize((blocks - 1) * R * O);
  DenseJob<T> job{x, w, y, part.data(), R, C, O, blocks};
  Parallel(DenseChunk<T>, &job, blocks);
  const int64_t n = R * O;
  for (int k = 1; k < blocks; ++k) {
    const float* p = part.data() + (k - 1) * n;
    for (int64_t i = 0; i < n; ++i) y[i] += p[i];
  }
}

#if defined(__AVX512BF16__)
// bf16 weights on CPUs with the bf16 dot instruction (vdpbf16ps: sixteen float32 lanes, each += the products of one
// pair of bf16 elements, exact, added in turn). The pairs run along the contraction axis, which in w [C, O] crosses
// rows, so rows c and c+1 of w are interleaved in registers (unpacklo/hi_epi16, within 128-bit lanes): for a group of
// 32 columns the "lo" sums hold columns {0-3, 8-11, 16-19, 24-27} and the "hi" sums {4-7, 12-15, 20-23, 28-31}. The
// accumulators keep that order until RunDenseBf16 adds the blocks and puts the columns back in place; the column tail
// (O % 32) is summed in natural order with scalar fmas, a row without a partner at a block's end is paired with zeros.
constexpr int kPairCols = 32;

struct DenseJobBf16 {
  const uint16_t* x;  // [R, C] bfloat16
  const uint16_t* w;  // [C, O] bfloat16
  float* y;           // [R, O], columns of each 32-group in pair order (see above)
  float* part;        // [blocks - 1, R, O]
  int64_t rows, c_dim, o_dim;
  int blocks;
};

inline uint32_t XPair(const uint16_t* x, bool single) {
  return static_cast<uint32_t>(x[0]) | (single ? 0u : static_cast<uint32_t>(x[1]) << 16);
}

// acc[r, :] += x[r, c:c+2P] w[c:c+2P, :] for R rows of x (kSingle: P == 1 and row c has no partner).
template <int R, int P, bool kSingle>
void DenseRowsBf16(const DenseJobBf16& j, float* __restrict acc, int64_t r0, int64_t c) {
  static_assert(!kSingle || P == 1, "a single row is one pair");
  const int64_t C = j.c_dim, O = j.o_dim, o_vec = O / kPairCols * kPairCols;
  const uint16_t* __restrict w = j.w + c * O;
  acc += r0 * O;
  uint32_t xs[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) xs[r][p] = XPair(j.x + (r0 + r) * C + c + 2 * p, kSingle);
  for (int64_t o = 0; o < o_vec; o += kPairCols) {
    __m512i lo[P], hi[P];
    for (int p = 0; p < P; ++p) {
      const __m512i a = _mm512_loadu_si512(w + 2 * p * O + o);
      const __m512i b = kSingle ? _mm512_setzero_si512() : _mm512_loadu_si512(w + (2 * p + 1) * O + o);
      lo[p] = _mm512_unpacklo_epi16(a, b);
      hi[p] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < R; ++r) {
      float* yr = acc + r * O + o;
      __m512 s0 = _mm512_loadu_ps(yr), s1 = _mm512_loadu_ps(yr + kLanes);
      for (int p = 0; p < P; ++p) {
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[r][p]));
        s0 = _mm512_dpbf16_ps(s0, (__m512bh)lo[p], xp);
        s1 = _mm512_dpbf16_ps(s1, (__m512bh)hi[p], xp);
      }
      _mm512_storeu_ps(yr, s0);
      _mm512_storeu_ps(yr + kLanes, s1);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = acc + r * O;
    const uint16_t* xr = j.x + (r0 + r) * C + c;
    for (int64_t o = o_vec; o < O; ++o) {
      float s = yr[o];
      for (int b = 0; b < (kSingle ? 1 : 2 * P); ++b) s = __builtin_fmaf(load(xr, b), load(w + b * O, o), s);
      yr[o] = s;
    }
  }
}

template <int P, bool kSingle>
void DenseRowsAllBf16(const DenseJobBf16& j, float* acc, int64_t c) {
  for (int64_t r0 = 0; r0 < j.rows; r0 += kGroup) {
    switch (std::min<int64_t>(kGroup, j.rows - r0)) {
      case 1: DenseRowsBf16<1, P, kSingle>(j, acc, r0, c); break;
      case 2: DenseRowsBf16<2, P, kSingle>(j, acc, r0, c); break;
      case 3: DenseRowsBf16<3, P, kSingle>(j, acc, r0, c); break;
      case 4: DenseRowsBf16<4, P, kSingle>(j, acc, r0, c); break;
      case 5: DenseRowsBf16<5, P, kSingle>(j, acc, r0, c); break;
      case 6: DenseRowsBf16<6, P, kSingle>(j, acc, r0, c); break;
      case 7: DenseRowsBf16<7, P, kSingle>(j, acc, r0, c); break;
      default: DenseRowsBf16<8, P, kSingle>(j, acc, r0, c); break;
    }
  }
}

void DenseChunkBf16(const void* ctx, int k) {
  constexpr int P = 8;  // sixteen rows of w per pass, as the float32 path
  const auto& j = *static_cast<const DenseJobBf16*>(ctx);
  float* acc = k == 0 ? j.y : j.part + (k - 1) * j.rows * j.o_dim;
  const int64_t c0 = BlockStart(j.c_dim, j.blocks, k), c1 = BlockStart(j.c_dim, j.blocks, k + 1);
  std::memset(acc, 0, j.rows * j.o_dim * sizeof(float));
  int64_t c = c0;
  for (; c + 2 * P <= c1; c += 2 * P) DenseRowsAllBf16<P, false>(j, acc, c);
  for (; c + 2 <= c1; c += 2) DenseRowsAllBf16<1, false>(j, acc, c);
  if (c < c1) DenseRowsAllBf16<1, true>(j, acc, c);
}

// Where column ``col`` (< 32) of a group sits in the pair-ordered sums: lanes 0-15 "lo", 16-31 "hi".
inline int PairLane(int col) {
  const int L = col / 8, k = col % 8;
  return k < 4 ? 4 * L + k : kLanes + 4 * L + k - 4;
}

// y = block 0 + block 1 + ... (in block order), each 32-column group put back from pair order into column order.
void FinishDenseBf16(float* y, const float* part, int blocks, int64_t R, int64_t O) {
  const int64_t o_vec = O / kPairCols * kPairCols, n = R * O;
  // output column 8L + k <- lo lane 4L + k, column 8L + 4 + k <- hi lane 4L + k (k < 4, L < 4)
  alignas(64) int32_t first[kLanes], second[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    first[i] = PairLane(i);
    second[i] = PairLane(i + kLanes);
  }
  const __m512i idx0 = _mm512_load_si512(first), idx1 = _mm512_load_si512(second);
  for (int64_t r = 0; r < R; ++r) {
    float* yr = y + r * O;
    for (int64_t o = 0; o < o_vec; o += kPairCols) {
      __m512 s0 = _mm512_loadu_ps(yr + o), s1 = _mm512_loadu_ps(yr + o + kLanes);
      for (int k = 1; k < blocks; ++k) {
        const float* p = part + (k - 1) * n + r * O + o;
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + kLanes));
      }
      _mm512_storeu_ps(yr + o, _mm512_permutex2var_ps(s0, idx0, s1));
      _mm512_storeu_ps(yr + o + kLanes, _mm512_permutex2var_ps(s0, idx1, s1));
    }
    for (int64_t o = o_vec; o < O; ++o)
      for (int k = 1; k < blocks; ++k) yr[o] += part[(k - 1) * n + r * O + o];
  }
}

void RunDenseBf16(const uint16_t* x, const uint16_t* w, float* y, int64_t R, int64_t C, int64_t O) {
  const int blocks = DenseBlocks(C);
  thread_local std::vector<float> part;
  part.resize((blocks - 1) * R * O);
  DenseJobBf16 job{x, w, y, part.data(), R, C, O, blocks};
  Parallel(DenseChunkBf16, &job, blocks);
  FinishDenseBf16(y, part.data(), blocks, R, O);
}
#endif

// y[r, v] = sum_d x[r, d] * t[v, d]: sixteen partial sums per output, added in one fixed order.
template <typename T>
struct UnembedJob {
  const float* x;     // [R, D]
  const uint16_t* xb;  // [R, D] bfloat16 when T is (for the bf16 dot), else null
  const T* t;      // [V, D]
  float* y;        // [R, V]
  int64_t rows, d_dim, v_dim;
  Split split;
};

// Sixteen lane sums of x[d] * t[d] over the whole vectors of d, then added in lane order with the tail: one fixed
// sequence per output whatever the rows or the table rows computed beside it.
template <typename X, typename T>
inline float FinishDot(const float (&lanes)[kLanes], const X* x, const T* t, int64_t d_vec, int64_t D) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (int64_t e = d_vec; e < D; ++e) s = __builtin_fmaf(load(x, e), load(t, e), s);
  return s;
}

// Table row v against rows r0..r0+R of x: the row is loaded once per vector for all R.
template <typename T, int R>
void UnembedRow(const UnembedJob<T>& j, int64_t r0, int64_t v) {
  const int64_t D = j.d_dim, V = j.v_dim, d_vec = D / kLanes * kLanes;
  const float* __restrict x = j.x + r0 * D;
  const T* tv = j.t + v * D;
  float lanes[R][kLanes];
#if defined(__AVX512F__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < d_vec; d += kLanes) {
    const __m512 tl = Load16(tv + d);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * D + d), tl, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(lanes[r], acc[r]);
#else
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < kLanes; ++l) lanes[r][l] = 0.f;
  for (int64_t d = 0; d < d_vec; d += kLanes)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) lanes[r][l] = __builtin_fmaf(x[r * D + d + l], load(tv, d + l), lanes[r][l]);
#endif
  float* y = j.y + r0 * V;
  for (int r = 0; r < R; ++r) y[r * V + v] = FinishDot(lanes[r], x + r * D, tv, d_vec, D);
}

#if defined(__AVX512BF16__)
// The same with the bf16 dot: lane l sums the pairs (d, d+1) of the l-th 32-bit slot of each 32-element stretch of d.
template <int R>
void UnembedRowBf16(const UnembedJob<uint16_t>& j, int64_t r0, int64_t v) {
  const int64_t D = j.d_dim, V = j.v_dim, d_vec = D / (2 * kLanes) * (2 * kLanes);
  const uint16_t* __restrict x = j.xb + r0 * D;
  const uint16_t* tv = j.t + v * D;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < d_vec; d += 2 * kLanes) {
    const __m512bh tl = (__m512bh)_mm512_loadu_si512(tv + d);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * D + d), tl);
  }
  float lanes[R][kLanes];
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(lanes[r], acc[r]);
  float* y = j.y + r0 * V;
  for (int r = 0; r < R; ++r) y[r * V + v] = FinishDot(lanes[r], x + r * D, tv, d_vec, D);
}
#endif

template <typename T, int R>
void UnembedRows(const UnembedJob<T>& j, int64_t r0, int64_t v0, int64_t v1) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (int64_t v = v0; v < v1; ++v) UnembedRowBf16<R>(j, r0, v);
    return;
  }
#endif
  for (int64_t v = v0; v < v1; ++v) UnembedRow<T, R>(j, r0, v);
}

// Table rows [v0, v1): a run of 64 table rows (L1/L2-resident) for each group of kGroup rows of x.
template <typename T>
void UnembedChunk(const void* ctx, int chunk) {
  const auto& j = *static_cast<const UnembedJob<T>*>(ctx);
  const int64_t v0 = chunk * j.split.width, v1 = std::min(j.v_dim, v0 + j.split.width);
  const int64_t run = j.rows <= kGroup ? v1 - v0 : 64;
  for (int64_t a = v0; a < v1; a += run) {
    const int64_t b = std::min(v1, a + run);
    for (int64_t r0 = 0; r0 < j.rows; r0 += kGroup) {
      switch (std::min<int64_t>(kGroup, j.rows - r0)) {
        case 1: UnembedRows<T, 1>(j, r0, a, b); break;
        case 2: UnembedRows<T, 2>(j, r0, a, b); break;
        case 3: UnembedRows<T, 3>(j, r0, a, b); break;
        case 4: UnembedRows<T, 4>(j, r0, a, b); break;
        case 5: UnembedRows<T, 5>(j, r0, a, b); break;
        case 6: UnembedRows<T, 6>(j, r0, a, b); break;
        case 7: UnembedRows<T, 7>(j, r0, a, b); break;
        default: UnembedRows<T, 8>(j, r0, a, b); break;
      }
    }
  }
}

// x as float32: bf16 rows are widened into a per-thread buffer.
const float* RowsAsF32(ffi::AnyBuffer x, std::vector<float>& buf) {
  if (x.element_type() == ffi::DataType::F32) return static_cast<const float*>(x.untyped_data());
  const auto* p = static_cast<const uint16_t*>(x.untyped_data());
  buf.resize(x.element_count());
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = bf16_to_f32(p[i]);
  return buf.data();
}

template <typename T>
void RunUnembed(const float* x, const uint16_t* xb, const T* t, float* y, int64_t R, int64_t D, int64_t V) {
  const Split split = MakeSplit(V, 1, 64);
  UnembedJob<T> job{x, xb, t, y, R, D, V, split};
  Parallel(UnembedChunk<T>, &job, split.n);
}

// x [R, C] against w: [C, O] (kTable false, ``specjax_dense``) or a table [O, C] (``specjax_unembed``) -> y [R, O].
template <bool kTable>
ffi::Error ProductImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax cpu dense: x, w and y must be 2-D");
  if (x.element_type() != w.element_type() ||
      (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("specjax cpu dense: x and w must both be float32 or both bfloat16");
  const int64_t R = xd[0], C = xd[1], O = wd[kTable ? 0 : 1];
  if (wd[kTable ? 1 : 0] != C || yd[0] != R || yd[1] != O)
    return ffi::Error::InvalidArgument("specjax cpu dense: shapes do not match");
  float* out = y->typed_data();
  const void* wp = w.untyped_data();
  const auto* wb = static_cast<const uint16_t*>(wp);
  const auto* xb = static_cast<const uint16_t*>(x.untyped_data());
  if (w.element_type() == ffi::DataType::BF16 && kBf16Dot) {  // x stays bf16: the bf16 dot reads it
#if defined(__AVX512BF16__)
    if constexpr (kTable) RunUnembed(nullptr, xb, wb, out, R, C, O);
    else RunDenseBf16(xb, wb, out, R, C, O);
#endif
    return ffi::Error::Success();
  }
  thread_local std::vector<float> xbuf;
  const float* xf = RowsAsF32(x, xbuf);
  const bool f32 = w.element_type() == ffi::DataType::F32;
  if constexpr (kTable) {
    if (f32) RunUnembed(xf, nullptr, static_cast<const float*>(wp), out, R, C, O);
    else RunUnembed(xf, xb, wb, out, R, C, O);
  } else {
    if (f32) RunDense(xf, static_cast<const float*>(wp), out, R, C, O);
    else RunDense(xf, wb, out, R, C, O);
  }
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_BINDING ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDense, ProductImpl<false>, SPECJAX_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxUnembed, ProductImpl<true>, SPECJAX_BINDING);

// Threads for the products (1: no pool). Called from Python through ctypes.
extern "C" void specjax_cpu_set_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_pool.reset();
  if (n <= 0) n = DefaultThreads();
  if (n > 1) g_pool = std::make_unique<Pool>(n);
}

extern "C" int specjax_cpu_threads() { return PoolThreads(); }
