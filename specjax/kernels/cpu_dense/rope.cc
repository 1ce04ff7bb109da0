// specjax's CPU rotary embedding of a fused q/k/v projection: an XLA FFI custom call.
//
//   specjax_rope_qkv: qkv [R, K, G + 2, H] (per kv head its G query heads, its key, its value; float32 or bfloat16),
//   cos, sin float32 [R, H / 2] -> q [R, K * G, H], k [R, K, H] rotated, v [R, K, H] copied, all of qkv's type
//
// The arithmetic of ``layers.apply_rope``'s XLA program as XLA:CPU compiles it: with x1, x2 the halves of a head
// (float32), out1 = fma(x1, cos, -(x2 * sin)), out2 = fma(x2, cos, x1 * sin), rounded to the type; cos and sin
// come in from XLA (computed once per forward), so the bits are XLA's (tests/test_cpu_rope.py).
// Why: XLA:CPU ran a decoder layer's split of the projection and the two rotations as five fusions, each recomputing
// cos and sin per head (about 10 us each over a verified 4-token tree: 0.9 ms of a SmolLM2 (3,1,4) step); here one
// call per layer (twenty-seventh session). A prompt chunk's rows run on the thread pool: XLA's fusions over a
// 512-token chunk took about 3 ms a layer, computing cos and sin per head (sixty-fifth session).
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace specjax_cpu;

namespace {

// One head x (h values of type T) rotated by (c, s) [h / 2] into out.
template <typename T>
void Rotate(const T* x, const float* c, const float* s, int64_t h, T* out) {
  const int64_t half = h / 2;
  float x1[256], x2[256], o1[256], o2[256];  // h <= 512 (checked by the caller)
  for (int64_t i = 0; i < half; ++i) x1[i] = load(x, i), x2[i] = load(x + half, i);
  for (int64_t i = 0; i < half; ++i) {
    o1[i] = std::fma(x1[i], c[i], -(x2[i] * s[i]));
    o2[i] = std::fma(x2[i], c[i], x1[i] * s[i]);
  }
  for (int64_t i = 0; i < half; ++i) Store(out + i, o1[i]), Store(out + half + i, o2[i]);
}

template <typename T>
void RopeRows(const T* qkv, const float* cos, const float* sin, int64_t rows, int64_t kv, int64_t g, int64_t h,
              T* q, T* k, T* v) {
  for (int64_t r = 0; r < rows; ++r, cos += h / 2, sin += h / 2) {
    for (int64_t j = 0; j < kv; ++j, qkv += (g + 2) * h) {
      for (int64_t i = 0; i < g; ++i, q += h) Rotate(qkv + i * h, cos, sin, h, q);
      Rotate(qkv + g * h, cos, sin, h, k);
      std::memcpy(v, qkv + (g + 1) * h, h * sizeof(T));
      k += h, v += h;
    }
  }
}

// A prompt chunk's rows, cut into runs for the thread pool (each row's arithmetic is the same on any run).
template <typename T>
struct RopeJob {
  const T* qkv;
  const float *cos, *sin;
  int64_t rows, kv, g, h, width;
  T *q, *k, *v;
};

template <typename T>
void RopeChunk(const void* ctx, int chunk) {
  const auto& j = *static_cast<const RopeJob<T>*>(ctx);
  const int64_t r0 = chunk * j.width, n = std::min(j.width, j.rows - r0), half = j.h / 2;
  RopeRows(j.qkv + r0 * j.kv * (j.g + 2) * j.h, j.cos + r0 * half, j.sin + r0 * half, n, j.kv, j.g, j.h,
           j.q + r0 * j.kv * j.g * j.h, j.k + r0 * j.kv * j.h, j.v + r0 * j.kv * j.h);
}

ffi::Error RopeQkvImpl(ffi::AnyBuffer qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                       ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v) {
  auto d = qkv.dimensions();
  if (d.size() != 4 || d[2] < 3 || d[3] % 2 != 0 || d[3] > 512)
    return ffi::Error::InvalidArgument("specjax cpu rope_qkv: qkv [R, K, G + 2, H], G >= 1, H even and <= 512");
  const int64_t R = d[0], K = d[1], G = d[2] - 2, H = d[3];
  if (cos.element_count() != R * H / 2 || sin.element_count() != R * H / 2 || q->element_count() != R * K * G * H
      || k->element_count() != R * K * H || v->element_count() != R * K * H)
    return ffi::Error::InvalidArgument("specjax cpu rope_qkv: cos, sin [R, H/2]; q [R, K*G, H]; k, v [R, K, H]");
  const auto t = qkv.element_type();
  if (!FloatType(t) || q->element_type() != t || k->element_type() != t || v->element_type() != t)
    return ffi::Error::InvalidArgument("specjax cpu rope_qkv: float32 or bfloat16 qkv, outputs of its type");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Split split = MakeSplit(R, 1, 32);  // a decode step's or a tree's few rows: one run
    const RopeJob<T> job{static_cast<const T*>(qkv.untyped_data()), cos.typed_data(), sin.typed_data(), R, K, G, H,
                         split.width, static_cast<T*>(q->untyped_data()), static_cast<T*>(k->untyped_data()),
                         static_cast<T*>(v->untyped_data())};
    Parallel(RopeChunk<T>, &job, split.n);
  };
  if (t == ffi::DataType::BF16) run(uint16_t{});
  else run(float{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRopeQkv, RopeQkvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
