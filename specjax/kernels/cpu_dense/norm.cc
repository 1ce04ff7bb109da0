// specjax's CPU RMSNorm: an XLA FFI custom call.
//
//   specjax_rms_norm: x [R, D], weight [D] -> y [R, D] in x's dtype (float32 or bfloat16; weight of either), attribute
//   eps: y = weight * (x / sqrt(mean(x^2) + eps)), as ``layers.rms_norm`` computes it on a CPU
//
// The arithmetic of ``layers.rms_norm``'s XLA program: the squares of a row (float32) summed in ``layers.row_sum``'s
// fixed tree (zero-padded to a power of two, the halves added elementwise until one is left), divided by D, eps
// added, the reciprocal of the square root, x times it rounded to x's dtype, then times the weight (rounded to x's
// dtype first) in x's dtype. The reciprocal square root is IEEE 1 / sqrt here; XLA:CPU refines a hardware estimate
// whose bits depend on the vector width it picks, so float32 results may differ from XLA's in the last bits
// (bfloat16 ones agreed on every input tried). Every CPU norm of these dtypes goes through this kernel (any number
// of rows: decode steps, verified trees, prompt chunks), and a row's bits do not depend on the rows beside it.
// Why: XLA:CPU ran the tree as four to five fusions per norm (about 7 us each; 61 norms in a SmolLM2 decode step,
// 0.43 ms of a 12.6 ms bf16 step), here one call of about 3 us (twenty-sixth session).
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace specjax_cpu;

namespace {

// Rows of x (float32 values) normalised and scaled by w (already of x's type) into out, of x's type T: per row the
// sum of squares in the fixed tree, then w * round(x * r).
template <typename T>
void NormRows(const float* x, const float* w, int64_t rows, int64_t d, float eps, T* out) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  int64_t width = 1;
  while (width < d) width *= 2;
  thread_local std::vector<float> tree;
  tree.resize(width);
  for (int64_t r = 0; r < rows; ++r, x += d, out += d) {
    for (int64_t i = 0; i < d; ++i) tree[i] = x[i] * x[i];
    for (int64_t i = d; i < width; ++i) tree[i] = 0.f;
    for (int64_t half = width / 2; half >= 1; half /= 2)
      for (int64_t i = 0; i < half; ++i) tree[i] = tree[i] + tree[i + half];
    const float scale = 1.f / std::sqrt(tree[0] / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      const float y = x[i] * scale;
      Store(out + i, w[i] * (kBf16 ? HeldBf16(y) : y));
    }
  }
}

ffi::Error RmsNormImpl(ffi::AnyBuffer x, ffi::AnyBuffer weight, float eps, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = weight.dimensions();
  if (xd.size() != 2 || wd.size() != 1 || wd[0] != xd[1] || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("specjax cpu rms_norm: x [R, D], weight [D], y like x");
  if (!FloatType(x.element_type()) || !FloatType(weight.element_type()) || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("specjax cpu rms_norm: float32 or bfloat16 operands, y of x's type");
  const int64_t R = xd[0], D = xd[1];
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  thread_local std::vector<float> xbuf, wbuf;
  const float* xf = AsF32(x, xbuf);
  const float* wf = AsF32(weight, wbuf);
  if (bf16 && weight.element_type() == ffi::DataType::F32) {  // weight.astype(x.dtype): rounded to bfloat16 first
    wbuf.resize(D);
    for (int64_t i = 0; i < D; ++i) wbuf[i] = HeldBf16(wf[i]);
    wf = wbuf.data();
  }
  if (bf16) NormRows(xf, wf, R, D, eps, static_cast<uint16_t*>(y->untyped_data()));
  else NormRows(xf, wf, R, D, eps, static_cast<float*>(y->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::AnyBuffer>());
