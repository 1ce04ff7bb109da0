// specjax's CPU attention for the few new tokens of a decode step, a verified tree or a draft step over the paged
// KV pool, and for a prompt chunk's tokens (the blocked path, ``PromptAttention``): an XLA FFI custom call.
//
//   specjax_paged_attention: q [B, T, N, H], k_new, v_new [B, Tk, K, H], mask bool[B, T, Tk], the K and V pools
//   [L, P, K, Z, H] (or lane-packed [L, P, K, Z/f, f*H], the same bytes; bf16 as bf16 or as its uint16 bits),
//   page_table i32[B, pps], lengths i32[B], layer i32[] -> o f32[B, T, N, H]
//
// Query (b, t, n) sees the pool positions p < lengths[b] of its row and the new keys j that mask[b, t, j] lets it
// see: with ``keys_in_pool`` those are already in the pool at position lengths[b] + j (a decode step, a verified
// chain), else they are read from k_new, v_new (a tree, a draft step's tree buffer). Scores in float32
// (q.k * sm_scale), an exact softmax (the row's maximum first), the values summed with float32 weights; a query that
// sees nothing gives 0. Positions past a row's page table are not seen (as on the XLA path: never gathered).
// Why: XLA:CPU ran the block loop of ``layers.paged_attention`` (page gathers, masks, small einsums, copies) at
// about a third of a SmolLM2 decode step. Here each (row, kv head) is one chunk for the thread pool; it reads each
// key and value once for all of its queries (the heads sharing the kv head, the new tokens). Every query is one
// fixed sequence of operations over the keys it sees, in the order of their positions once accepted (the prefix, then
// the new keys it sees: a chain row's earlier tokens, a tree node's ancestors), so a verified chain row or tree node
// is bitwise the decode step at its position, whatever the rows, tokens or threads beside it
// (tests/test_cpu_attention.py).
// The prefix's scores are taken sixteen keys at a time (``Dot16``: their lane sums reduced together, 3 operations a
// score where one reduction took about 8 in a long chain) with each key's bits as alone (``Dot``): 8 new tokens'
// attention over SmolLM2's 30 layers at a 1000-token context, one thread, 16.4 -> 13.3 ms (fifty-fifth session).
#include <cmath>
#include <limits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace specjax_cpu;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename P>
struct AttnJob {
  const float* q;      // [B, T, N, H]
  const float* k_new;  // [B, Tk, K, H] (unused with keys_in_pool)
  const float* v_new;
  const bool* mask;  // [B, T, Tk]
  const P* k_pool;   // [L, P, K, Z, H]
  const P* v_pool;
  const int32_t* page_table;  // [B, pps]
  const int32_t* lengths;     // [B]
  float* out;                 // [B, T, N, H]
  int64_t batch, tokens, new_keys, heads, kv_heads, head_dim, page_size, pages, pps, layer;
  float scale;
  bool keys_in_pool;
  int64_t parts;  // chunks per (row, kv head), each a run of its queries (a prompt chunk: its token blocks)
};

#if defined(SPECJAX_VEC)
// The sum of a vector's sixteen lanes in one fixed tree (GCC's ``_mm512_reduce_add_ps``, written out so that a
// compiler's own choice cannot change it): t_i = a_i + a_{i+8}, u_i = t_i + t_{i+4}, (u_0 + u_2) + (u_1 + u_3).
inline float ReduceT8(__m256 t) {  // the tree from t
  const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

#if defined(__AVX512F__)
inline float ReduceAdd16(F16 a) {
  return ReduceT8(_mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_castps512_ps256(a)));
}

// ReduceAdd16 of sixteen vectors at once: lane j of the result is ReduceAdd16(a[j]), the same additions (pairs of
// vectors merged per level of the tree, 45 shuffles and adds for 16 sums where one ReduceAdd16 takes about 8 with a
// long dependency chain).
inline F16 ReduceAdd16x16(const F16 (&a)[kLanes]) {
  F16 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)  // lanes 0-7: t of a[2m], 8-15: t of a[2m + 1]
    b[m] = VAdd(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // 128-bit lane k: u of a[4m + k]
    c[m] = VAdd(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)  // 128-bit lane k: (u_0 + u_2, u_1 + u_3) of a[8m + k], then of a[8m + k + 4]
    d[m] = VAdd(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4k + m: the sum of a[k + 4m]; back to lane j: the sum of a[j]
  const F16 r = VAdd(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#elif defined(SPECJAX_VEC)
inline float ReduceAdd16(F16 a) { return ReduceT8(_mm256_add_ps(a.lo, a.hi)); }

// Lane j: ReduceT8(t[j]) for eight vectors t, the same additions merged as the AVX-512 ReduceAdd16x16 merges them.
inline __m256 ReduceT8x8(const __m256 (&t)[8]) {
  __m256 b[4], c[2];
  for (int m = 0; m < 4; ++m)  // 128-bit lane 0: u of t[2m], lane 1: u of t[2m + 1]
    b[m] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // 128-bit lane k: (u_0 + u_2, u_1 + u_3) of t[4m + k], then of t[4m + k + 2]
    c[m] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4k + m: the sum of t[k + 2m]; back to lane j: the sum of t[j]
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline F16 ReduceAdd16x16(const F16 (&a)[kLanes]) {
  __m256 lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    lo[j] = _mm256_add_ps(a[j].lo, a[j].hi);
    hi[j] = _mm256_add_ps(a[j + 8].lo, a[j + 8].hi);
  }
  return {ReduceT8x8(lo), ReduceT8x8(hi)};
}
#endif

// sum_h a[h] * b[h]: sixteen lane sums over the whole vectors, reduced in one fixed order, then the tail.
template <typename P>
inline float Dot(const float* a, const P* b, int64_t h) {
  int64_t i = 0;
  float s = 0.f;
#if defined(SPECJAX_VEC)
  F16 acc = VZero();
  for (; i + kLanes <= h; i += kLanes) acc = VFma(VLoad(a + i), VLoad(b + i), acc);
  s = ReduceAdd16(acc);
#endif
  for (; i < h; ++i) s = __builtin_fmaf(a[i], load(b, i), s);
  return s;
}

#if defined(__AVX512F__)
// Dot(a, row j, h) for sixteen key rows at once into out[0..16], each the same fmas, tree and tail as Dot: row j at
// rows[j], or (``rows`` null) at first + j * h (a page's consecutive positions: one base register for all loads).
// The sixteen keys' sums stay in registers (AVX2 takes ``Dot16Queries``' tiles instead).
template <typename P>
inline void Dot16(const float* a, const P* const* rows, const P* first, int64_t h, float* out) {
  auto row = [&](int j) { return rows ? rows[j] : first + j * h; };
  F16 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = VZero();
  const int64_t whole = h / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    const F16 av = VLoad(a + i);
    for (int j = 0; j < kLanes; ++j) acc[j] = VFma(av, VLoad(row(j) + i), acc[j]);
  }
  VStore(out, ReduceAdd16x16(acc));
  int64_t i = whole;
  for (; i < h; ++i)
    for (int j = 0; j < kLanes; ++j) out[j] = __builtin_fmaf(a[i], load(row(j), i), out[j]);
}
#endif

// acc[h] += w * v[h]
template <typename P>
inline void Axpy(float* __restrict acc, float w, const P* v, int64_t h) {
  int64_t i = 0;
#if defined(SPECJAX_VEC)
  const F16 wv = VSet1(w);
  for (; i + kLanes <= h; i += kLanes)
    VStore(acc + i, VFma(wv, VLoad(v + i), VLoad(acc + i)));
#endif
  for (; i < h; ++i) acc[i] = __builtin_fmaf(w, load(v, i), acc[i]);
}

// exp(x) for x <= 0 (-inf gives 0), elementwise over n values in place: a degree-6 polynomial after the reduction
// x = k ln2 + r, the same bits for a value whatever its neighbours.
inline void ExpInPlace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(SPECJAX_VEC)
  const F16 lo = VSet1(-87.3f), log2e = VSet1(1.44269504088896341f);
  const F16 ln2_hi = VSet1(0.693359375f), ln2_lo = VSet1(-2.12194440e-4f);
  for (; i + kLanes <= n; i += kLanes) {
    F16 v = VLoad(x + i);
    const unsigned gone = VLtMask(v, lo);
    v = VMax(v, lo);
    const F16 k = VRoundNearest(VMul(v, log2e));
    F16 r = VFnma(k, ln2_hi, v);
    r = VFnma(k, ln2_lo, r);
    F16 p = VSet1(1.9875691500e-4f);
    p = VFma(p, r, VSet1(1.3981999507e-3f));
    p = VFma(p, r, VSet1(8.3334519073e-3f));
    p = VFma(p, r, VSet1(4.1665795894e-2f));
    p = VFma(p, r, VSet1(1.6666665459e-1f));
    p = VFma(p, r, VSet1(5.0000001201e-1f));
    p = VFma(VMul(p, r), r, VAdd(r, VSet1(1.f)));
    p = VScale2(p, k);
    VStore(x + i, VZeroWhere(p, gone));
  }
#endif
  for (; i < n; ++i) x[i] = x[i] < -87.3f ? 0.f : std::exp(x[i]);
}

// Pool rows are prefetched this many keys ahead: a row's page comes from the page table, where the hardware
// prefetchers do not follow. Rows at or past ``fresh_from`` are the new keys' float32 rows, not pool rows.
constexpr int64_t kAhead = 8;

template <typename P>
inline void PrefetchRow(const void* const* rows, int64_t s, int64_t keys, int64_t fresh_from, int64_t H) {
  if (s < keys && s < fresh_from && rows[s])
    for (int64_t off = 0; off < H * static_cast<int64_t>(sizeof(P)); off += 64) PrefetchAhead<3>(rows[s], off);
}

// acc[i, :] += w[i, s] * v_s for every key s in order (rows[s] null: skipped; s >= fresh_from: a float32 row, else
// a pool row; a zero weight skipped), for the nq queries: each query the same fma sequence as Axpy over its keys.
// With AVX-512 and a head dim of 64 or 128 the sums of a few queries stay in registers for a pass over the rows;
// with AVX2, three queries' sums over 32 columns at a time.
#if defined(SPECJAX_VEC)
// Whether none of the n weights of any of the q rows of w (row stride ``stride``) is zero.
inline bool NoZeroWeights(const float* w, int64_t stride, int q, int64_t n) {
  const F16 zero = VZero();
  for (int r = 0; r < q; ++r) {
    const float* row = w + r * stride;
    int64_t s = 0;
    for (; s + kLanes <= n; s += kLanes)
      if (VEqMask(VLoad(row + s), zero)) return false;
    for (; s < n; ++s)
      if (row[s] == 0.f) return false;
  }
  return true;
}

// The keys before ``seen_by_all`` are pool rows that every query sees (the prefix); where none of a pass's queries
// weighs one of them zero, they take a loop without the null rows' and zero weights' tests (the same fmas). The keys
// are taken kWeighBlock at a time (their rows stay in L1) by every pass of QG queries, each pass's sums reloaded
// from acc per block, where a pass over all the keys per QG queries read 8 tokens' 24 queries' values six times
// from L2 (SmolLM2's 30 layers at 8 tokens and a 1000-token context, one thread: 13.3 against 13.8 ms).
constexpr int64_t kWeighBlock = 64;
#if defined(__AVX512F__)
template <typename P, int HV>
void WeighValuesInRegisters(const float* w, int64_t stride, int64_t nq, const void* const* rows, int64_t fresh_from,
                            int64_t keys, int64_t seen_by_all, float* acc) {
  constexpr int QG = 16 / HV;  // queries per pass: QG x HV sums in 16 of AVX-512's 32 registers
  constexpr int64_t H = HV * kLanes;
  thread_local std::vector<char> dense;  // per pass: whether the prefix takes the loop without tests
  dense.assign((nq + QG - 1) / QG, 0);
  for (int64_t i = 0; i < nq; i += QG)
    dense[i / QG] = nq - i >= QG && NoZeroWeights(w + i * stride, stride, QG, seen_by_all);
  for (int64_t b0 = 0; b0 < keys; b0 += kWeighBlock) {
    const int64_t b1 = std::min(keys, b0 + kWeighBlock);
    for (int64_t i = 0; i < nq; i += QG) {
      const int64_t qn = std::min<int64_t>(QG, nq - i);
      const float* wq = w + i * stride;
      F16 a[QG][HV];
      for (int q = 0; q < QG; ++q)
        for (int h = 0; h < HV; ++h)
          a[q][h] = q < qn && b0 > 0 ? VLoad(acc + (i + q) * H + h * kLanes) : VZero();
      int64_t s = b0;
      if (dense[i / QG]) {
        for (; s < std::min(b1, seen_by_all); ++s) {
          if (i == 0) PrefetchRow<P>(rows, s + kAhead, keys, fresh_from, H);
          const P* row = static_cast<const P*>(rows[s]);
          F16 v[HV];
          for (int h = 0; h < HV; ++h) v[h] = VLoad(row + h * kLanes);
          for (int q = 0; q < QG; ++q) {
            const F16 wv = VSet1(wq[q * stride + s]);
            for (int h = 0; h < HV; ++h) a[q][h] = VFma(wv, v[h], a[q][h]);
          }
        }
      }
      for (; s < b1; ++s) {
        if (!rows[s]) continue;
        if (i == 0) PrefetchRow<P>(rows, s + kAhead, keys, fresh_from, H);
        F16 v[HV];
        for (int h = 0; h < HV; ++h)
          v[h] = s >= fresh_from ? VLoad(static_cast<const float*>(rows[s]) + h * kLanes)
                          : VLoad(static_cast<const P*>(rows[s]) + h * kLanes);
        for (int q = 0; q < QG; ++q) {
          if (q >= qn) break;
          const float ws = wq[q * stride + s];
          if (ws == 0.f) continue;
          const F16 wv = VSet1(ws);
          for (int h = 0; h < HV; ++h) a[q][h] = VFma(wv, v[h], a[q][h]);
        }
      }
      for (int q = 0; q < qn; ++q)
        for (int h = 0; h < HV; ++h) VStore(acc + (i + q) * H + h * kLanes, a[q][h]);
    }
  }
}
#else
// AVX2: QG queries' sums over CW of the value row's 8-lane columns stay in registers (12 of its 16) for a pass over
// a block of keys, each value column loaded once for the QG queries where one query's whole row took them all. A
// sum is the same fmas in the same order of keys as Axpy's, so the same bits.
template <typename P, int QG, int CW>
void WeighValuesTiled(const float* w, int64_t stride, int64_t nq, const void* const* rows, int64_t fresh_from,
                      int64_t keys, int64_t seen_by_all, int64_t H, float* acc) {
  thread_local std::vector<char> dense;  // per pass: whether the prefix takes the loop without tests
  dense.assign((nq + QG - 1) / QG, 0);
  for (int64_t i = 0; i < nq; i += QG)  // a last group of fewer queries takes the loop with tests
    dense[i / QG] = nq - i >= QG && NoZeroWeights(w + i * stride, stride, QG, seen_by_all);
  for (int64_t b0 = 0; b0 < keys; b0 += kWeighBlock) {
    const int64_t b1 = std::min(keys, b0 + kWeighBlock);
    for (int64_t i = 0; i < nq; i += QG) {
      const int qn = static_cast<int>(std::min<int64_t>(QG, nq - i));
      const float* wq = w + i * stride;
      for (int64_t c0 = 0; c0 < H; c0 += CW * 8) {
        const bool first = i == 0 && c0 == 0;
        __m256 a[QG][CW];
        for (int q = 0; q < QG; ++q)
          for (int c = 0; c < CW; ++c)
            a[q][c] = q < qn && b0 > 0 ? _mm256_loadu_ps(acc + (i + q) * H + c0 + c * 8) : _mm256_setzero_ps();
        int64_t s = b0;
        if (dense[i / QG]) {
          for (; s < std::min(b1, seen_by_all); ++s) {
            if (first) PrefetchRow<P>(rows, s + kAhead, keys, fresh_from, H);
            const P* row = static_cast<const P*>(rows[s]) + c0;
            __m256 wv[QG];
            for (int q = 0; q < QG; ++q) wv[q] = _mm256_set1_ps(wq[q * stride + s]);
            for (int c = 0; c < CW; ++c) {
              const __m256 v = Load8(row + c * 8);
              for (int q = 0; q < QG; ++q) a[q][c] = _mm256_fmadd_ps(wv[q], v, a[q][c]);
            }
          }
        }
        for (; s < b1; ++s) {
          if (!rows[s]) continue;
          if (first) PrefetchRow<P>(rows, s + kAhead, keys, fresh_from, H);
          for (int c = 0; c < CW; ++c) {
            const __m256 v = s >= fresh_from ? Load8(static_cast<const float*>(rows[s]) + c0 + c * 8)
                                             : Load8(static_cast<const P*>(rows[s]) + c0 + c * 8);
            for (int q = 0; q < qn; ++q) {
              const float ws = wq[q * stride + s];
              if (ws != 0.f) a[q][c] = _mm256_fmadd_ps(_mm256_set1_ps(ws), v, a[q][c]);
            }
          }
        }
        for (int q = 0; q < qn; ++q)
          for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + (i + q) * H + c0 + c * 8, a[q][c]);
      }
    }
  }
}
#endif  // __AVX512F__
#endif  // SPECJAX_VEC

template <typename P>
void WeighValues(const float* w, int64_t stride, int64_t nq, const void* const* rows, int64_t fresh_from,
                 int64_t keys, int64_t seen_by_all, int64_t H, float* acc) {
  for (int64_t s = 0; s < kAhead; ++s) PrefetchRow<P>(rows, s, keys, fresh_from, H);
#if defined(SPECJAX_VEC) && !defined(__AVX512F__)
  if (H % 32 == 0) return WeighValuesTiled<P, 3, 4>(w, stride, nq, rows, fresh_from, keys, seen_by_all, H, acc);
#elif defined(SPECJAX_VEC)
  if (H == 64) return WeighValuesInRegisters<P, 4>(w, stride, nq, rows, fresh_from, keys, seen_by_all, acc);
  if (H == 128) return WeighValuesInRegisters<P, 8>(w, stride, nq, rows, fresh_from, keys, seen_by_all, acc);
#endif
  for (int64_t s = 0; s < keys; ++s) {
    PrefetchRow<P>(rows, s + kAhead, keys, fresh_from, H);
    if (!rows[s]) continue;
    for (int64_t i = 0; i < nq; ++i) {
      const float ws = w[i * stride + s];
      if (ws == 0.f) continue;
      if (s >= fresh_from) Axpy(&acc[i * H], ws, static_cast<const float*>(rows[s]), H);
      else Axpy(&acc[i * H], ws, static_cast<const P*>(rows[s]), H);
    }
  }
}

// One query's scores (-inf where unseen, the row padded with -inf to ``stride``, whole vectors) -> exp(score - max)
// in place; returns their sum (0, and all weights 0, when the query sees nothing). The sum is sixteen lane sums
// added in one fixed tree, each key in the lane of its position among the keys the query sees: the prefix's keys
// (every one seen, s < prefix) in lane s % 16, then the new keys it sees in order, where a decode step finds them
// once they are accepted (a tree node's ancestors, whatever their indices in the tree, right after the prefix). So
// a verified chain row's and a tree node's sums are the decode step's at their positions.
inline float SoftmaxWeights(float* row, int64_t stride, int64_t prefix) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kNegInf);
  for (int64_t s = 0; s < stride; s += kLanes)  // the maximum (exact in any order)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], row[s + l]);
  const float m = *std::max_element(lanes, lanes + kLanes);
  if (m == kNegInf) {
    std::fill(row, row + stride, 0.f);
    return 0.f;
  }
  const int64_t whole = prefix / kLanes * kLanes;  // the prefix's whole vectors: every key there is seen
  thread_local std::vector<char> seen;
  seen.resize(stride - whole);
  for (int64_t s = whole; s < stride; ++s) seen[s - whole] = row[s] != kNegInf;
  for (int64_t s = 0; s < stride; ++s) row[s] -= m;
  ExpInPlace(row, stride);
  std::fill(lanes, lanes + kLanes, 0.f);
  for (int64_t s = 0; s < whole; s += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += row[s + l];
  for (int64_t s = whole, pos = whole; s < stride; ++s)
    if (seen[s - whole]) lanes[pos++ % kLanes] += row[s];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// The row of position p of row b, kv head kh in a pool (its page from the page table, clamped to the pool).
template <typename P>
inline const P* PoolRow(const AttnJob<P>& j, const P* pool, int64_t b, int64_t kh, int64_t p) {
  const int64_t Z = j.page_size;
  const int64_t page = std::clamp<int64_t>(j.page_table[b * j.pps + p / Z], 0, j.pages - 1);
  return pool + (((j.layer * j.pages + page) * j.kv_heads + kh) * Z + p % Z) * j.head_dim;
}

// The prefix positions row b's queries see: its length, but positions past the page table (a released slot's stale
// length) are not seen, as on the XLA path.
template <typename P>
inline int64_t SeenPrefix(const AttnJob<P>& j, int64_t b) {
  return std::clamp<int64_t>(j.lengths[b], 0, j.pps * j.page_size);
}

// The K and V rows of the prefix's positions of row b, kv head kh (``PoolRow``), found page by page: one page-table
// lookup a page, the page's next positions its next rows.
template <typename P>
void PrefixRows(const AttnJob<P>& j, int64_t b, int64_t kh, int64_t prefix, const void** krows, const void** vrows) {
  const int64_t Z = j.page_size, H = j.head_dim;
  for (int64_t s = 0; s < prefix;) {
    const P* k = PoolRow(j, j.k_pool, b, kh, s);
    const P* v = PoolRow(j, j.v_pool, b, kh, s);
    for (const int64_t end = std::min(prefix, (s / Z + 1) * Z); s < end; ++s, k += H, v += H) {
      krows[s] = k;
      vrows[s] = v;
    }
  }
}

#if defined(SPECJAX_VEC) && !defined(__AVX512F__)
// AVX2 (16 registers of 8 lanes): AVX-512's tiles of F16 sums spilled to the stack at every fma there (cut to four
// keys, the sixty-first session: one token 26 -> 21 ns a score, six tokens 15 -> 9.5, SmolLM2's 30 layers at a
// 1000-token context, two threads). Here a tile of QT queries x KT keys keeps one half (lanes 0-7 or 8-15) of its
// F16 sums in registers at a time, each query and key half loaded once per step, where one query's four keys
// loaded every key half for each query. Each sum is the same fma sequence as Dot16's (Dot's), so the same bits.
template <typename P, int QT, int KT>
inline void ScoreTile(const float* const* qs, const P* const* rows, int64_t whole, F16 (*sums)[kLanes], int j0) {
  for (int half = 0; half < 2; ++half) {
    __m256 s[QT][KT];
    for (int q = 0; q < QT; ++q)
      for (int k = 0; k < KT; ++k) s[q][k] = _mm256_setzero_ps();
    for (int64_t i = half * 8; i < whole; i += kLanes) {
      __m256 qv[QT];
      for (int q = 0; q < QT; ++q) qv[q] = _mm256_loadu_ps(qs[q] + i);
      for (int k = 0; k < KT; ++k) {
        const __m256 kv = Load8(rows[k] + i);
        for (int q = 0; q < QT; ++q) s[q][k] = _mm256_fmadd_ps(qv[q], kv, s[q][k]);
      }
    }
    for (int q = 0; q < QT; ++q)
      for (int k = 0; k < KT; ++k) (half ? sums[q][j0 + k].hi : sums[q][j0 + k].lo) = s[q][k];
  }
}

// Dot16 for QT queries q + i * H at once (their rows of ``scores`` from ``out``, row stride ``stride``).
template <typename P, int QT>
inline void Dot16Queries(const float* q, const P* const* rows, int64_t h, float* out, int64_t stride) {
  constexpr int KT = 4;
  const int64_t whole = h / kLanes * kLanes;
  const float* qs[QT];
  for (int i = 0; i < QT; ++i) qs[i] = q + i * h;
  F16 sums[QT][kLanes];
  for (int j0 = 0; j0 < kLanes; j0 += KT) ScoreTile<P, QT, KT>(qs, rows + j0, whole, sums, j0);
  for (int i = 0; i < QT; ++i) {
    float* o = out + i * stride;
    VStore(o, ReduceAdd16x16(sums[i]));
    for (int64_t c = whole; c < h; ++c)
      for (int j = 0; j < kLanes; ++j) o[j] = __builtin_fmaf(qs[i][c], load(rows[j], c), o[j]);
  }
}
#endif

// scores[i, s] = Dot(q_i, k_s) * scale for the nq queries (q [nq, H]) and the prefix's keys (pool rows krows[s], seen
// by every query) sixteen at a time (``Dot16``, one base pointer where the sixteen rows are a page's consecutive
// ones; on AVX2 ``Dot16Queries``, three queries at a time); returns the first key left to score one at a time.
template <typename P>
int64_t ScorePrefix(const float* q, int64_t nq, int64_t H, const void* const* krows, int64_t prefix, int64_t keys,
                    float scale, float* scores, int64_t stride) {
  int64_t s0 = 0;
#if defined(SPECJAX_VEC)
  for (; s0 + kLanes <= prefix; s0 += kLanes) {
    for (int64_t s = s0 + kLanes; s < s0 + 2 * kLanes; ++s) PrefetchRow<P>(krows, s, keys, prefix, H);
    const P* const* rows = reinterpret_cast<const P* const*>(krows + s0);
#if defined(__AVX512F__)
    const P* first = rows[0];
    bool consecutive = true;
    for (int r = 1; r < kLanes; ++r) consecutive = consecutive && rows[r] == first + r * H;
    for (int64_t i = 0; i < nq; ++i) {
      if (consecutive) Dot16<P>(q + i * H, nullptr, first, H, scores + i * stride + s0);
      else Dot16<P>(q + i * H, rows, nullptr, H, scores + i * stride + s0);
    }
#else
    int64_t i = 0;
    for (; i + 3 <= nq; i += 3) Dot16Queries<P, 3>(q + i * H, rows, H, scores + i * stride + s0, stride);
    if (nq - i == 2) Dot16Queries<P, 2>(q + i * H, rows, H, scores + i * stride + s0, stride);
    if (nq - i == 1) Dot16Queries<P, 1>(q + i * H, rows, H, scores + i * stride + s0, stride);
#endif
    for (int64_t i = 0; i < nq; ++i) {
      float* row = scores + i * stride + s0;
      VStore(row, VMul(VLoad(row), VSet1(scale)));
    }
  }
#endif
  return s0;
}

// One run of the queries of a (row, kv head): its tokens x the query heads sharing the kv head, [t, g] in order.
template <typename P>
void AttnChunk(const void* ctx, int chunk) {
  const auto& j = *static_cast<const AttnJob<P>*>(ctx);
  const int64_t K = j.kv_heads, H = j.head_dim, T = j.tokens, Tk = j.new_keys, N = j.heads, G = N / K;
  const int64_t Z = j.page_size;
  const int64_t b = chunk / (K * j.parts), kh = chunk / j.parts % K, part = chunk % j.parts;
  const int64_t i0 = T * G * part / j.parts, i1 = T * G * (part + 1) / j.parts;  // this chunk's queries
  const int64_t cap = j.pps * Z, len = j.lengths[b], prefix = SeenPrefix(j, b);
  const int64_t keys = prefix + Tk;  // candidate keys: the prefix, then the new ones
  const int64_t stride = (keys + kLanes - 1) / kLanes * kLanes;  // a score row, whole vectors
  const int64_t nq = i1 - i0, t0 = i0 / G, t1 = (i1 - 1) / G + 1;  // its tokens [t0, t1)
  thread_local std::vector<float> scores, acc, qbuf;
  scores.assign(nq * stride, kNegInf);
  acc.assign(nq * H, 0.f);
  qbuf.resize(nq * H);
  for (int64_t i = 0; i < nq; ++i)  // query i0 + i = (t, g)
    std::memcpy(&qbuf[i * H], j.q + ((b * T + (i0 + i) / G) * N + kh * G + (i0 + i) % G) * H, H * sizeof(float));
  const bool* mask = j.mask + b * T * Tk;
  auto in_table = [&](int64_t s) {  // a new key stored in the pool has a slot there
    const int64_t p = len + (s - prefix);
    return !j.keys_in_pool || (p >= 0 && p < cap);
  };
  auto sees = [&](int64_t t, int64_t s) { return s < prefix || (mask[t * Tk + (s - prefix)] && in_table(s)); };
  auto key_of = [&](const P* pool, const float* fresh, int64_t s) -> const void* {  // a new key's row
    if (!j.keys_in_pool) return fresh + ((b * Tk + (s - prefix)) * K + kh) * H;
    return PoolRow(j, pool, b, kh, len + (s - prefix));
  };
  auto visible_to_any = [&](int64_t s) {
    if (s < prefix) return true;
    if (!in_table(s)) return false;
    for (int64_t t = t0; t < t1; ++t)
      if (mask[t * Tk + (s - prefix)]) return true;
    return false;
  };
  // Each key's K and V rows (null where no query of this chunk sees it), found once: a row's page comes from the
  // page table. The new keys' rows are float32 ones of k_new / v_new unless they were written to the pool.
  const int64_t fresh_from = j.keys_in_pool ? keys : prefix;
  thread_local std::vector<const void*> krows, vrows;
  krows.assign(keys, nullptr);
  vrows.assign(keys, nullptr);
  PrefixRows(j, b, kh, prefix, krows.data(), vrows.data());
  for (int64_t s = prefix; s < keys; ++s) {
    if (!visible_to_any(s)) continue;
    krows[s] = key_of(j.k_pool, j.k_new, s);
    vrows[s] = key_of(j.v_pool, j.v_new, s);
  }
  const int64_t s0 = ScorePrefix<P>(qbuf.data(), nq, H, krows.data(), prefix, keys, j.scale, scores.data(), stride);
  for (int64_t s = s0; s < keys; ++s) {  // the other scores, one key at a time for all queries
    PrefetchRow<P>(krows.data(), s + kAhead, keys, fresh_from, H);
    if (!krows[s]) continue;
    for (int64_t i = 0; i < nq; ++i) {
      if (!sees((i0 + i) / G, s)) continue;
      const float* qv = &qbuf[i * H];
      const float d = s >= fresh_from ? Dot(qv, static_cast<const float*>(krows[s]), H)
                                  : Dot(qv, static_cast<const P*>(krows[s]), H);
      scores[i * stride + s] = d * j.scale;
    }
  }
  thread_local std::vector<float> total;
  total.resize(nq);
  for (int64_t i = 0; i < nq; ++i) total[i] = SoftmaxWeights(&scores[i * stride], stride, prefix);
  WeighValues<P>(scores.data(), stride, nq, vrows.data(), fresh_from, keys, prefix, H, acc.data());
  for (int64_t i = 0; i < nq; ++i) {  // a query that sees nothing gives 0
    float* o = j.out + ((b * T + (i0 + i) / G) * N + kh * G + (i0 + i) % G) * H;
    const float t = total[i];
    if (t > 0.f)
      for (int64_t h = 0; h < H; ++h) o[h] = acc[i * H + h] / t;
    else
      std::fill(o, o + H, 0.f);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A prompt chunk (more new tokens than a tree: ``kPromptTokens`` and up, keys read from k_new / v_new): the chunk's
// scores as products of blocks, flash attention's way. Its keys and values are first laid out in float32 blocks of
// ``kKeyBlock`` positions per (row, kv head), keys as [H, kKeyBlock] and values as [kKeyBlock, H] (``PromptKeys``).
// Then each work item, ``kQueryTokens`` tokens of one (row, kv head) whose rows are the tokens x the query heads
// sharing the kv head, walks the key blocks it may see (the prefix's positions, then the new ones) with an online
// softmax (running maximum and sum) across blocks: a score tile is rows x 16 keys in registers fed by broadcasts of
// the queries (no lane reductions), a value tile rows x 16 columns. A block of new keys that none of the item's
// tokens sees (a causal mask's upper triangle) is skipped. The few-token path above reduces each score across lanes
// and lays out nothing, which suits a few tokens over a long prefix, not 512 x 1024 blocks; for a prompt chunk XLA's
// block loop ran at about 30 GFLOP/s against its products' 81 (SmolLM2, a 512-token chunk after 512 cached tokens,
// two threads: 0.95 s for the 30 layers, 0.47 s here; docs/benchmarks.md, sixty-fifth session).
constexpr int64_t kPromptTokens = 16;
constexpr int64_t kQueryTokens = 16;
constexpr int64_t kKeyBlock = 64;
static_assert(kKeyBlock % 16 == 0 && kKeyBlock <= 64, "a block's unseen keys are the bits of one uint64_t");
// rows of a score / value tile: their F16 sums and one key's (column's) vector in 15 of AVX2's 16 registers
constexpr int kTileRows = kVectorBits == 512 ? 12 : 6;

// s[r, c] = scale * sum_h q[r, h] * kt[h, c] for TR rows and the 16 keys at kt (row stride kKeyBlock).
template <int TR>
inline void ScoreRowTile(const float* q, int64_t H, const float* kt, float scale, float* s) {
#if defined(SPECJAX_VEC)
  F16 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = VZero();
  for (int64_t h = 0; h < H; ++h) {
    const F16 k = VLoad(kt + h * kKeyBlock);
    for (int r = 0; r < TR; ++r) acc[r] = VFma(VSet1(q[r * H + h]), k, acc[r]);
  }
  for (int r = 0; r < TR; ++r) VStore(s + r * kKeyBlock, VMul(acc[r], VSet1(scale)));
#else
  for (int r = 0; r < TR; ++r)
    for (int c = 0; c < kLanes; ++c) {
      float a = 0.f;
      for (int64_t h = 0; h < H; ++h) a = __builtin_fmaf(q[r * H + h], kt[h * kKeyBlock + c], a);
      s[r * kKeyBlock + c] = a * scale;
    }
#endif
}

// o[r, c] += sum_{s < n} w[r, s] * v[s, c] for TR rows and the 16 columns at o, v (row strides H).
template <int TR>
inline void WeighRowTile(const float* w, const float* v, int64_t n, int64_t H, float* o) {
#if defined(SPECJAX_VEC)
  F16 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = VLoad(o + r * H);
  for (int64_t s = 0; s < n; ++s) {
    const F16 x = VLoad(v + s * H);
    for (int r = 0; r < TR; ++r) acc[r] = VFma(VSet1(w[r * kKeyBlock + s]), x, acc[r]);
  }
  for (int r = 0; r < TR; ++r) VStore(o + r * H, acc[r]);
#else
  for (int r = 0; r < TR; ++r)
    for (int c = 0; c < kLanes; ++c)
      for (int64_t s = 0; s < n; ++s) o[r * H + c] = __builtin_fmaf(w[r * kKeyBlock + s], v[s * H + c], o[r * H + c]);
#endif
}

// Rows [r0, r0 + TR) of a block: their scores over the block's keys, or their weights' sums over its values.
template <int TR>
void BlockRows(bool score, const float* q, const float* kt, const float* v, float* s, float* o, int64_t r0, int64_t n,
               int64_t H, float scale) {
  const int64_t whole = H / kLanes * kLanes;
  if (score) {  // the keys past n: whatever the softmax's mask overwrites
    for (int64_t c = 0; c < n; c += kLanes)
      ScoreRowTile<TR>(q + r0 * H, H, kt + c, scale, s + r0 * kKeyBlock + c);
    return;
  }
  for (int64_t c = 0; c < whole; c += kLanes) WeighRowTile<TR>(s + r0 * kKeyBlock, v + c, n, H, o + r0 * H + c);
  for (int64_t r = r0; r < r0 + TR; ++r)  // columns past the whole vectors
    for (int64_t c = whole; c < H; ++c)
      for (int64_t k = 0; k < n; ++k) o[r * H + c] = __builtin_fmaf(s[r * kKeyBlock + k], v[k * H + c], o[r * H + c]);
}

// BlockRows over rows [0, R): tiles of kTileRows, then the rest one tile.
template <int TR = kTileRows>
void AllRows(bool score, const float* q, const float* kt, const float* v, float* s, float* o, int64_t R, int64_t n,
             int64_t H, float scale, int64_t r0 = 0) {
  if constexpr (TR > 0) {
    for (; r0 + TR <= R; r0 += TR) BlockRows<TR>(score, q, kt, v, s, o, r0, n, H, scale);
    if (r0 < R) AllRows<TR - 1>(score, q, kt, v, s, o, R, n, H, scale, r0);
  }
}

// The online-softmax step of one row over a block's scores (``unseen``: bit c set where key c is not seen): the
// running maximum ``m`` and sum ``l`` updated, the scores turned into weights exp(score - m) in place (0 where
// unseen), the row's output so far rescaled.
inline void OnlineSoftmaxRow(float* s, uint64_t unseen, float& m, float& l, float* o, int64_t H) {
  float bm = kNegInf;
#if defined(SPECJAX_VEC)
  F16 top = VSet1(kNegInf);
  for (int64_t c = 0; c < kKeyBlock; c += kLanes) {
    const F16 x = VSetWhere(VLoad(s + c), static_cast<unsigned>(unseen >> c) & 0xffffu, kNegInf);
    VStore(s + c, x);
    top = VMax(top, x);
  }
  bm = VMaxLanes(top);
#else
  for (int64_t c = 0; c < kKeyBlock; ++c) {
    if (unseen >> c & 1) s[c] = kNegInf;
    bm = std::max(bm, s[c]);
  }
#endif
  const float m_new = std::max(m, bm);
  if (m_new == kNegInf) {  // nothing seen yet
    std::fill(s, s + kKeyBlock, 0.f);
    return;
  }
  for (int64_t c = 0; c < kKeyBlock; ++c) s[c] -= m_new;
  ExpInPlace(s, kKeyBlock);
  float sum = 0.f;
#if defined(SPECJAX_VEC)
  F16 lanes = VZero();
  for (int64_t c = 0; c < kKeyBlock; c += kLanes) lanes = VAdd(lanes, VLoad(s + c));
  sum = ReduceAdd16(lanes);
#else
  for (int64_t c = 0; c < kKeyBlock; ++c) sum += s[c];
#endif
  if (m_new != m) {
    float alpha = m - m_new;
    ExpInPlace(&alpha, 1);
    l *= alpha;
    for (int64_t h = 0; h < H; ++h) o[h] *= alpha;
    m = m_new;
  }
  l += sum;
}

// A prompt chunk's job: its keys and values laid out once per (row, kv head) by ``PromptKeys`` (float32 blocks of
// kKeyBlock positions: keys [H, kKeyBlock], values [kKeyBlock, H]), then read by every token block's ``PromptChunk``.
template <typename P>
struct PromptJob {
  const AttnJob<P>* a;
  float* kt;           // [B * K, key_blocks, H, kKeyBlock]
  float* v;            // [B * K, key_blocks, kKeyBlock, H]
  int64_t key_blocks;  // per (row, kv head): the longest row's prefix and the new keys
};

// Bit c set where row[c] is false, for c < n <= 64.
inline uint64_t FalseBits(const bool* row, int64_t n) {
  uint64_t bits = 0;
  int64_t c = 0;
#if defined(SPECJAX_VEC)
  for (; c + 16 <= n; c += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    bits |= static_cast<uint64_t>(static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_setzero_si128()))))
            << c;
  }
#endif
  for (; c < n; ++c) bits |= uint64_t{!row[c]} << c;
  return bits;
}

// One past the last true entry of row[0, n) (0 where none is).
inline int64_t SeenTo(const bool* row, int64_t n) {
#if defined(SPECJAX_VEC)
  for (; n >= 16; n -= 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + n - 16));
    const unsigned set = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_setzero_si128()))) & 0xffffu;
    if (set) return n - 16 + (31 - __builtin_clz(set)) + 1;
  }
#endif
  for (; n > 0; --n)
    if (row[n - 1]) return n;
  return 0;
}

// Chunk (pair, block): the block of positions [kb * kKeyBlock, ...) of a (row, kv head) laid out as float32.
template <typename P>
void PromptKeys(const void* ctx, int chunk) {
  const auto& pj = *static_cast<const PromptJob<P>*>(ctx);
  const auto& j = *pj.a;
  const int64_t K = j.kv_heads, H = j.head_dim, Tk = j.new_keys;
  const int64_t pair = chunk / pj.key_blocks, b = pair / K, kh = pair % K, p0 = chunk % pj.key_blocks * kKeyBlock;
  const int64_t prefix = SeenPrefix(j, b), n = std::min(kKeyBlock, prefix + Tk - p0);
  if (n <= 0) return;
  float* kt = pj.kt + chunk * H * kKeyBlock;
  float* v = pj.v + chunk * kKeyBlock * H;
  for (int64_t c = 0; c < kKeyBlock; ++c) {
    const int64_t p = p0 + c;
    if (c >= n) {
      for (int64_t h = 0; h < H; ++h) kt[h * kKeyBlock + c] = 0.f;
    } else if (p < prefix) {
      const P* kr = PoolRow(j, j.k_pool, b, kh, p);
      const P* vr = PoolRow(j, j.v_pool, b, kh, p);
      for (int64_t h = 0; h < H; ++h) kt[h * kKeyBlock + c] = load(kr, h);
      for (int64_t h = 0; h < H; ++h) v[c * H + h] = load(vr, h);
    } else {
      const int64_t at = ((b * Tk + p - prefix) * K + kh) * H;
      for (int64_t h = 0; h < H; ++h) kt[h * kKeyBlock + c] = j.k_new[at + h];
      std::memcpy(&v[c * H], j.v_new + at, H * sizeof(float));
    }
  }
}

// Chunk (token block, pair): its rows' attention, the last token blocks (the most keys under a causal mask) first,
// so that the threads end together.
template <typename P>
void PromptChunk(const void* ctx, int chunk) {
  const auto& pj = *static_cast<const PromptJob<P>*>(ctx);
  const auto& j = *pj.a;
  const int64_t K = j.kv_heads, H = j.head_dim, T = j.tokens, Tk = j.new_keys, N = j.heads, G = N / K;
  const int64_t pairs = j.batch * K, pair = chunk % pairs, b = pair / K, kh = pair % K;
  const int64_t t0 = (j.parts - 1 - chunk / pairs) * kQueryTokens, t1 = std::min(T, t0 + kQueryTokens);
  const int64_t R = (t1 - t0) * G, prefix = SeenPrefix(j, b);
  const bool* mask = j.mask + b * T * Tk;
  thread_local std::vector<float> q, s, o, m, l;
  uint64_t unseen[kQueryTokens];
  q.resize(R * H); s.resize(R * kKeyBlock);
  o.assign(R * H, 0.f); m.assign(R, kNegInf); l.assign(R, 0.f);
  for (int64_t r = 0; r < R; ++r)  // row r: token t0 + r / G, head kh * G + r % G
    std::memcpy(&q[r * H], j.q + ((b * T + t0 + r / G) * N + kh * G + r % G) * H, H * sizeof(float));
  int64_t seen_to = 0;  // the new keys past the last one any of these tokens sees are never read
  for (int64_t t = t0; t < t1; ++t) seen_to = std::max(seen_to, SeenTo(mask + t * Tk, Tk));
  const int64_t end = prefix + seen_to;
  for (int64_t p0 = 0; p0 < end; p0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - p0);
    bool any = false;
    for (int64_t t = t0; t < t1; ++t) {  // bit c: key p0 + c unseen by token t
      uint64_t bits = n == kKeyBlock ? 0 : ~uint64_t{0} << n;
      const int64_t cp = std::max<int64_t>(prefix - p0, 0);  // the prefix's keys: seen
      if (cp < n) bits |= FalseBits(mask + t * Tk + p0 + cp - prefix, n - cp) << cp;
      unseen[t - t0] = bits;
      any = any || ~bits != 0;
    }
    if (!any) continue;  // a block of new keys none of these tokens sees
    const int64_t blk = pair * pj.key_blocks + p0 / kKeyBlock;
    const float* kt = pj.kt + blk * H * kKeyBlock;
    const float* v = pj.v + blk * kKeyBlock * H;
    AllRows(true, q.data(), kt, v, s.data(), o.data(), R, n, H, j.scale);
    for (int64_t r = 0; r < R; ++r) OnlineSoftmaxRow(&s[r * kKeyBlock], unseen[r / G], m[r], l[r], &o[r * H], H);
    AllRows(false, q.data(), kt, v, s.data(), o.data(), R, n, H, j.scale);
  }
  for (int64_t r = 0; r < R; ++r) {  // a query that sees nothing gives 0
    float* out = j.out + ((b * T + t0 + r / G) * N + kh * G + r % G) * H;
    if (l[r] > 0.f)
      for (int64_t h = 0; h < H; ++h) out[h] = o[r * H + h] / l[r];
    else
      std::fill(out, out + H, 0.f);
  }
}

// The blocked path over a prompt chunk: its keys laid out, then its token blocks.
template <typename P>
void PromptAttention(const AttnJob<P>& j) {
  int64_t longest = 0;
  for (int64_t b = 0; b < j.batch; ++b) longest = std::max(longest, SeenPrefix(j, b));
  const int64_t key_blocks = (longest + j.new_keys + kKeyBlock - 1) / kKeyBlock;
  const int64_t blocks = j.batch * j.kv_heads * key_blocks;
  thread_local std::vector<float> kt, v;
  kt.resize(blocks * j.head_dim * kKeyBlock);
  v.resize(blocks * kKeyBlock * j.head_dim);
  const PromptJob<P> pj{&j, kt.data(), v.data(), key_blocks};
  Parallel(PromptKeys<P>, &pj, static_cast<int>(blocks));
  Parallel(PromptChunk<P>, &pj, static_cast<int>(j.batch * j.kv_heads * j.parts));
}

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::PRED> mask,
                         ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> page_table,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer, float sm_scale,
                         int64_t keys_in_pool, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k_new.dimensions(), pd = k_pool.dimensions(), td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v_new.dimensions().size() != 4 || pd.size() != 5 || td.size() != 2 ||
      mask.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("specjax cpu attention: q, k_new [B, T, *, H], pools [L, P, K, R, W]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], Tk = kd[1], K = kd[2];
  auto md = mask.dimensions(), vd = v_new.dimensions();
  if (!FloatType(q.element_type()) || k_new.element_type() != q.element_type() ||
      v_new.element_type() != q.element_type() || !PoolType(k_pool.element_type()) ||
      v_pool.element_type() != k_pool.element_type())
    return ffi::Error::InvalidArgument("specjax cpu attention: float32 or bfloat16 operands");
  if (kd[0] != B || kd[3] != H || md[0] != B || md[1] != T || md[2] != Tk || vd[0] != B || vd[1] != Tk ||
      vd[2] != K || vd[3] != H || K < 1 || N % K != 0 || pd[2] != K || (pd[3] * pd[4]) % H != 0 ||
      td[0] != B || lengths.element_count() != static_cast<size_t>(B) ||
      v_pool.element_count() != k_pool.element_count())
    return ffi::Error::InvalidArgument("specjax cpu attention: shapes do not match");
  const int64_t Z = pd[3] * pd[4] / H, L = pd[0], pps = td[1];
  const int64_t li = *layer.typed_data();
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("specjax cpu attention: layer out of range");
  const int32_t* len = lengths.typed_data();
  thread_local std::vector<float> qbuf, kbuf, vbuf;
  const float* qf = AsF32(q, qbuf);
  const float* kf = AsF32(k_new, kbuf);
  const float* vf = AsF32(v_new, vbuf);
  const bool* m = reinterpret_cast<const bool*>(mask.typed_data());
  // A (row, kv head)'s queries are cut into runs only when there are fewer such pairs than threads (one kv head at
  // batch 1), since every run reads all of the pair's keys and values. SmolLM2 at batch 1 (three kv heads, two
  // threads), a bf16 step's attention at a 1024-token context: 5.1 ms with three runs per pair (the old rule: about
  // four chunks per thread), 3.9 with two, 3.3 with one (fp32 5.6 against 4.2; twenty-fifth session). Several new
  // tokens (a tree, a chain, a draft step) make a pair's work arithmetic rather than reads: there the runs aim at two
  // chunks per thread, which evens out three pairs on two threads (SmolLM2's 30 layers at 8 tokens, two threads:
  // 2.05-2.26 against 2.51-2.84 ms at a 300-token context, bf16 7.1-7.6 against 8.7-8.9 at 1000; fifty-fifth
  // session). A query's arithmetic does not depend on its run.
  const int64_t per_thread = T > 1 ? 2 : 1;
  const int64_t parts = std::clamp<int64_t>((per_thread * PoolThreads() + B * K - 1) / (B * K), 1, T * (N / K));
  const bool prompt = T >= kPromptTokens && keys_in_pool == 0;  // token blocks of the blocked path
  const int64_t blocks = (T + kQueryTokens - 1) / kQueryTokens;
  auto run = [&](auto tag) {
    using P = decltype(tag);
    AttnJob<P> job{qf, kf, vf, m, static_cast<const P*>(k_pool.untyped_data()),
                   static_cast<const P*>(v_pool.untyped_data()), page_table.typed_data(), len,
                   out->typed_data(), B, T, Tk, N, K, H, Z, pd[1], pps, li, sm_scale, keys_in_pool != 0,
                   prompt ? blocks : parts};
    if (prompt) PromptAttention(job);
    else Parallel(AttnChunk<P>, &job, static_cast<int>(B * K * parts));
  };
  if (k_pool.element_type() == ffi::DataType::F32) run(float{});
  else run(uint16_t{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("keys_in_pool")
                                  .Ret<ffi::Buffer<ffi::F32>>());
