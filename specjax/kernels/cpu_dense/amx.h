// Intel AMX (tile registers and the TMUL unit) for bf16 rows of x against bf16 panels: the parts that do not depend
// on the products' jobs. ``dense.cc`` runs its bf16 panel products on them where ``AmxReady()``.
//
// ``tdpbf16ps`` multiplies a tile A [M rows x 32 bf16] by a tile B [16 rows x 32 bf16] read as 16 pairs of rows
// (B's row k holds the pairs (row 2k, row 2k + 1) of each of 16 columns): C[m][n] += sum over k of A[m][2k] *
// B[k][2n] + A[m][2k + 1] * B[k][2n + 1]. A panel's rows (``PackedWeight``: 32 bf16 columns per 64-byte row) are
// not pairs of rows, but 16 of them are a B tile as they lie (1 KB, one contiguous stretch of the panel) when A
// holds each x value beside a zero: with x[c + k] at A[m][2k] and 0 at A[m][2k + 1], C[m][n] sums x[c + k] *
// w[c + k][2n] over k, the panel's even columns; with the zero first, its odd ones. So each row of x is two rows
// of A (evens, odds) and one C tile [2 rows x 16] holds a panel's 32 sums for up to 8 rows of x: twice the TMUL's
// work of a pair layout, but a decode step's products are bound by reading w, and the TMUL does a 16-row group of
// w for 8 rows of x in about the time it takes for one (docs/benchmarks.md, fifty-seventh session), where the
// widening fmas take 1.6x one row's time at 8 rows.
//
// The bits, measured on the TMUL (and pinned by tests/test_cpu_dense.py against an emulation): each instruction
// sums its 16 products in float32 from 0, in order, and adds that sum to C. So an output is, per block of the
// contraction axis, a float32 sum of 16-row groups (from the block's start; a short last group padded with zeros),
// each group's products summed from 0 in order; not the widening kernels' single fma chain (``dense.cc``'s
// ``kGroupSums`` passes give one row of x these bits on the vector units). Inputs and results below float32's
// normal range are flushed to zero. Every output is one fixed sequence whatever the rows or threads.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SPECJAX_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specjax_cpu {

constexpr int kAmxRows = 8;       // rows of x per tile: two rows of A and of C each
constexpr int kAmxGroup = 16;     // rows of w per B tile (16 rows of a panel: 1 KB)
constexpr int kAmxPanels = 4;     // panels per pass: 4 C tiles, 3 B tiles (the fourth panel reuses the first's), A
constexpr int64_t kAmxAhead = 2048;  // bytes between a line of a panel read and the one prefetched (into L1)

#if defined(SPECJAX_AMX)
// Linux lends a thread the tile registers' state only after the process asked for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16+); false where the kernel refuses, or where the
// environment sets SPECJAX_CPU_AMX=0 (the widening kernels instead: their bits, their speed). Decided once per
// process, so that every product of a run has the same bits.
inline bool AmxReady() {
  static const bool ready = [] {
    const char* env = std::getenv("SPECJAX_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// The tile configuration (palette 1): tiles 0-3 the sums C [2 x rows of x, 16 float32], 4-6 the panels' B tiles
// [16 x 32 bf16], 7 the x tile A [2 x rows of x, 32 bf16].
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit AmxConfig(int x_rows) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = static_cast<uint8_t>(t >= 4 && t <= 6 ? kAmxGroup : 2 * x_rows);
    }
  }
};

// Loads a configuration on this thread for its lifetime and releases the tiles at its end.
struct AmxScope {
  explicit AmxScope(const AmxConfig& cfg) { _tile_loadconfig(&cfg); }
  ~AmxScope() { _tile_release(); }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// x [R, C] bf16 as A tiles: two rows per row of x, each with a segment of 32 n values per block [c0, c1) of the
// contraction axis (n: its 16-row groups): x[c0], 0, x[c0 + 1], 0, ... (the evens' row) and 0, x[c0], 0, ... (the
// odds'), zeros past c1. Group g of a block is the 32 values from its segment's start + 32 g. Rows past R (up to
// ``rows``, a multiple of the tile's rows) are zeros.
struct AmxRowsOfX {
  std::vector<uint16_t> data;
  int64_t stride = 0;       // values per row of A
  int64_t offset[8] = {};   // each block's segment within a row

  void Build(const uint16_t* x, int64_t R, int64_t rows, int64_t C, int blocks, int64_t (*start)(int64_t, int, int)) {
    stride = 0;
    for (int k = 0; k < blocks; ++k) {
      offset[k] = stride;
      stride += 32 * Groups(start(C, blocks, k + 1) - start(C, blocks, k));
    }
    data.assign(2 * rows * stride, 0);
    for (int64_t r = 0; r < R; ++r)
      for (int k = 0; k < blocks; ++k) {
        const int64_t c0 = start(C, blocks, k), c1 = start(C, blocks, k + 1);
        uint16_t* even = data.data() + 2 * r * stride + offset[k];
        for (int64_t c = c0; c < c1; ++c) even[2 * (c - c0)] = even[stride + 2 * (c - c0) + 1] = x[r * C + c];
      }
  }
  static int64_t Groups(int64_t n) { return (n + kAmxGroup - 1) / kAmxGroup; }
};

// Panel g of a pass: its B tile (4, 5, 6, then 4 again) loaded from b and multiplied into C tile g (GCC's tile
// intrinsics take the tiles' numbers as literal tokens).
template <int g>
inline void AmxPanelStep(const uint16_t* b) {
  if constexpr (g == 0) {
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(0, 7, 4);
  } else if constexpr (g == 1) {
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(1, 7, 5);
  } else if constexpr (g == 2) {
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(2, 7, 6);
  } else {
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(3, 7, 4);
  }
}

template <int g>
inline void AmxStore(float* out) {
  if constexpr (g == 0) _tile_stored(0, out, 64);
  else if constexpr (g == 1) _tile_stored(1, out, 64);
  else if constexpr (g == 2) _tile_stored(2, out, 64);
  else _tile_stored(3, out, 64);
}

// Rows c0..c1 of G (1 to kAmxPanels) consecutive panels (``panel``, each [C, 32]) against the rows of A from ``xs``
// (the block's segment of its first row; ``xs_bytes`` between rows): the block's sums into sums[G][2 kAmxRows][16]
// (row 2 r: row r's sums of the panel's even columns, 2 r + 1: of its odd ones). A short last group is read from
// a zero-padded copy.
template <int G>
inline void AmxBlock(const uint16_t* xs, int64_t xs_bytes, const uint16_t* panel, int64_t C, int64_t c0, int64_t c1,
                     float (*sums)[2 * kAmxRows][16]) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  alignas(64) uint16_t tail[G][kAmxGroup * 32];
  for (int64_t c = c0, g = 0; c < c1; c += kAmxGroup, ++g) {
    const uint16_t* b[G];
    for (int p = 0; p < G; ++p) {
      b[p] = panel + (p * C + c) * 32;
      if (c + kAmxGroup > c1) {  // rows past the block: zeros (x is zero there, but w may not be finite)
        std::memset(tail[p], 0, sizeof tail[p]);
        std::memcpy(tail[p], b[p], (c1 - c) * 32 * sizeof(uint16_t));
        b[p] = tail[p];
      } else {
        for (int line = 0; line < kAmxGroup; ++line) PrefetchAhead<3>(b[p] + line * 32, kAmxAhead);
      }
    }
    _tile_loadd(7, xs + 32 * g, xs_bytes);
    AmxPanelStep<0>(b[0]);
    if constexpr (G > 1) AmxPanelStep<1>(b[1]);
    if constexpr (G > 2) AmxPanelStep<2>(b[2]);
    if constexpr (G > 3) AmxPanelStep<3>(b[3]);
  }
  AmxStore<0>(sums[0][0]);
  if constexpr (G > 1) AmxStore<1>(sums[1][0]);
  if constexpr (G > 2) AmxStore<2>(sums[2][0]);
  if constexpr (G > 3) AmxStore<3>(sums[3][0]);
}
#else
inline bool AmxReady() { return false; }
#endif

}  // namespace specjax_cpu
