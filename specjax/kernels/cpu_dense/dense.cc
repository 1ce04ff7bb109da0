// specjax's CPU products for the rows of a decode step, a verified tree or a draft step: XLA FFI custom calls.
//
//   specjax_dense:   x [R, C] . w [C, O] (or packed panels [O / 32, C, 32]) -> y [R, O] float32   (every
//                    decoder/head weight, as ``layers.dense``)
//   specjax_dense_add: res [R, O] + x [R, C] . packed w -> y [R, O] in res's type (``h + o @ wo`` in one call)
//   specjax_unembed: x [R, D] . t [V, D]^T -> y [R, V] float32 (a tied lm_head read as the embedding table)
//
// x and w are both float32, or w is bfloat16 (read as bfloat16; x of either type, taken as float32: float32 x with
// bfloat16 w is the float32 product with the widened w, from half its bytes); products accumulate in float32 with
// fused multiply-adds. Why: XLA:CPU runs one matrix-vector product on one thread, so a batch-1 decode step streamed
// its weights at one core's read rate, and its bf16 dots ran no faster than fp32. Here a product is cut into chunks
// that a small pool of threads takes in turn: ``dense`` into up to four blocks of the contraction axis (each read
// front to back, a few rows of w at a time, into its own partial sums, added in block order; one run of consecutive
// blocks per thread; bf16 w is read 32 columns per load, the even and the odd ones widened apart), ``unembed`` into
// runs of table rows. Each block of w (run of table rows) serves eight rows of x at a time while it is in cache.
// Every output element is one fixed sequence of operations, so its bits do not depend on the number of rows, the
// number of threads, or which thread computed it (tests/test_cpu_dense.py). Where the CPU has AMX (``amx.h``), bf16 x
// against bf16 panels runs on its tiles from two rows on, and one row on the vector units in the tiles' order
// (``kGroupSums``): other bits than the fma chain's, the same for every row count.
#include <type_traits>

#include "amx.h"
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace specjax_cpu;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// y[r, o] = sum_c x[r, c] * w[c, o]. The contraction axis is cut into DenseBlocks(C) blocks, a function of C alone; a
// chunk streams its block's rows of w front to back (a few rows at a time, one pass over y per few rows) into
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
  int runs;  // runs of consecutive blocks, one per thread (``DenseRun``)
};

inline int DenseBlocks(int64_t c_dim) { return static_cast<int>(std::clamp<int64_t>(c_dim / 128, 1, 4)); }
inline int64_t BlockStart(int64_t c_dim, int blocks, int k) { return c_dim * k / blocks; }

// Software prefetches of w for DenseRows, one per cache line, one pass (of B rows of w) ahead. Without them a pass
// that does several fmas per loaded vector (a few rows of x, or bf16's widening) keeps too few loads in flight for
// the hardware prefetchers, and 4 rows cost 1.3x one row, bf16 weights 0.8x fp32's time for half the bytes
// (docs/benchmarks.md, twenty-first session). One fp32 row streams as fast without (with, 2-5% slower). bf16 passes
// two ahead streamed SmolLM2's layer products 2-5% slower than one ahead (1-8 rows, twenty-sixth session): the
// first passes of a run of w are not prefetched, and the farther ahead, the more of them.
template <typename T, int R>
struct DensePrefetch {
  static constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  static constexpr bool kOn = R >= 2 || kBf16;
  // Into L2 (prefetcht1) for both types: bf16 passes prefetched into L1 streamed SmolLM2's layer products 15-25%
  // slower at 1-8 rows (a C++ chain of its 150 products, twenty-fifth session); fp32 ones into L1: no faster.
  static constexpr int kLocality = 2;
  static void Line(const T* w, int64_t i, int64_t ahead) {  // the line of w[i], if it starts one
    if (kOn && (i * static_cast<int64_t>(sizeof(T))) % 64 == 0) PrefetchAhead<kLocality>(w + i, ahead);
  }
  static int64_t Ahead(int rows_per_pass, int64_t o_dim) {  // bytes from a line of w to the one to prefetch
    return rows_per_pass * o_dim * static_cast<int64_t>(sizeof(T));
  }
};

// Rows r0..r0+R of x at columns c..c+B, copied so that no store to acc can alias them.
template <typename T, int R, int B>
inline void BlockOfX(const DenseJob<T>& j, int64_t r0, int64_t c, float (&xs)[R][B]) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) xs[r][b] = j.x[(r0 + r) * j.c_dim + c + b];
}

// acc[r, o] (= 0 first) += x[r, c0:c1] w[c0:c1, o] for every column, B rows of w per pass.
template <typename T, int R, int B>
void DenseRows(const DenseJob<T>& j, float* __restrict acc, int64_t r0, int64_t c, int64_t o_from, int64_t o_vec) {
  const int64_t O = j.o_dim;
  const T* __restrict w = j.w + c * O;
  using Pf = DensePrefetch<T, R>;
  const int64_t ahead = Pf::Ahead(B, O);
  acc += r0 * O;
  float xs[R][B];
  BlockOfX<T, R, B>(j, r0, c, xs);
#if defined(SPECJAX_VEC)
  // With one row of x (two bf16 rows), V vectors of columns at a time: V x R independent chains of fmas (one chain
  // of B fmas alone is latency-bound), each column's sequence unchanged. Two fp32 rows ran 4% faster with V = 1 than
  // with 2 (bf16 ones 4% slower), four rows 15% slower with V = 4 than with 1 (kernel alone, twenty-second session).
  constexpr int V = R == 1 ? 4 : R == 2 && Pf::kBf16 ? 2 : 1;
  int64_t o = o_from;
  for (; V > 1 && o + V * kLanes <= o_vec; o += V * kLanes) {
    F16 s[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) s[r][v] = VLoad(acc + r * O + o + v * kLanes);
    for (int b = 0; b < B; ++b) {
      F16 a[V];
      for (int v = 0; v < V; ++v) a[v] = VLoad(w + b * O + o + v * kLanes);
      for (int v = 0; v < V; ++v) Pf::Line(w, b * O + o + v * kLanes, ahead);
      for (int r = 0; r < R; ++r) {
        const F16 xb = VSet1(xs[r][b]);
        for (int v = 0; v < V; ++v) s[r][v] = VFma(xb, a[v], s[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) VStore(acc + r * O + o + v * kLanes, s[r][v]);
  }
  for (; o < o_vec; o += kLanes) {
    F16 a[B];
    for (int b = 0; b < B; ++b) a[b] = VLoad(w + b * O + o);
    for (int b = 0; b < B; ++b) Pf::Line(w, b * O + o, ahead);
    for (int r = 0; r < R; ++r) {
      float* yr = acc + r * O + o;
      F16 s = VLoad(yr);
      for (int b = 0; b < B; ++b) s = VFma(VSet1(xs[r][b]), a[b], s);
      VStore(yr, s);
    }
  }
#else
  o_vec = o_from;
#endif
  for (int r = 0; r < R; ++r) {
    float* yr = acc + r * O;
    for (int64_t o = std::max(o_vec, o_from); o < O; ++o) {
      float s = yr[o];
      for (int b = 0; b < B; ++b) s = __builtin_fmaf(xs[r][b], load(w + b * O, o), s);
      yr[o] = s;
    }
  }
}

#if defined(SPECJAX_VEC)
// bf16 w, 32 columns per 64-byte load: the low half of each 32-bit lane is an even column and the high half the odd
// one after it, each widened by one instruction (a shift, a mask) where Load16 spends two per 16 columns: half the
// loads and widenings per byte of w, so more of its lines are in flight (the bf16 products streamed about 20%
// slower per byte than fp32's in a decode step; docs/benchmarks.md, twenty-third session). The sums of columns
// o..o+31 are kept in acc as [16 even columns, 16 odd ones] (``UnpairColumns`` restores the order at the end of a
// chunk); each column's fmas are the same sequence as in DenseRows, so the bits are DenseRows' bits.
template <int R, int B>
inline void PairedGroup(const uint16_t* __restrict w, float* __restrict acc, const float (&xs)[R][B], int64_t O,
                        int64_t o, int64_t ahead) {
  using Pf = DensePrefetch<uint16_t, R>;
  F16 s[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) s[r][h] = VLoad(acc + r * O + o + h * kLanes);
  for (int b = 0; b < B; ++b) {
    const uint16_t* p = w + b * O + o;
    F16 a[2];
    VPairedLine(p, a);
    PrefetchAhead<Pf::kLocality>(p, ahead);
    for (int r = 0; r < R; ++r) {
      const F16 xb = VSet1(xs[r][b]);
      s[r][0] = VFma(xb, a[0], s[r][0]);
      s[r][1] = VFma(xb, a[1], s[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) VStore(acc + r * O + o + h * kLanes, s[r][h]);
}

// One group of 32 columns at a time, for any rows of x: one row of x took two groups (64 columns, two lines of a
// row of w) at a time until the Zen 5 VM streamed its bf16 products 4-7% faster with one (a C++ chain of
// SmolLM2's 150 products; the one-thread bf16 decode step 80-88 -> 88-93 tok/s; thirty-ninth session).
template <int R, int B>
void DenseRowsPaired(const DenseJob<uint16_t>& j, float* __restrict acc, int64_t r0, int64_t c, int64_t o_pair) {
  const int64_t O = j.o_dim;
  const uint16_t* __restrict w = j.w + c * O;
  const int64_t ahead = DensePrefetch<uint16_t, R>::Ahead(B, O);
  acc += r0 * O;
  float xs[R][B];
  BlockOfX<uint16_t, R, B>(j, r0, c, xs);
  for (int64_t o = 0; o < o_pair; o += 32) PairedGroup<R, B>(w, acc, xs, O, o, ahead);
}

// Columns 0..o_pair of each of ``rows`` rows of acc from [evens, odds] per 32 back to their order.
inline void UnpairColumns(float* acc, int64_t rows, int64_t o_dim, int64_t o_pair) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < o_pair; o += 32) {
      float* p = acc + r * o_dim + o;
      F16 v[2] = {VLoad(p), VLoad(p + kLanes)};
      VInColumnOrder(v);
      VStore(p, v[0]);
      VStore(p + kLanes, v[1]);
    }
}
#endif

// Columns of w handled in pairs (bf16 with AVX-512: the whole 32-column groups), the rest by DenseRows.
template <typename T>
inline int64_t PairedColumns(int64_t o_dim) {
#if defined(SPECJAX_VEC)
  if constexpr (std::is_same_v<T, uint16_t>) return o_dim / 32 * 32;
#endif
  return 0;
}

template <typename T, int R, int B>
inline void DenseRowsAny(const DenseJob<T>& j, float* acc, int64_t r0, int64_t c, int64_t o_pair, int64_t o_vec) {
#if defined(SPECJAX_VEC)
  if constexpr (std::is_same_v<T, uint16_t>) DenseRowsPaired<R, B>(j, acc, r0, c, o_pair);
#endif
  if (o_pair < j.o_dim) DenseRows<T, R, B>(j, acc, r0, c, o_pair, o_vec);
}

// Rows c..c+B of w against every row of x, kGroup rows of x at a time: the block of w is read from memory by the
// first group and from cache by the others.
template <typename T, int B>
void DenseRowsAll(const DenseJob<T>& j, float* acc, int64_t c, int64_t o_pair, int64_t o_vec) {
  for (int64_t r0 = 0; r0 < j.rows; r0 += kGroup) {
    switch (std::min<int64_t>(kGroup, j.rows - r0)) {
      case 1: DenseRowsAny<T, 1, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 2: DenseRowsAny<T, 2, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 3: DenseRowsAny<T, 3, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 4: DenseRowsAny<T, 4, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 5: DenseRowsAny<T, 5, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 6: DenseRowsAny<T, 6, B>(j, acc, r0, c, o_pair, o_vec); break;
      case 7: DenseRowsAny<T, 7, B>(j, acc, r0, c, o_pair, o_vec); break;
      default: DenseRowsAny<T, 8, B>(j, acc, r0, c, o_pair, o_vec); break;
    }
  }
}

// Rows c0..c1 of w, B at a time (the rest one at a time), against every row of x.
template <typename T, int B>
void DenseStream(const DenseJob<T>& j, float* acc, int64_t c0, int64_t c1, int64_t o_pair, int64_t o_vec) {
  int64_t c = c0;
  for (; c + B <= c1; c += B) DenseRowsAll<T, B>(j, acc, c, o_pair, o_vec);
  for (; c < c1; ++c) DenseRowsAll<T, 1>(j, acc, c, o_pair, o_vec);
}

#if defined(SPECJAX_VEC)
// Many rows of x against fp32 w (a batch of 17 or more decode rows, verified trees or draft rows): tiles of kTileR
// rows of x by kTileV vectors of columns whose sums stay in registers over the whole block of the contraction axis,
// where the passes above load and store each row's sums once per few rows of w. The first tile of rows reads its
// columns of the block from memory, prefetching the next columns' lines; the other tiles find them in cache. Each
// output is the same sequence of fmas as in DenseRows (from 0, over c0..c1 in order), so the bits are the same.
// The 30-layer SmolLM2 chain on two threads (docs/benchmarks.md, thirtieth session):
// 24 / 32 / 48 rows 36 / 46 / 59 ms against 43 / 55 / 81 with passes, 16 rows the same (31 ms), 8 rows slower
// (29.6 against 24.9 ms: one tile's column walk streams w worse than passes along its rows), hence kTileRows.
constexpr int kTileRows = 17;
#if defined(__AVX512F__)
constexpr int kTileR = 6, kTileV = 4;
#else
constexpr int kTileR = 3, kTileV = 2;  // AVX2: 12 of its 16 registers for the sums (``kPanelTileR``)
#endif

template <int RT, int VT>
inline void DenseTile(const DenseJob<float>& j, float* acc, int64_t r0, int64_t c0, int64_t c1, int64_t o,
                      bool prefetch) {
  const int64_t O = j.o_dim, C = j.c_dim;
  const float* __restrict x = j.x + r0 * C;
  const float* __restrict w = j.w + o;
  F16 s[RT][VT];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) s[r][v] = VZero();
  for (int64_t c = c0; c < c1; ++c) {
    F16 a[VT];
    for (int v = 0; v < VT; ++v) a[v] = VLoad(w + c * O + v * kLanes);
    if (prefetch)
      for (int v = 0; v < VT; ++v)
        PrefetchAhead<kStreamLocality>(w + c * O + v * kLanes, VT * kLanes * sizeof(float));
    for (int r = 0; r < RT; ++r) {
      const F16 xb = VSet1(x[r * C + c]);
      for (int v = 0; v < VT; ++v) s[r][v] = VFma(xb, a[v], s[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) VStore(acc + (r0 + r) * O + o + v * kLanes, s[r][v]);
}

// Columns o..o+VT*16 of rows c0..c1 of w against every row of x, kTileR rows at a time.
template <int VT>
void DenseTileColumns(const DenseJob<float>& j, float* acc, int64_t c0, int64_t c1, int64_t o) {
  for (int64_t r0 = 0; r0 < j.rows; r0 += kTileR) {
    const bool first = r0 == 0;
    switch (std::min<int64_t>(kTileR, j.rows - r0)) {
      case 1: DenseTile<1, VT>(j, acc, r0, c0, c1, o, first); break;
      case 2: DenseTile<2, VT>(j, acc, r0, c0, c1, o, first); break;
      case 3: DenseTile<3, VT>(j, acc, r0, c0, c1, o, first); break;
      case 4: DenseTile<4, VT>(j, acc, r0, c0, c1, o, first); break;
      case 5: DenseTile<5, VT>(j, acc, r0, c0, c1, o, first); break;
      default: DenseTile<kTileR, VT>(j, acc, r0, c0, c1, o, first); break;
    }
  }
}

// Rows c0..c1 of fp32 w against every row of x into acc (written, not added to), tile by tile; the last columns
// (fewer than 16) one by one.
void DenseTiles(const DenseJob<float>& j, float* acc, int64_t c0, int64_t c1) {
  const int64_t O = j.o_dim, C = j.c_dim;
  int64_t o = 0;
  for (; o + kTileV * kLanes <= O; o += kTileV * kLanes) DenseTileColumns<kTileV>(j, acc, c0, c1, o);
  for (; o + kLanes <= O; o += kLanes) DenseTileColumns<1>(j, acc, c0, c1, o);
  for (int64_t r = 0; r < j.rows; ++r)
    for (int64_t oo = o; oo < O; ++oo) {
      float s = 0.f;
      for (int64_t c = c0; c < c1; ++c) s = __builtin_fmaf(j.x[r * C + c], j.w[c * O + oo], s);
      acc[r * O + oo] = s;
    }
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Packed w (``cpu_dense.PackedWeight``, fp32 or bf16): [O / kPanel, C, kPanel], panel p holding columns p*kPanel.. of
// every row of w, row after row. The pool's threads take runs of whole panels, so each reads one contiguous stretch
// of w front to back (where [C, O] puts the rows of a pass O apart: eight streams), and the sums of a panel's kPanel
// columns for a few rows of x stay in registers over a whole block of the contraction axis (no pass over y per few
// rows of w). ``specjax_dense`` keeps its bits: each output is summed from 0 over each block of ``DenseBlocks``
// in order and the block sums are added in block order, as over [C, O], whichever thread computes it.
constexpr int kPanel = 32;
constexpr int kPanelV = kPanel / kLanes;
// Register tiles (the sums that stay in registers over a block of the contraction axis) and groups of panels (a few
// rows of x against several panels' streams at once) for the 32 vector registers of AVX-512, and for AVX2's 16 of
// half the width (an F16 takes two). On AVX2, three or four rows of x take one tile, more rows tiles of three: one
// jitted program of SmolLM2's 121 fp32 panel products per step, two threads of the 2-core Zen 1 VM, took at 1 / 3 /
// 4 / 8 / 12 / 16 rows 23-24 / 32-33 / 39-41 / 52 / 87-97 / 102-104 ms with AVX-512's shapes, 24 / 26-28 / 29-31 /
// 45-46 / 57-60 / 77-80 with these (fifty-ninth session). Each output is the same fma sequence whatever the tile or
// group, so the same bits. Two rows of bf16 x on AVX2 take one panel at a time: a group of two panels' 2 x 2 x 2 sums
// took all 16 registers, and the widened lines spilled to the stack at every fma; the 121 bf16 products at two rows
// went 14.1-14.3 -> 11.3-11.9 ms (one row's 10.4-11.1; fp32's two rows 20.7-21.0 with groups of two, 23.7-24.6
// without: there the second stream pays; sixty-second session).
#if defined(__AVX512F__) || !defined(SPECJAX_VEC)
constexpr int kPanelTileR = 12;  // rows of x per register tile: 12 x 2 sums, 2 vectors of w, one of x
constexpr int kTileSplitR = kPanelTileR;  // rows per tile where a product has more rows than one tile takes
constexpr int kGroup1 = 4, kGroup34 = 2;  // panels per group for 1 and 3-4 rows of x
template <typename T>
constexpr int kGroup2 = 4;  // for 2 rows of x
#else
constexpr int kPanelTileR = 4;
constexpr int kTileSplitR = 3;
constexpr int kGroup1 = 4, kGroup34 = 0;  // 0: three or four rows take a tile
template <typename T>
constexpr int kGroup2 = std::is_same_v<T, float> ? 2 : 1;
#endif
constexpr int64_t kPanelAhead = 1024;  // bytes of a panel between the line read and the one prefetched

#if defined(SPECJAX_VEC)
// One row of a panel as kPanelV vectors of float32: fp32 as two loads; bf16 as one 64-byte line widened into its
// even and its odd columns (``PairedLine``, as ``PairedGroup`` reads [C, O]). ``PanelOut`` puts such [even, odd]
// sums back in column order.
template <typename T>
inline void PanelRowOf(const T* __restrict q, F16 (&a)[kPanelV]) {
  if constexpr (std::is_same_v<T, float>) {
    for (int v = 0; v < kPanelV; ++v) a[v] = VLoad(q + v * kLanes);
  } else {
    VPairedLine(q, a);
  }
}

// The kPanel sums s of a row of x (as ``PanelRowOf`` gave them) into out, in column order.
template <typename T>
inline void PanelOut(float* out, const F16 (&s)[kPanelV], bool add) {
  F16 o[kPanelV] = {s[0], s[1]};
  if constexpr (!std::is_same_v<T, float>) VInColumnOrder(o);
  for (int v = 0; v < kPanelV; ++v)
    VStore(out + v * kLanes, add ? VAdd(VLoad(out + v * kLanes), o[v]) : o[v]);
}
#endif

// Few-row groups of bf16 panels prefetch each line they read this many bytes ahead into L1: a C++ chain of
// SmolLM2's 150 bf16 products on one core read 21.6 GB/s without, 25 with (fp32 panels on Zen: as fast without;
// forty-fourth session). fp32 groups of 2+ rows on Intel cores prefetch 2 KiB ahead: their hardware prefetchers left
// 4 rows x 2 panels at 11.0 GB/s on one core where one row x 4 panels streams 15.3; with the prefetches 13.7 (3 rows
// 11.5 -> 14.3, 2 rows x 4 panels 13.9 -> 15.1, one row no faster; the lm_head's panels, a C++ loop on the
// fifty-first session's Xeon).
template <typename T, int RT>
constexpr int64_t kGroupAhead = std::is_same_v<T, float> ? (!kZen && RT >= 2 ? 2048 : 0) : 1024;

// What a tile does with its sums s over rows c0..c1 of w: acc = s (the first block), or acc = acc + s (a block's sums
// added to the blocks' before it).
enum class Sums { kSet, kAdd };

// Rows c0..c1 of panel ``panel`` ([C, kPanel]) against rows 0..RT of x (row stride C), into acc (row stride O, from
// the panel's first column); ``prefetch``: bytes from each line read to the line to prefetch (0: none).
template <typename T, int RT>
inline void PanelTile(const float* __restrict x, int64_t C, const T* __restrict panel, float* __restrict acc,
                      int64_t O, int64_t c0, int64_t c1, int64_t prefetch, Sums mode) {
  const T* __restrict w = panel + c0 * kPanel;
#if defined(SPECJAX_VEC)
  F16 s[RT][kPanelV];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kPanelV; ++v) s[r][v] = VZero();
  for (int64_t c = c0; c < c1; ++c, w += kPanel) {
    F16 a[kPanelV];
    PanelRowOf(w, a);
    if (prefetch)
      for (int64_t line = 0; line < kPanel * static_cast<int64_t>(sizeof(T)); line += 64)
        PrefetchAhead<kStreamLocality>(reinterpret_cast<const char*>(w) + line, prefetch);
    for (int r = 0; r < RT; ++r) {
      const F16 xb = VSet1(x[r * C + c]);
      for (int v = 0; v < kPanelV; ++v) s[r][v] = VFma(xb, a[v], s[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r) PanelOut<T>(acc + r * O, s[r], mode == Sums::kAdd);
#else
  (void)prefetch;
  for (int r = 0; r < RT; ++r)
    for (int u = 0; u < kPanel; ++u) {
      float s = 0.f;
      for (int64_t c = c0; c < c1; ++c) s = __builtin_fmaf(x[r * C + c], load(w, (c - c0) * kPanel + u), s);
      acc[r * O + u] = mode == Sums::kAdd ? acc[r * O + u] + s : s;
    }
#endif
}

// Calls tile(std::integral_constant<int, n>) for 1 <= n <= kPanelTileR: a tile's rows as a template argument.
template <typename F>
inline void WithTileRows(int64_t n, F&& tile) {
  switch (n) {
    case 1: return tile(std::integral_constant<int, 1>{});
    case 2: return tile(std::integral_constant<int, 2>{});
    case 3: return tile(std::integral_constant<int, 3>{});
    case 4: return tile(std::integral_constant<int, 4>{});
    case 5: return tile(std::integral_constant<int, 5>{});
    case 6: return tile(std::integral_constant<int, 6>{});
    case 7: return tile(std::integral_constant<int, 7>{});
    case 8: return tile(std::integral_constant<int, 8>{});
    case 9: return tile(std::integral_constant<int, 9>{});
    case 10: return tile(std::integral_constant<int, 10>{});
    case 11: return tile(std::integral_constant<int, 11>{});
    default: return tile(std::integral_constant<int, kPanelTileR>{});
  }
}

// R rows of x against one panel in tiles of about equal size (one tile up to kPanelTileR rows, else tiles of about
// kTileSplitR): tile(r0, rows, prefetch). The
// first tile reads the rows of the panel from memory, prefetching kPanelAhead bytes ahead of itself; the last (if
// another) reads them from cache and prefetches the ``stretch`` bytes of w that follow (the next block or panel) as
// it goes, so that memory streams while it computes; the others prefetch nothing.
template <typename F>
inline void PanelTiles(int64_t R, int64_t stretch, F&& tile) {
  const int64_t tiles = R <= kPanelTileR ? 1 : (R + kTileSplitR - 1) / kTileSplitR;
  for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
    const int64_t r1 = R * (t + 1) / tiles;
    tile(r0, r1 - r0, t == 0 ? kPanelAhead : t == tiles - 1 ? stretch : 0);
    r0 = r1;
  }
}

// Rows c0..c1 of panel p against every row of x (``PanelTiles``).
template <typename T>
void PanelRows(const float* x, int64_t R, int64_t C, const T* w, float* y, int64_t O, int64_t p, int64_t c0,
               int64_t c1, Sums mode) {
  const T* panel = w + p * C * kPanel;
  PanelTiles(R, (c1 - c0) * kPanel * static_cast<int64_t>(sizeof(T)), [&](int64_t r0, int64_t rows, int64_t pf) {
    WithTileRows(rows, [&](auto rt) {
      PanelTile<T, decltype(rt)::value>(x + r0 * C, C, panel, y + r0 * O + p * kPanel, O, c0, c1, pf, mode);
    });
  });
}

// What a packed product writes: the float32 sums y themselves (``out`` null), or each sum rounded to the output's
// type and, with a residual, added to it in float32 and rounded again: the bits of XLA's ``res + y.astype(dtype)``
// (which adds two bfloat16 values in float32), so that a decoder layer's ``h + o @ wo`` is one call, not a product,
// a convert and an add.
struct Finish {
  void* out = nullptr;        // [R, O] float32 or bfloat16 (``half``); null: y is the output
  const void* res = nullptr;  // [R, O] as out, or null
  bool half = false;

  // Columns o0..o1 of every row of y.
  void Columns(const float* y, int64_t R, int64_t O, int64_t o0, int64_t o1) const {
    if (out == nullptr) return;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t a = r * O + o0, n = o1 - o0;
      if (half) {
        auto* o = static_cast<uint16_t*>(out) + a;
        const auto* h = static_cast<const uint16_t*>(res) + a;
        for (int64_t i = 0; i < n; ++i) o[i] = F32ToBf16(res ? bf16_to_f32(h[i]) + HeldBf16(y[a + i]) : y[a + i]);
      } else {
        auto* o = static_cast<float*>(out) + a;
        const auto* h = static_cast<const float*>(res) + a;
        for (int64_t i = 0; i < n; ++i) o[i] = res ? h[i] + y[a + i] : y[a + i];
      }
    }
  }
};

// ``specjax_dense`` over packed w: DenseBlocks' blocks of the contraction axis (``BlockStart``), each block's sums
// added to the blocks' before it, as RunDense adds its partials: the same bits.
template <typename T>
struct PackedJob {
  const float* x;  // [R, C]
  const T* w;      // [O / kPanel, C, kPanel]
  float* y;        // [R, O]
  int64_t rows, c_dim, o_dim;
  int blocks;
  Split split;  // of the panels
  Finish finish;
  bool group_sums = false;  // one row of bf16 x with the TMUL's bits (``PanelGroup``'s kGroupSums)
};

// Rows of x per pass over a run of panels: about kRowBlockBytes of x, so that a pass's rows of x stay in L2 while
// every panel of the run reads them (a 1024-token prompt's x is 2.4-6.3 MB at SmolLM2's shapes); the run's panels
// are read again per pass, from cache where they fit.
constexpr int64_t kRowBlockBytes = 256 * 1024;
inline int64_t RowBlock(int64_t C, int64_t value_bytes = sizeof(float)) {
  const int64_t rows = kRowBlockBytes / (C * value_bytes);
  return std::max<int64_t>(kTileSplitR, rows / kTileSplitR * kTileSplitR);
}

// Rows c0..c1 of G consecutive panels (from panel p) against RT rows of x: G streams at once, the sums of RT x G x 2
// vectors in registers (one panel's stream alone left this core's reads short of its memory rate at one row).
// ``kGroupSums``: the TMUL's bits instead of one fma chain (``amx.h``): the products of each 16 rows of w from the
// block's start summed from 0 apart, each such sum added to the block's sums.
template <typename T, int RT, int G, bool kGroupSums = false>
inline void PanelGroup(const float* __restrict x, int64_t C, const T* __restrict w, float* __restrict y, int64_t O,
                       int64_t p, int64_t c0, int64_t c1, Sums mode) {
#if defined(SPECJAX_VEC)
  using Acc = F16[RT][G][kPanelV];
  Acc s;
  const auto zero = [](Acc& a) {
    for (int r = 0; r < RT; ++r)
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < kPanelV; ++v) a[r][g][v] = VZero();
  };
  zero(s);
  const T* __restrict base = w + p * C * kPanel;
  const auto row = [&](int64_t c, Acc& acc) __attribute__((always_inline)) {
    F16 a[G][kPanelV];
    for (int g = 0; g < G; ++g) {
      const T* q = base + (g * C + c) * kPanel;
      PanelRowOf(q, a[g]);
      if constexpr (kGroupAhead<T, RT> > 0) {
        PrefetchAhead<3>(q, kGroupAhead<T, RT>);  // a bf16 panel row is one line, an fp32 row two
        if constexpr (std::is_same_v<T, float>) PrefetchAhead<3>(q, kGroupAhead<T, RT> + 64);
      }
    }
    for (int r = 0; r < RT; ++r) {
      const F16 xb = VSet1(x[r * C + c]);
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < kPanelV; ++v) acc[r][g][v] = VFma(xb, a[g][v], acc[r][g][v]);
    }
  };
  if constexpr (kGroupSums) {
    for (int64_t c = c0; c < c1;) {
      Acc t;
      zero(t);
      for (const int64_t end = std::min<int64_t>(c + kAmxGroup, c1); c < end; ++c) row(c, t);
      for (int r = 0; r < RT; ++r)
        for (int g = 0; g < G; ++g)
          for (int v = 0; v < kPanelV; ++v) s[r][g][v] = VAdd(s[r][g][v], t[r][g][v]);
    }
  } else {
    for (int64_t c = c0; c < c1; ++c) row(c, s);
  }
  for (int r = 0; r < RT; ++r)
    for (int g = 0; g < G; ++g) PanelOut<T>(y + r * O + (p + g) * kPanel, s[r][g], mode == Sums::kAdd);
#else
  static_assert(!kGroupSums, "the TMUL's bits on the vector units need AVX-512");
  for (int g = 0; g < G; ++g)
    PanelTile<T, RT>(x, C, w + (p + g) * C * kPanel, y + (p + g) * kPanel, O, c0, c1, 0, mode);
#endif
}

// Panels p0..p1 against RT rows of x, G panels at a time, each group's blocks in order.
template <typename T, int RT, int G, bool kGroupSums = false>
void PanelGroups(const float* x, int64_t C, const T* w, float* y, int64_t O, int blocks, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; p += G) {
    const int64_t n = std::min<int64_t>(G, p1 - p);
    for (int k = 0; k < blocks; ++k) {
      const int64_t c0 = BlockStart(C, blocks, k), c1 = BlockStart(C, blocks, k + 1);
      const Sums mode = k == 0 ? Sums::kSet : Sums::kAdd;
      switch (n) {
        case 1: PanelGroup<T, RT, 1, kGroupSums>(x, C, w, y, O, p, c0, c1, mode); break;
        case 2: PanelGroup<T, RT, std::min(G, 2), kGroupSums>(x, C, w, y, O, p, c0, c1, mode); break;
        case 3: PanelGroup<T, RT, std::min(G, 3), kGroupSums>(x, C, w, y, O, p, c0, c1, mode); break;
        default: PanelGroup<T, RT, G, kGroupSums>(x, C, w, y, O, p, c0, c1, mode); break;
      }
    }
  }
}

// Up to this many rows of x, a product's panels are cut into one run per thread (a single stretch of w each; more
// rows: about four runs per thread, ``MakeSplit``). With AVX-512 one to two rows take groups of four panels, three
// or four rows groups of two (fp32 on Intel cores: up to eight rows, ``kWideGroups``), more rows one panel at a time
// with up to kPanelTileR rows of x per tile (``PanelRows``); AVX2's groups and tiles are smaller (``kGroup1``).
constexpr int64_t kRunPerThreadRows = 8;

// fp32 products of 5-8 rows on Intel cores also take groups of two panels (prefetched, ``kGroupAhead``) rather than
// one panel at a time: one stream per panel left a 6-8-row product at 10 GB/s on one core of the fifty-first
// session's Xeon where two streams read 13.3-14.1 (a C++ loop over the lm_head's panels), and SmolLM2's chained
// products at 6 and 8 rows at 1.3-1.5x one row's time. The same fma sequence per output, so the same bits. AVX-512
// only: on AVX2 such a group's 5-8 x 2 x 4 sums would not fit its 16 registers (``kPanelTileR``).
template <typename T>
constexpr bool kWideGroups = std::is_same_v<T, float> && !kZen && kLanes * 32 == kVectorBits;

// One row of x (a batch-1 decode step, a draft step) instead takes chunks of one group of panels, which the threads
// take in turn as they come free: SmolLM2's bf16 step on two threads 1.12x faster (fp32 1.01x), where one run per
// thread left one thread waiting for the other at the end of each product; at 2-8 rows no faster or up to 10% slower
// (forty-fifth session). Which thread computes a panel does not change its bits.
constexpr int64_t kOneRowPanels = 4;

// A run of panels: each panel's blocks in order, so a run reads its stretch of w front to back (per pass of rows).
template <typename T>
void PackedChunk(const void* ctx, int i) {
  const auto& j = *static_cast<const PackedJob<T>*>(ctx);
  const int64_t p0 = i * j.split.width, p1 = std::min(j.o_dim / kPanel, p0 + j.split.width);
  const int64_t C = j.c_dim, O = j.o_dim, step = RowBlock(C);
  switch (j.rows) {
    case 1:
#if defined(SPECJAX_AMX)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (j.group_sums) {
          // AMX flushes inputs and results below float32's normal range to zero: so do these fmas.
          const unsigned csr = _mm_getcsr();
          _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
          PanelGroups<T, 1, 4, true>(j.x, C, j.w, j.y, O, j.blocks, p0, p1);
          _mm_setcsr(csr);
          break;
        }
      }
#endif
      PanelGroups<T, 1, kGroup1>(j.x, C, j.w, j.y, O, j.blocks, p0, p1);
      break;
    case 2: PanelGroups<T, 2, kGroup2<T>>(j.x, C, j.w, j.y, O, j.blocks, p0, p1); break;
    case 3: case 4:
      if constexpr (kGroup34 > 0) {
        if (j.rows == 3) PanelGroups<T, 3, kGroup34>(j.x, C, j.w, j.y, O, j.blocks, p0, p1);
        else PanelGroups<T, 4, kGroup34>(j.x, C, j.w, j.y, O, j.blocks, p0, p1);
        break;
      }
      [[fallthrough]];
    case 5: case 6: case 7: case 8:
      if constexpr (kWideGroups<T>) {
        WithTileRows(j.rows, [&](auto rt) {
          if constexpr (decltype(rt)::value <= 8)
            PanelGroups<T, decltype(rt)::value, 2>(j.x, C, j.w, j.y, O, j.blocks, p0, p1);
        });
        break;
      }
      [[fallthrough]];
    default:
      for (int64_t r0 = 0; r0 < j.rows; r0 += step) {
        const int64_t rows = std::min(step, j.rows - r0);
        for (int64_t p = p0; p < p1; ++p)
          for (int k = 0; k < j.blocks; ++k)
            PanelRows(j.x + r0 * C, rows, C, j.w, j.y + r0 * O, O, p, BlockStart(C, j.blocks, k),
                      BlockStart(C, j.blocks, k + 1), k == 0 ? Sums::kSet : Sums::kAdd);
      }
  }
  j.finish.Columns(j.y, j.rows, O, p0 * kPanel, p1 * kPanel);
}

// The runs of panels of a packed product of R rows: chunks of kOneRowPanels for one row, one run per thread up to
// kRunPerThreadRows rows, else about four per thread.
inline Split PackedSplit(int64_t R, int64_t panels) {
  if (R == 1) return {kOneRowPanels, static_cast<int>((panels + kOneRowPanels - 1) / kOneRowPanels)};
  if (R > kRunPerThreadRows) return MakeSplit(panels, 1, 1);
  const int64_t width = (panels + PoolThreads() - 1) / PoolThreads();
  return {width, static_cast<int>((panels + width - 1) / width)};
}

// y: the float32 sums (the output itself where ``finish`` has none).
template <typename T>
void RunPacked(const float* x, const T* w, float* y, int64_t R, int64_t C, int64_t O, Finish finish = {},
               bool group_sums = false) {
  PackedJob<T> job{x, w, y, R, C, O, DenseBlocks(C), PackedSplit(R, O / kPanel), finish, group_sums};
  Parallel(PackedChunk<T>, &job, job.split.n);
}

#if defined(SPECJAX_AMX)
// ``specjax_dense`` of bf16 x against bf16 panels on the TMUL (``amx.h``; where ``AmxReady``, every such product,
// whatever its rows, so that a tree row keeps the decode step's bits): the runs of panels of ``PackedSplit``,
// kAmxPanels panels at a time, each block of the contraction axis for every tile of rows of x, its sums added to the blocks'
// before it as ``PanelOut`` adds them.
struct AmxJob {
  const AmxRowsOfX* xs;
  const uint16_t* w;  // [O / kPanel, C, kPanel]
  float* y;           // [R, O]
  int64_t rows, tile_rows, c_dim, o_dim;
  int blocks;
  Split split;
  Finish finish;
};

template <int G>
void AmxPanels(const AmxJob& j, int64_t p) {
  const int64_t C = j.c_dim, O = j.o_dim, xs_bytes = j.xs->stride * static_cast<int64_t>(sizeof(uint16_t));
  alignas(64) float sums[G][2 * kAmxRows][16];
  for (int k = 0; k < j.blocks; ++k) {
    const int64_t c0 = BlockStart(C, j.blocks, k), c1 = BlockStart(C, j.blocks, k + 1);
    for (int64_t r0 = 0; r0 < j.rows; r0 += j.tile_rows) {
      const uint16_t* xs = j.xs->data.data() + 2 * r0 * j.xs->stride + j.xs->offset[k];
      AmxBlock<G>(xs, xs_bytes, j.w + p * C * kPanel, C, c0, c1, sums);
      for (int64_t r = 0; r < std::min(j.tile_rows, j.rows - r0); ++r)
        for (int g = 0; g < G; ++g) {
          const F16 s[kPanelV] = {VLoad(sums[g][2 * r]), VLoad(sums[g][2 * r + 1])};
          PanelOut<uint16_t>(j.y + (r0 + r) * O + (p + g) * kPanel, s, k > 0);
        }
    }
  }
}

void AmxChunk(const void* ctx, int i) {
  const auto& j = *static_cast<const AmxJob*>(ctx);
  const int64_t p0 = i * j.split.width, p1 = std::min(j.o_dim / kPanel, p0 + j.split.width);
  {
    const AmxScope tiles(AmxConfig(static_cast<int>(j.tile_rows)));
    for (int64_t p = p0; p < p1; p += kAmxPanels) {
      switch (std::min<int64_t>(kAmxPanels, p1 - p)) {
        case 1: AmxPanels<1>(j, p); break;
        case 2: AmxPanels<2>(j, p); break;
        case 3: AmxPanels<3>(j, p); break;
        default: AmxPanels<kAmxPanels>(j, p); break;
      }
    }
  }
  j.finish.Columns(j.y, j.rows, j.o_dim, p0 * kPanel, p1 * kPanel);
}

void RunPackedAmx(const uint16_t* x, const uint16_t* w, float* y, int64_t R, int64_t C, int64_t O, Finish finish) {
  const int64_t tile_rows = std::min<int64_t>(R, kAmxRows);
  const int blocks = DenseBlocks(C);
  thread_local AmxRowsOfX xs;
  xs.Build(x, R, (R + tile_rows - 1) / tile_rows * tile_rows, C, blocks, BlockStart);
  AmxJob job{&xs, w, y, R, tile_rows, C, O, blocks, PackedSplit(R, O / kPanel), finish};
  Parallel(AmxChunk, &job, job.split.n);
}
#endif

#if defined(__AVX512BF16__)
// Many bf16 rows of x against bf16 panels: a bf16 prompt chunk (``cpu_dense.dense_prompt``), where the products are
// bound by arithmetic, not by reading w. AVX512-BF16's dot products take two rows of w at once (rows c and c+1 of a
// panel interleaved per column: one vdpbf16ps does 16 columns x 2 rows where the widening fmas above do 16 x 1, from
// bf16 x read as bf16). Their sums are not the fma sequence of ``specjax_dense`` (a prompt's products never had
// those bits: XLA's YNNPACK products ran them, as fast as this; docs/benchmarks.md, forty-fourth session), but each
// output is one fixed sequence whatever the rows or threads.
template <int RT>
inline void PanelDotTile(const uint16_t* __restrict x, int64_t C, const uint16_t* __restrict panel,
                         float* __restrict acc, int64_t O, int64_t prefetch) {
  F16 s[RT][2];
  for (int r = 0; r < RT; ++r) s[r][0] = s[r][1] = VZero();
  const uint16_t* __restrict w = panel;
  int64_t c = 0;
  // lo: columns 8k..8k+3 of each 128-bit lane k, hi: 8k+4..8k+7, each 32-bit lane the pair (w[c], w[c + 1]).
  auto step = [&](__m512i r0, __m512i r1, const uint32_t (&pair)[RT]) {
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1), hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
    for (int r = 0; r < RT; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair[r]));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], xb, lo);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], xb, hi);
    }
  };
  uint32_t pair[RT];
  for (; c + 2 <= C; c += 2, w += 2 * kPanel) {
    if (prefetch) {
      PrefetchAhead<kStreamLocality>(w, prefetch);
      PrefetchAhead<kStreamLocality>(w + kPanel, prefetch);
    }
    for (int r = 0; r < RT; ++r) std::memcpy(&pair[r], x + r * C + c, sizeof(uint32_t));
    step(_mm512_loadu_si512(w), _mm512_loadu_si512(w + kPanel), pair);
  }
  if (c < C) {  // an odd C's last row of w, paired with zeros
    for (int r = 0; r < RT; ++r) pair[r] = x[r * C + c];
    step(_mm512_loadu_si512(w), _mm512_setzero_si512(), pair);
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < RT; ++r) {
    VStore(acc + r * O, _mm512_permutex2var_ps(s[r][0], first, s[r][1]));
    VStore(acc + r * O + kLanes, _mm512_permutex2var_ps(s[r][0], second, s[r][1]));
  }
}

struct DotJob {
  const uint16_t* x;  // [R, C] bf16
  const uint16_t* w;  // [O / kPanel, C, kPanel]
  float* y;           // [R, O]
  int64_t rows, c_dim, o_dim;
  Split split;  // of the panels
};

// Panel p against R rows of x (from x, y; ``PanelTiles``).
inline void PanelDotRows(const DotJob& j, const uint16_t* x, float* y, int64_t R, int64_t p) {
  const int64_t C = j.c_dim, O = j.o_dim;
  const uint16_t* panel = j.w + p * C * kPanel;
  PanelTiles(R, C * kPanel * static_cast<int64_t>(sizeof(uint16_t)), [&](int64_t r0, int64_t rows, int64_t pf) {
    WithTileRows(rows, [&](auto rt) {
      PanelDotTile<decltype(rt)::value>(x + r0 * C, C, panel, y + r0 * O + p * kPanel, O, pf);
    });
  });
}

// A run of panels against every row of x, a block of rows (about kRowBlockBytes of x) at a time.
void PanelDotChunk(const void* ctx, int i) {
  const auto& j = *static_cast<const DotJob*>(ctx);
  const int64_t p0 = i * j.split.width, p1 = std::min(j.o_dim / kPanel, p0 + j.split.width);
  const int64_t step = RowBlock(j.c_dim, sizeof(uint16_t));
  for (int64_t r0 = 0; r0 < j.rows; r0 += step)
    for (int64_t p = p0; p < p1; ++p)
      PanelDotRows(j, j.x + r0 * j.c_dim, j.y + r0 * j.o_dim, std::min(step, j.rows - r0), p);
}

void RunPanelDots(const uint16_t* x, const uint16_t* w, float* y, int64_t R, int64_t C, int64_t O) {
  DotJob job{x, w, y, R, C, O, MakeSplit(O / kPanel, 1, 1)};
  Parallel(PanelDotChunk, &job, job.split.n);
}
#endif

template <typename T>
void DenseChunk(const void* ctx, int k) {
  const auto& j = *static_cast<const DenseJob<T>*>(ctx);
  float* acc = k == 0 ? j.y : j.part + (k - 1) * j.rows * j.o_dim;
  const int64_t c0 = BlockStart(j.c_dim, j.blocks, k), c1 = BlockStart(j.c_dim, j.blocks, k + 1);
  const int64_t o_vec = j.o_dim / kLanes * kLanes, o_pair = PairedColumns<T>(j.o_dim);
#if defined(SPECJAX_VEC)
  if constexpr (std::is_same_v<T, float>) {
    if (j.rows >= kTileRows) return DenseTiles(j, acc, c0, c1);
  }
#endif
  std::memset(acc, 0, j.rows * j.o_dim * sizeof(float));
  // Rows of w per pass over y. bf16 (read in column pairs): eight for up to three rows of x, four for more (the
  // 30-layer bf16 chain with L2 prefetches at 1 / 2 / 4 / 5 / 8 rows: 26-27 / 24 / 19 / 13 / 9.5 GB/s with eight,
  // 25 / 23 / 21 / 19 / 15 with four; twenty-fifth session). fp32: eight (the fp32 chain at 2 / 4 / 8 rows: 18.3 /
  // 18.2 / 23.1 ms with sixteen, 16.0 / 17.3 / 20.8 with eight, one row 15.5 either way on the Intel VM, twenty-second
  // session; four no better, twenty-fifth; one row on one core of a Zen 5 VM 5-12% faster with eight than sixteen,
  // thirty-ninth). Passes of any length give the same bits: each column's sums are the same sequence of fmas.
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (j.rows >= 4) DenseStream<T, 4>(j, acc, c0, c1, o_pair, o_vec);
    else DenseStream<T, 8>(j, acc, c0, c1, o_pair, o_vec);
#if defined(SPECJAX_VEC)
    UnpairColumns(acc, j.rows, j.o_dim, o_pair);
#endif
  } else {
    DenseStream<T, 8>(j, acc, c0, c1, o_pair, o_vec);
  }
}

// Blocks [blocks * i / runs, blocks * (i + 1) / runs): one run of consecutive blocks, i.e. one contiguous stretch of
// w, per thread. The prefetches at the end of a block then fetch the first passes of the next, which the same
// thread streams; with the blocks taken one at a time, every block began with passes read from memory unprefetched
// (a run per thread streamed SmolLM2's layer products 2-4% faster at one row of x, 3-14% at 2-8; twenty-sixth
// session). The bits are those of the blocks, whichever thread runs them.
template <typename T>
void DenseRun(const void* ctx, int i) {
  const auto& j = *static_cast<const DenseJob<T>*>(ctx);
  for (int k = j.blocks * i / j.runs; k < j.blocks * (i + 1) / j.runs; ++k) DenseChunk<T>(ctx, k);
}

template <typename T>
void RunDense(const float* x, const T* w, float* y, int64_t R, int64_t C, int64_t O) {
  const int blocks = DenseBlocks(C);
  thread_local std::vector<float> part;
  part.resize((blocks - 1) * R * O);
  DenseJob<T> job{x, w, y, part.data(), R, C, O, blocks, std::min(blocks, PoolThreads())};
  Parallel(DenseRun<T>, &job, job.runs);
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

// One fp32 row of x on Zen reads the table one row at a time, prefetching the next row into L1: a single stream, as
// fast as a plain read of the table within 10% (4.0-4.2 ms against 3.6-3.7 for SmolLM2's 113 MB on one core), where
// tiles of 16 rows prefetched into L2 took 5.1 and tiles of 2-8 rows 4.6-6.6 (a C++ loop over the table, forty-third
// session). Other tiles prefetch into ``kStreamLocality``.
template <typename T, int R>
constexpr int kUnembedRows = kVectorBits == 256 ? (R == 1 ? (kZen && std::is_same_v<T, float> ? 1 : 4) : 2)  // AVX2
                             : R == 1 ? (kZen ? (std::is_same_v<T, float> ? 1 : 16) : 8) : R <= 4 ? 4 : 2;
template <typename T, int R, int VT>
constexpr int kUnembedLocality = kZen && R == 1 && VT == 1 && std::is_same_v<T, float> ? 3 : kStreamLocality;

// Table rows v..v+VT against rows r0..r0+R of x: each vector of a table row is loaded once for all R rows, each
// vector of x once for all VT table rows, and the R x VT sums are independent chains (the fma latency is hidden).
// Each output's lane sums are the same sequence whatever R and VT.
template <typename T, int R, int VT>
void UnembedTile(const UnembedJob<T>& j, int64_t r0, int64_t v) {
  const int64_t D = j.d_dim, V = j.v_dim, d_vec = D / kLanes * kLanes;
  const float* __restrict x = j.x + r0 * D;
  float lanes[R][VT][kLanes];
#if defined(SPECJAX_VEC)
  F16 acc[R][VT];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < VT; ++u) acc[r][u] = VZero();
  for (int64_t d = 0; d < d_vec; d += kLanes) {
    F16 tl[VT];
    for (int u = 0; u < VT; ++u) tl[u] = VLoad(j.t + (v + u) * D + d);
    // the next tile's rows (past the table's end at its last tile: harmless). Without it R rows of x took ~R/2
    // times one row's time: too few table loads in flight among the R x VT fmas per step.
    for (int u = 0; u < VT; ++u)
      PrefetchAhead<kUnembedLocality<T, R, VT>>(j.t + (v + u) * D + d, VT * D * static_cast<int64_t>(sizeof(T)));
    for (int r = 0; r < R; ++r) {
      const F16 xr = VLoad(x + r * D + d);
      for (int u = 0; u < VT; ++u) acc[r][u] = VFma(xr, tl[u], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < VT; ++u) VStore(lanes[r][u], acc[r][u]);
#else
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < VT; ++u)
      for (int l = 0; l < kLanes; ++l) lanes[r][u][l] = 0.f;
  for (int64_t d = 0; d < d_vec; d += kLanes)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < VT; ++u)
        for (int l = 0; l < kLanes; ++l)
          lanes[r][u][l] = __builtin_fmaf(x[r * D + d + l], load(j.t + (v + u) * D, d + l), lanes[r][u][l]);
#endif
  float* y = j.y + r0 * V;
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < VT; ++u) y[r * V + v + u] = FinishDot(lanes[r][u], x + r * D, j.t + (v + u) * D, d_vec, D);
}

// Table rows [v0, v1) against rows r0..r0+R of x, tiles of table rows sized so that the sums stay in registers.
template <typename T, int R>
void UnembedRows(const UnembedJob<T>& j, int64_t r0, int64_t v0, int64_t v1) {
  // One bf16 row of x on Zen: sixteen table rows per tile (the fp32 product 20% faster than with eight on Zen 4, the
  // same on two threads, which the memory bounds; thirty-first session); one fp32 row: one table row (above).
  constexpr int VT = kUnembedRows<T, R>;
  int64_t v = v0;
  for (; v + VT <= v1; v += VT) UnembedTile<T, R, VT>(j, r0, v);
  for (; v < v1; ++v) UnembedTile<T, R, 1>(j, r0, v);
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

template <typename T>
void RunUnembed(const float* x, const T* t, float* y, int64_t R, int64_t D, int64_t V) {
  const Split split = MakeSplit(V, 1, 64);
  UnembedJob<T> job{x, t, y, R, D, V, split};
  Parallel(UnembedChunk<T>, &job, split.n);
}

// Products of at most this many rows run on specjax's pool (``cpu_dense.MAX_PROMPT_ROWS``: decode steps, trees,
// draft steps, prompt chunks of up to 32 tokens), longer ones on XLA's.
constexpr int64_t kOwnPoolRows = 32;

// x [R, C] against w: [C, O] or packed [O / kPanel, C, kPanel] (kTable false, ``specjax_dense``) or a
// table [O, C] (``specjax_unembed``) -> y [R, O] float32. Against packed w, y may also be bfloat16 (the sums rounded)
// and ``res`` (``specjax_dense_add``, y's type and shape) added to them (``Finish``).
ffi::Error Product(bool table, ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, const ffi::AnyBuffer* res,
                   ffi::AnyBuffer y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  // Products of more rows than a decode step, a tree or a short prompt chunk (specjax's pool spins between a
  // step's short products) take their chunks on XLA's own intra-op pool: two pools on the same cores slowed the
  // prompts' products 15-27% (docs/benchmarks.md, forty-second and forty-third sessions).
  const XlaPoolScope scope(xd.size() == 2 && xd[0] > kOwnPoolRows ? &tp : nullptr);
  const bool packed = !table && wd.size() == 3;
  if (xd.size() != 2 || (wd.size() != 2 && !packed) || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax cpu dense: x, w and y must be 2-D (w may be packed)");
  const auto xt = x.element_type(), wt = w.element_type(), yt = y.element_type();
  if (!((xt == ffi::DataType::F32 || xt == ffi::DataType::BF16) && (wt == xt || wt == ffi::DataType::BF16)))
    return ffi::Error::InvalidArgument("specjax cpu dense: x and w must be float32 or bfloat16, and w bfloat16 "
                                       "unless both are float32");
  if (!FloatType(yt) || ((yt != ffi::DataType::F32 || res != nullptr) && !packed))
    return ffi::Error::InvalidArgument("specjax cpu dense: y must be float32 (or bfloat16, with a residual or "
                                       "not, against packed w)");
  if (packed && wd[2] != kPanel)
    return ffi::Error::InvalidArgument("specjax cpu dense: a packed w must be [O / 32, C, 32]");
  const int64_t R = xd[0], C = xd[1], O = packed ? wd[0] * kPanel : wd[table || packed ? 0 : 1];
  if (wd[table || packed ? 1 : 0] != C || yd[0] != R || yd[1] != O)
    return ffi::Error::InvalidArgument("specjax cpu dense: shapes do not match");
  if (res != nullptr && (res->element_type() != yt || res->element_count() != y.element_count()))
    return ffi::Error::InvalidArgument("specjax cpu dense: the residual must have y's type and shape");
  thread_local std::vector<float> xbuf, ybuf;
  // bf16 x on the tiles (2+ rows) is read as bf16: no float32 copy of it.
  const bool tiles = packed && xt == ffi::DataType::BF16 && wt == ffi::DataType::BF16 && R > 1 && AmxReady();
  const float* xf = tiles ? nullptr : AsF32(x, xbuf);
  const bool f32 = w.element_type() == ffi::DataType::F32;
  const void* wp = w.untyped_data();
  float* out = static_cast<float*>(y.untyped_data());
  if (table) {
    if (f32) RunUnembed(xf, static_cast<const float*>(wp), out, R, C, O);
    else RunUnembed(xf, static_cast<const uint16_t*>(wp), out, R, C, O);
  } else if (packed) {
    const bool half = yt == ffi::DataType::BF16;
    Finish finish;
    if (half || res != nullptr) finish = {y.untyped_data(), res ? res->untyped_data() : nullptr, half};
    if (half) ybuf.resize(R * O), out = ybuf.data();
    if (f32) RunPacked(xf, static_cast<const float*>(wp), out, R, C, O, finish);
#if defined(SPECJAX_AMX)
    else if (xt == ffi::DataType::BF16 && AmxReady() && R == 1)  // the tiles' bits, streamed as fast as before
      RunPacked(xf, static_cast<const uint16_t*>(wp), out, R, C, O, finish, /*group_sums=*/true);
    else if (tiles)
      RunPackedAmx(static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(wp), out, R, C, O,
                   finish);
#endif
    else RunPacked(xf, static_cast<const uint16_t*>(wp), out, R, C, O, finish);
  } else {
    if (f32) RunDense(xf, static_cast<const float*>(wp), out, R, C, O);
    else RunDense(xf, static_cast<const uint16_t*>(wp), out, R, C, O);
  }
  return ffi::Error::Success();
}

template <bool kTable>
ffi::Error ProductImpl(ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return Product(kTable, tp, x, w, nullptr, *y);
}

ffi::Error ProductAddImpl(ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer res,
                          ffi::Result<ffi::AnyBuffer> y) {
  return Product(false, tp, x, w, &res, *y);
}

// ``specjax_dense_prompt``: bf16 x [R, C] against bf16 panels [O / 32, C, 32] -> y [R, O] float32 (a bf16 prompt
// chunk against the decode layout): ``RunPackedAmx`` where the CPU has AMX (``AmxReady``), else ``RunPanelDots``
// where it has AVX512-BF16, else the widening ``RunPacked`` (an AVX2 CPU: 1.3-1.4x YNNPACK's bf16 dots over [C, O]).
ffi::Error PromptImpl(ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const XlaPoolScope scope(xd.size() == 2 && xd[0] > kOwnPoolRows ? &tp : nullptr);
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("specjax cpu dense prompt: x [R, C], w [O / 32, C, 32], y [R, O] expected");
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("specjax cpu dense prompt: x and w must be bfloat16");
  const int64_t R = xd[0], C = xd[1], O = wd[0] * kPanel;
  if (wd[1] != C || yd[0] != R || yd[1] != O)
    return ffi::Error::InvalidArgument("specjax cpu dense prompt: shapes do not match");
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
#if defined(SPECJAX_AMX)
  if (AmxReady()) {  // the tiles, as a decode step's products on this CPU
    RunPackedAmx(static_cast<const uint16_t*>(x.untyped_data()), wp, y->typed_data(), R, C, O, Finish{});
    return ffi::Error::Success();
  }
#endif
#if defined(__AVX512BF16__)
  RunPanelDots(static_cast<const uint16_t*>(x.untyped_data()), wp, y->typed_data(), R, C, O);
#else
  thread_local std::vector<float> xbuf;
  RunPacked(AsF32(x, xbuf), wp, y->typed_data(), R, C, O);
#endif
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDense, ProductImpl<false>, SPECJAX_BINDING.Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDenseAdd, ProductAddImpl,
                              SPECJAX_BINDING.Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxUnembed, ProductImpl<true>, SPECJAX_BINDING.Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDensePrompt, PromptImpl, SPECJAX_BINDING.Ret<ffi::Buffer<ffi::F32>>());

// Threads for the products (1: no pool). Called from Python through ctypes.
extern "C" void specjax_cpu_set_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_pool.reset();
  if (n <= 0) n = DefaultThreads();
  if (n > 1) g_pool = std::make_unique<Pool>(n);
}

extern "C" int specjax_cpu_threads() { return PoolThreads(); }

// Whether ``specjax_dense`` runs bf16 x against bf16 panels on AMX tiles (``amx.h``: this build's CPU has them and
// the OS lends them).
extern "C" int specjax_cpu_amx() { return AmxReady() ? 1 : 0; }

// The float32 lanes of this build's vector code (``common.h``'s F16): 16 with AVX-512, 8 with AVX2 + FMA, 0 (the scalar
// loops) without either.
extern "C" int specjax_cpu_vector() {
#if defined(__AVX512F__)
  return 16;
#elif defined(SPECJAX_VEC)
  return 8;
#else
  return 0;
#endif
}
