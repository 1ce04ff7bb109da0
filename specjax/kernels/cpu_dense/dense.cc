// specjax's CPU products for the rows of a decode step, a verified tree or a draft step: XLA FFI custom calls.
//
//   specjax_dense:   x [R, C] . w [C, O] -> y [R, O] float32   (every decoder/head weight, as ``layers.dense``)
//   specjax_unembed: x [R, D] . t [V, D]^T -> y [R, V] float32 (a tied lm_head read as the embedding table)
//
// x and w are both float32 or both bfloat16 (read as bfloat16); products accumulate in float32 with fused
// multiply-adds. Why: XLA:CPU runs one matrix-vector product on one thread, so a batch-1 decode step streamed its
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
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;      // one 512-bit vector of float32
constexpr int kGroup = 8;  // rows of x whose sums stay in registers together

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

// y[r, v] = sum_d x[r, d] * t[v, d]: sixteen partial sums per output, added in one fixed order.
template <typename T>
struct UnembedJob {
  const float* x;  // [R, D]
  const T* t;      // [V, D]
  float* y;        // [R, V]
  int64_t rows, d_dim, v_dim;
  Split split;
};

// Sixteen lane sums of x[d] * t[d] over the whole vectors of d, then added in lane order with the tail: one fixed
// sequence per output whatever the rows or the table rows computed beside it.
template <typename T>
inline float FinishDot(const float (&lanes)[kLanes], const float* x, const T* t, int64_t d_vec, int64_t D) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (int64_t e = d_vec; e < D; ++e) s = __builtin_fmaf(x[e], load(t, e), s);
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

template <typename T, int R>
void UnembedRows(const UnembedJob<T>& j, int64_t r0, int64_t v0, int64_t v1) {
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
void RunUnembed(const float* x, const T* t, float* y, int64_t R, int64_t D, int64_t V) {
  const Split split = MakeSplit(V, 1, 64);
  UnembedJob<T> job{x, t, y, R, D, V, split};
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
  thread_local std::vector<float> xbuf;
  const float* xf = RowsAsF32(x, xbuf);
  float* out = y->typed_data();
  const bool f32 = w.element_type() == ffi::DataType::F32;
  const void* wp = w.untyped_data();
  if constexpr (kTable) {
    if (f32) RunUnembed(xf, static_cast<const float*>(wp), out, R, C, O);
    else RunUnembed(xf, static_cast<const uint16_t*>(wp), out, R, C, O);
  } else {
    if (f32) RunDense(xf, static_cast<const float*>(wp), out, R, C, O);
    else RunDense(xf, static_cast<const uint16_t*>(wp), out, R, C, O);
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
