// specjax's CPU writes into and reads from the paged KV pools, where they lie: XLA FFI custom calls.
//
//   specjax_kv_write: the K and V pools [L, P, K, Z, H] (or lane-packed [L, P, K, Z/f, f*H], the same bytes),
//   k_new, v_new [Ln, B, T, K, H] in the pools' dtype, page i32[B, T], slot i32[B, T], layer i32[]
//   -> the K and V pools (aliased to the operands: the caller passes input_output_aliases {0: 0, 1: 1})
//
// Row (l, b, t, kv head) of k_new lands at pool [layer + l, page[b, t], kv head, slot[b, t]]; tokens whose page lies
// outside [0, P) are dropped (``kv_cache.slot_indices`` marks invalid ones so), as the XLA scatter's mode="drop".
// Why: XLA:CPU scatters a half-precision operand through an f32 copy of it, and the scatter on the pool's uint16 bits
// (``kv_cache.on_bits``) still converted the donated bf16 pools to bits and back once per program: two copies of
// each whole pool per decode step, so a bf16 step's cost grew with the pool (SmolLM2 at a 201-page pool: 48 ms, twice
// the fp32 step; docs/benchmarks.md). Here the pools are written where they lie, in any dtype, and a layer's write is
// one call instead of a scatter fusion and its index fusion per pool.
//
//   specjax_take_pages: a pool [L, P, K, R, W], cols i32[B, n], layer i32[] -> [B, n, K, R, W], the pages
//   pool[layer, cols[b, i]] (indices clamped into [0, P), as XLA's gather clamps them)
//
// Why: the XLA attention path (prompt chunks) reads a block of pages per step of its loop; XLA:CPU gathers a bf16
// operand through an f32 copy of it, and the pool's uint16 bits view entering the loop was a copy of the whole pool
// per layer (a 100-token bf16 prompt at the server's CPU pool: 4.1 s against fp32's 0.18 s).
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace specjax_cpu;

namespace {

// Copy ``pool`` into ``out`` unless XLA already handed the same buffer (it does when the operand is aliased).
void Alias(ffi::AnyBuffer pool, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != pool.untyped_data())
    std::memcpy(out->untyped_data(), pool.untyped_data(), pool.size_bytes());
}

ffi::Error KvWriteImpl(ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                       ffi::Buffer<ffi::S32> page, ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> layer,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto pd = k_pool.dimensions(), nd = k_new.dimensions(), sd = page.dimensions();
  if (pd.size() != 5 || nd.size() != 5 || sd.size() != 2)
    return ffi::Error::InvalidArgument("specjax kv write: pools [L, P, K, R, W], new [Ln, B, T, K, H], page [B, T]");
  const auto dt = k_pool.element_type();
  if (!PoolType(dt) || v_pool.element_type() != dt || k_new.element_type() != dt || v_new.element_type() != dt ||
      k_out->element_type() != dt || v_out->element_type() != dt)
    return ffi::Error::InvalidArgument("specjax kv write: pools and new keys in one float32 or 16-bit dtype");
  const int64_t L = pd[0], P = pd[1], K = pd[2], Ln = nd[0], B = nd[1], T = nd[2], H = nd[4];
  if (nd[3] != K || H < 1 || (pd[3] * pd[4]) % H != 0 || v_pool.element_count() != k_pool.element_count() ||
      v_new.element_count() != k_new.element_count() || sd[0] != B || sd[1] != T ||
      slot.element_count() != page.element_count() || k_out->element_count() != k_pool.element_count() ||
      v_out->element_count() != v_pool.element_count())
    return ffi::Error::InvalidArgument("specjax kv write: shapes do not match");
  const int64_t Z = pd[3] * pd[4] / H, l0 = *layer.typed_data();
  if (l0 < 0 || l0 + Ln > L) return ffi::Error::InvalidArgument("specjax kv write: layer out of range");
  Alias(k_pool, k_out);
  Alias(v_pool, v_out);
  const size_t esize = ffi::ByteWidth(dt), row = H * esize;
  const int32_t* pg = page.typed_data();
  const int32_t* sl = slot.typed_data();
  const char* src[2] = {static_cast<const char*>(k_new.untyped_data()),
                        static_cast<const char*>(v_new.untyped_data())};
  char* dst[2] = {static_cast<char*>(k_out->untyped_data()), static_cast<char*>(v_out->untyped_data())};
  for (int64_t l = 0; l < Ln; ++l)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t p = pg[bt], s = sl[bt];
      if (p < 0 || p >= P || s < 0 || s >= Z) continue;
      for (int64_t kh = 0; kh < K; ++kh) {
        const int64_t to = (((l0 + l) * P + p) * K + kh) * Z + s, from = (l * B * T + bt) * K + kh;
        for (int w = 0; w < 2; ++w) std::memcpy(dst[w] + to * row, src[w] + from * row, row);
      }
    }
  return ffi::Error::Success();
}

ffi::Error TakePagesImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> cols, ffi::Buffer<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions(), cd = cols.dimensions(), od = out->dimensions();
  if (pd.size() != 5 || cd.size() != 2 || od.size() != 5 || od[0] != cd[0] || od[1] != cd[1] || od[2] != pd[2] ||
      od[3] != pd[3] || od[4] != pd[4] || out->element_type() != pool.element_type() || !PoolType(pool.element_type()))
    return ffi::Error::InvalidArgument("specjax take pages: pool [L, P, K, R, W], cols [B, n] -> [B, n, K, R, W]");
  const int64_t L = pd[0], P = pd[1], l = *layer.typed_data();
  if (l < 0 || l >= L || P < 1) return ffi::Error::InvalidArgument("specjax take pages: layer out of range");
  const size_t page = ffi::ByteWidth(pool.element_type()) * pd[2] * pd[3] * pd[4];
  const char* from = static_cast<const char*>(pool.untyped_data()) + l * P * page;
  char* to = static_cast<char*>(out->untyped_data());
  const int32_t* c = cols.typed_data();
  for (size_t i = 0; i < cols.element_count(); ++i)
    std::memcpy(to + i * page, from + std::clamp<int64_t>(c[i], 0, P - 1) * page, page);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTakePages, TakePagesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
