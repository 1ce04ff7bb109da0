"""Building blocks shared by the target decoder and the draft heads.

Axis letters used in einsums and shape comments throughout specjax:
  B batch, T new tokens (query length), S cached key length, N query heads, K kv heads, G = N // K query heads per
  kv head, H head dim, D model width, F MLP width, V vocabulary, L layers, P cache pages, Z page size.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import platforms
from specjax.kernels import cpu_dense
from specjax.kv_cache import HALF_DTYPES, gather_layer, page_size_of, take_pages, write as kv_write

NEG_INF = -1e30  # finite so that fully masked rows give uniform probs instead of NaN (they are never read)


def row_sum(x):
    """x.sum(-1), in an order that does not depend on x's other axes on a CPU.

    XLA:CPU vectorises a reduction by the shape of the whole array, so a row's sum changed with the number of rows
    beside it: a one-token decode step and the same token as row 4 of a verified chain got different last bits (the
    softmax denominator, an RMSNorm), which a bf16 model amplified into different greedy tokens. On a CPU the halves
    are added elementwise until one is left (zero-padded to a power of two): a fixed tree per row, so speculative
    greedy output is plain greedy output bit for bit. Other platforms reduce as XLA likes."""
    def pairwise(x):
        n = x.shape[-1]
        width = 1 << max(0, (n - 1).bit_length())
        if width != n:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
        while x.shape[-1] > 1:
            half = x.shape[-1] // 2
            x = x[..., :half] + x[..., half:]
        return x[..., 0]

    return platforms.select(x, cpu=pairwise, default=lambda x: x.sum(-1))


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in fp32, returned in x's dtype (HF: weight * (x / rms(x)).to(dtype)); the mean over the
    hidden axis in ``row_sum``'s fixed order. Where specjax's CPU kernels are built, every CPU norm of fp32 or bf16
    runs there as one call (``kernels.cpu_dense.rms_norm``: the same arithmetic with an IEEE reciprocal square root,
    where XLA:CPU ran four to five fusions per norm); its rows do not depend on the rows beside them."""
    if cpu_dense.supports_norm(x, weight):
        def kernel(x, weight):
            return cpu_dense.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, _xla_rms_norm).reshape(x.shape)
        return platforms.select(x, weight, cpu=kernel, default=lambda x, w: _xla_rms_norm(x, w, eps))
    return _xla_rms_norm(x, weight, eps)


def _xla_rms_norm(x, weight, eps: float):
    xf = x.astype(jnp.float32)
    var = row_sum(xf * xf)[..., None] / x.shape[-1]
    y = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * y


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies f32[H/2], with HF's "llama3" and "linear" scalings."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    rtype = scaling.get("rope_type", "default")
    if rtype == "linear":
        return (inv / float(scaling["factor"])).astype(np.float32)
    if rtype == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope type {rtype!r}")


def rope_cos_sin(positions, inv_freq):
    """cos and sin f32[B, T, H/2] of the rotation angles at positions i32[B, T] (inv_freq: f32[H/2])."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # f32[B, T, H/2]
    return jnp.cos(ang), jnp.sin(ang)


def _rotate(x, cos, sin):
    """x [B, T, N, H] rotated by cos, sin f32[B, T, H/2] (HF's rotate-half), in x's dtype."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, H/2]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    """HF rotate-half RoPE. x: [B, T, N, H]; positions: i32[B, T]; inv_freq: f32[H/2]."""
    return _rotate(x, *rope_cos_sin(positions, inv_freq))


def rope_qkv(qkv, positions, inv_freq):
    """q [B, T, K*G, H], k and v [B, T, K, H] of a fused projection's output qkv [B, T, K, G + 2, H] (per kv head
    its G query heads, its key, its value), q and k rotated (``apply_rope``).
    On a CPU, any tokens per sequence (a decode step, a verified tree, a prompt chunk) take one kernel call
    (``kernels.cpu_dense.rope_qkv``, XLA's bits from the same cos and sin), where XLA:CPU ran five fusions per layer
    that computed cos and sin per head."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    if cpu_dense.supports_rope(qkv):
        def kernel(qkv, cos, sin):
            b, t, kv, g2, h = qkv.shape
            q, k, v = cpu_dense.rope_qkv(qkv.reshape(b * t, kv, g2, h), cos.reshape(b * t, -1),
                                         sin.reshape(b * t, -1), _xla_rope_qkv4)
            return q.reshape(b, t, kv * (g2 - 2), h), k.reshape(b, t, kv, h), v.reshape(b, t, kv, h)
        return platforms.select(qkv, cos, sin, cpu=kernel, default=_xla_rope_qkv)
    return _xla_rope_qkv(qkv, cos, sin)


def _xla_rope_qkv(qkv, cos, sin):
    g = qkv.shape[-2] - 2
    q = qkv[..., :g, :].reshape(*qkv.shape[:-3], -1, qkv.shape[-1])
    return _rotate(q, cos, sin), _rotate(qkv[..., g, :], cos, sin), qkv[..., g + 1, :]


def _xla_rope_qkv4(qkv4, cos, sin):
    """``_xla_rope_qkv`` of rows: qkv4 [R, K, G + 2, H], cos, sin [R, H/2] (the kernel's shapes)."""
    q, k, v = _xla_rope_qkv(qkv4[:, None], cos[:, None], sin[:, None])
    return q[:, 0], k[:, 0], v[:, 0]


# A dense layer over 2..ROWWISE_MAX_ROWS rows of x runs on a CPU as one matrix-vector product per row (``dense``).
ROWWISE_MAX_ROWS = 8
ROWWISE_MAX_WEIGHT_BYTES = 24 << 20  # about a CPU's last-level cache: every row after the first reads w from there


def dense(x, w, *, preferred_element_type=None, residual=None):
    """x [..., C] contracted with the first axis of w [C, *O] -> [..., *O]: every weight matmul of the decoder
    layers and the draft heads.

    On a CPU, a product over a few rows (a verified tree, a draft step over top-k branches, a small batch) runs as
    one matrix-vector product per row: XLA:CPU's GEMM over 2-4 rows (YNNPACK or Eigen) moved a decoder layer's
    weights at a third of the bandwidth its matrix-vector path reaches for one row, so a 4-row SmolLM2 layer stack
    cost 2.5x a 1-row one, while 4 matrix-vector products (the later ones read w from the cache) cost 1.8x; at 8
    rows the products were still 8-10% faster (docs/benchmarks.md, tenth session). Each row also gets exactly the
    arithmetic of a one-row decode step.
    Larger products, weights that do not fit a last-level cache (rows after the first would read memory again) and
    other platforms (``platforms.select``: a TPU program compiled on a CPU host keeps its one dot) use one
    dot. Half-precision operands on a CPU take ``half_dot``.
    Where specjax's CPU kernels are built (``kernels.cpu_dense``), a CPU product of fp32 or bf16 operands with at
    most ``cpu_dense.MAX_TOKENS`` rows per sequence (a decode step, a verified tree, a draft step, at any batch) runs
    there instead: one pass over w shared by the threads of a pool, bf16 read as bf16, and each row's bits
    independent of the rows beside it.
    ``residual`` (the result's shape): ``residual + dense(x, w)``, in one kernel call against a ``PackedWeight``
    (a decoder layer's residual connections on a CPU), the same bits."""
    if isinstance(w, cpu_dense.PackedWeight):
        return _packed_dense(x, w, preferred_element_type, residual)
    y = _dense(x, w, preferred_element_type)
    return y if residual is None else residual + y


def _one_dot(x, w, preferred_element_type=None):
    return jnp.tensordot(x, w, axes=1, preferred_element_type=preferred_element_type)


def _dense(x, w, preferred_element_type):
    """``dense`` against an array w."""
    rows = math.prod(x.shape[:-1])
    one_dot = functools.partial(_one_dot, preferred_element_type=preferred_element_type)
    if cpu_dense.supports(x, w) and preferred_element_type in (None, jnp.float32):
        def kernel(x, w):
            y = cpu_dense.dense(x.reshape(rows, x.shape[-1]), w.reshape(w.shape[0], -1))
            return y.reshape(*x.shape[:-1], *w.shape[1:]).astype(preferred_element_type or x.dtype)
        return platforms.select(x, w, cpu=kernel, default=one_dot)
    if is_half(x, w):
        out_dtype = preferred_element_type or x.dtype
        return platforms.select(
            x, w, cpu=lambda x, w: half_dot(x, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])
            .astype(out_dtype), default=one_dot)
    if not (2 <= rows <= ROWWISE_MAX_ROWS and w.size * w.dtype.itemsize <= ROWWISE_MAX_WEIGHT_BYTES):
        return one_dot(x, w)

    def rowwise(x, w):
        x2, w2 = x.reshape(rows, x.shape[-1]), w.reshape(w.shape[0], -1)
        y = jnp.concatenate([one_dot(x2[i:i + 1], w2) for i in range(rows)])
        return y.reshape(*x.shape[:-1], *w.shape[1:])

    return platforms.select(x, w, cpu=rowwise, default=one_dot)


def _packed_dense(x, w, preferred_element_type, residual):
    """``dense`` against a ``cpu_dense.PackedWeight`` (the decode layout's fp32 and bf16 matrices on a CPU): the
    kernel where ``cpu_dense.supports`` it (fp32: any number of rows; bf16: a decode step, tree or draft step; the
    result in its dtype and a residual added in the same call), a bf16 prompt chunk in ``cpu_dense.dense_prompt``,
    else ``dense`` of the unpacked w (a transpose of w in every call: XLA's copies of SmolLM2's bf16
    matrices took longer than its 256-token prompt's products)."""
    shape = w.shape
    if shape[0] != w.rows:
        raise ValueError(f"dense contracts the first axis of w: reshape the packed {shape} to ({w.rows}, -1) first")
    product = (cpu_dense.dense_packed if cpu_dense.supports(x, w) else
               cpu_dense.dense_prompt if cpu_dense.supports_prompt(x, w) else None)
    if product is None or preferred_element_type not in (None, jnp.float32):
        return dense(x, w.unpack(), preferred_element_type=preferred_element_type, residual=residual)
    rows, dtype, out_shape = math.prod(x.shape[:-1]), jnp.dtype(preferred_element_type or x.dtype), \
        (*x.shape[:-1], *shape[1:])
    fused = (product is cpu_dense.dense_packed and residual is not None and residual.dtype == dtype
             and residual.shape == out_shape)

    def kernel(x, panels, *res):
        x2 = x.reshape(rows, x.shape[-1])
        if res:
            return cpu_dense.dense_packed_add(x2, panels, res[0].reshape(rows, -1)).reshape(out_shape)
        y = cpu_dense.dense_packed(x2, panels, dtype) if product is cpu_dense.dense_packed else product(x2, panels)
        return y.reshape(out_shape).astype(dtype)

    def xla(x, panels, *res):
        y = _one_dot(x, cpu_dense.PackedWeight(panels, shape).unpack(), preferred_element_type)
        return res[0] + y if res else y

    y = platforms.select(x, w.panels, *((residual,) if fused else ()), cpu=kernel, default=xla)
    return y if fused or residual is None else residual + y


def is_half(x, w) -> bool:
    """Both operands bf16 or f16 (the products ``half_dot`` runs on a CPU)."""
    return x.dtype == w.dtype and x.dtype in HALF_DTYPES


def half_dot(x, w, *, dims: str = "cd,do->co"):
    """A CPU product of bf16/f16 x [..., D] and a weight (w [D, O], or a [V, D] table with ``dims="cd,od->co"``)
    -> f32 [..., O], accumulated in f32 as a TPU's MXU does.

    XLA:CPU sends a half-precision dot with an f32 result over two or more rows to YNNPACK, whose bf16 kernels read
    half the bytes of fp32 and cost about the same for 1 to 8 rows (a SmolLM2 layer stack over 4 rows: 1.05x its
    1-row time, against 1.6x for fp32's per-row products; docs/benchmarks.md, fifteenth session), and gives every
    row the same bits whatever the row count (pinned by tests/test_decode_layout.py). A one-row product with a
    half-precision result instead runs a naive loop several times slower than fp32, so one row is computed as two
    equal rows."""
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = jnp.concatenate([x2, x2])
    y = _half_einsum(x2, w, dims)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _half_einsum(x, w, dims: str):
    """``einsum(dims, x, w)`` of half-precision operands accumulated in f32 (``half_dot``), whose gradients are the
    same kind of product: the f32 cotangent is rounded to the operands' dtype first, as a TPU's bf16 training step
    feeds its MXU. Without that, each backward product mixes f32 and bf16, which XLA:CPU runs as an f32 dot at a
    fifth of the rate (on an AMX Xeon, 0.3 against 1.4 TFLOP/s for 2048^3; docs/benchmarks.md, thirty-seventh
    session). ``dims``: "ab,bc->ac"-like, every index in exactly two of the three terms."""
    return jnp.einsum(dims, x, w, preferred_element_type=jnp.float32)


def _half_einsum_fwd(x, w, dims):
    return _half_einsum(x, w, dims), (x, w)


def _half_einsum_bwd(dims, res, g):
    x, w = res
    (a, b), c = dims.split("->")[0].split(","), dims.split("->")[1]
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{c},{b}->{a}", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    # dw contracts the rows, x's major axis: XLA:CPU (JAX 0.10) widens such a dot to f32 (0.2 TFLOP/s for SmolLM2's
    # draft lm_head); with x transposed behind a barrier and a unit batch axis it keeps the bf16 product (3.5x faster)
    xt = jax.lax.optimization_barrier(x.T)
    dw = jnp.einsum(f"z{a[::-1]},z{c}->z{b}", xt[None], g[None], preferred_element_type=jnp.float32)[0]
    return dx, dw.astype(w.dtype)


_half_einsum.defvjp(_half_einsum_fwd, _half_einsum_bwd)


def unembed(x, table):
    """x [..., D] against an embedding table [V, D] as stored (a tied lm_head) -> f32 logits [..., V].

    On a CPU, 2..ROWWISE_MAX_ROWS rows run as one multiply-and-sum pass over the table: every table row is read
    once and dotted with all rows of x while it is in L1. The table is far larger than any cache (SmolLM2's is 113
    MB), so per-row products would read it once per row, and XLA:CPU's few-row GEMM moved it at about a third of
    the bandwidth of its one-row product: 4 rows took 2.5-3x one row's time against ~1.5x this way
    (docs/benchmarks.md, eleventh session). One row, more rows and other platforms keep the one dot. A
    half-precision table on a CPU takes ``half_dot`` (3.5-4.5 ms for 1-8 rows of SmolLM2's bf16 table, against
    4.6-5.8 ms for the fp32 paths). Where specjax's CPU kernels are built, an fp32 or bf16 table runs there for
    the rows ``dense`` sends to them (``kernels.cpu_dense.unembed``: table rows shared among a pool's threads)."""
    rows = math.prod(x.shape[:-1])

    def one_dot(x, table):
        return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)

    if cpu_dense.supports(x, table):
        def kernel(x, table):
            return cpu_dense.unembed(x.reshape(rows, x.shape[-1]), table).reshape(*x.shape[:-1], table.shape[0])
        return platforms.select(x, table, cpu=kernel, default=one_dot)
    if is_half(x, table):
        return platforms.select(x, table, cpu=_half_unembed, default=one_dot)
    if not 2 <= rows <= ROWWISE_MAX_ROWS:
        return one_dot(x, table)

    def one_pass(x, table):
        x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
        y = jnp.sum(table.astype(jnp.float32)[:, None, :] * x2[None], axis=-1)  # [V, rows], one fusion
        return y.T.reshape(*x.shape[:-1], table.shape[0])

    return platforms.select(x, table, cpu=one_pass, default=one_dot)


def _half_unembed(x, table):
    """``unembed``'s half-precision product on a CPU without specjax's kernels. For a decode step or a verified
    tree (at most ``cpu_dense.MAX_TOKENS`` tokens per sequence) it runs two rows at a time, so every row gets the
    bits of the one-row product (``half_dot`` computes one row as two), whatever the row count: YNNPACK's product
    against a [V, D] table switched kernels at 8 rows on an AMX Xeon and changed the last bits of every row
    (thirty-seventh session), which would let a tree row differ from a decode step's. Longer products (prefill,
    training) stay one product."""
    rows = math.prod(x.shape[:-1])
    if rows <= 2 or cpu_dense.tokens_per_sequence(x) > cpu_dense.MAX_TOKENS:
        return half_dot(x, table, dims="cd,od->co")
    x2 = x.reshape(rows, x.shape[-1])
    if rows % 2:
        x2 = jnp.concatenate([x2, x2[-1:]])
    y = jax.lax.map(lambda pair: half_dot(pair, table, dims="cd,od->co"), x2.reshape(-1, 2, x2.shape[-1]))
    return y.reshape(-1, table.shape[0])[:rows].reshape(*x.shape[:-1], table.shape[0])


def out_proj(o, wo, *, residual=None):
    """The attention output projection: o [B, T, N, H] against wo [N, H, D] -> [B, T, D], contracted over one
    merged (heads x head_dim) axis (with "btnh,nhd" XLA:CPU transposed wo, a copy of the weight on every step).
    ``residual``: added to the result (``dense``)."""
    b, t, n, hd = o.shape
    return dense(o.reshape(b, t, n * hd), wo.reshape(n * hd, -1), residual=residual)


def swiglu(x, w_gate, w_up, w_down, *, w_gate_up=None, residual=None):
    """down(silu(gate(x)) * up(x)). x: [B, T, D]; w_gate/w_up: [D, F]; w_down: [F, D]; or gate and up fused into
    ``w_gate_up`` [D, 2, F] (the decode layout: one product, the same sums per output). ``residual``: added to the
    result (``dense``)."""
    if w_gate_up is None:
        gate, up = dense(x, w_gate), dense(x, w_up)
    else:
        gate_up = dense(x, w_gate_up)
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return dense(jax.nn.silu(gate) * up, w_down, residual=residual)


def causal_mask(valid):
    """bool[B, T, T]: query i sees key j iff j <= i and key j is a real (non-pad) token. valid: bool[B, T]."""
    t = valid.shape[1]
    tri = jnp.tril(jnp.ones((t, t), dtype=bool))
    return tri[None] & valid[:, None, :]


QUERY_CHUNK_MIN = 128  # long query spans are attended in chunks of at least this many rows
QUERY_CHUNKS_MAX = 8  # and in at most this many chunks (each one is unrolled into the program)


def query_chunks(t: int, tk: int, causal: bool) -> list[tuple[int, int, int]]:
    """(first row, end row, key count) of each chunk of T new queries over Tk new keys (Tk == T when ``causal``).

    A [T, T] score block of a long prompt does not fit a CPU's caches (1024 tokens x 9 heads: 38 MB per layer), so
    queries are attended in at most ``QUERY_CHUNKS_MAX`` chunks; with ``causal`` (query i sees no new key j > i) a
    chunk also reads only the keys up to its last row, which skips the upper triangle (7/16 of the work at 8 chunks).
    Short spans (decode, tree verify, T <= 2 * QUERY_CHUNK_MIN) stay one chunk."""
    if causal and tk != t:
        raise ValueError(f"causal attention needs as many new keys as queries, got {tk} keys for {t} queries")
    if t <= 2 * QUERY_CHUNK_MIN:
        return [(0, t, tk)]
    c = max(QUERY_CHUNK_MIN, -(-t // QUERY_CHUNKS_MAX))
    return [(a, min(a + c, t), min(a + c, t) if causal else tk) for a in range(0, t, c)]


def kv_head_major(q, *kv):
    """Operands of the products over new tokens with the kv heads leading (no transposes inside a chunk loop):
    q [B, T, N, H] -> [B, K, G, T, H], each of kv [B, T, K, H] -> [B, K, T, H]. ``merge_kv_heads`` undoes q's."""
    b, t, n, h = q.shape
    kh = kv[0].shape[2]
    return (jnp.moveaxis(q.reshape(b, t, kh, n // kh, h), 1, 3), *(jnp.moveaxis(x, 1, 2) for x in kv))


def merge_kv_heads(chunks):
    """Per-chunk outputs [B, K, G, T', H] (in query order) -> [B, T, N, H]."""
    out = jnp.concatenate(chunks, axis=3) if len(chunks) > 1 else chunks[0]
    b, kh, g, t, h = out.shape
    return jnp.moveaxis(out, 3, 1).reshape(b, t, kh * g, h)


def attention(q, k, v, mask, *, k_cache=None, v_cache=None, cache_valid=None, sm_scale: float,
              causal: bool = False):
    """Attention of T new queries over (cached keys) + (new keys), GQA, softmax in fp32.

    q: [B, T, N, H]; k, v: [B, T, K, H]; mask: bool[B, T, T] (query i may see new key j);
    k_cache, v_cache: [B, S, K, H] or None; cache_valid: bool[B, T, S] (query i may see cached key s).
    causal: the caller promises that ``mask`` hides every new key j > i from query i (a causal mask, with padding or
    a sliding window); long spans without a cache then skip those keys (``query_chunks``). Same result either way.
    Unused cache slots may hold anything, NaN included: they are masked and zeroed, never read.
    Returns [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    if k_cache is None:  # by chunks of queries
        qk, kk, vk = kv_head_major(q, k, v)
        outs = []
        for a, z, e in query_chunks(t, k.shape[1], causal):
            s_new = jnp.einsum("bkgth,bksh->bkgts", qk[:, :, :, a:z], kk[:, :, :e],
                               preferred_element_type=jnp.float32)
            s_new = jnp.where(mask[:, None, None, a:z, :e], s_new * sm_scale, NEG_INF)  # [B, K, G, T', S']
            p = jax.nn.softmax(s_new, axis=-1)
            outs.append(jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vk[:, :, :e]))
        return merge_kv_heads(outs)
    s_new = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    s_new = jnp.where(mask[:, None, None], s_new, NEG_INF)  # [B, K, G, T, T]
    k_cache = jnp.where(cache_valid.any(1)[:, :, None, None], k_cache, 0)
    v_cache = jnp.where(cache_valid.any(1)[:, :, None, None], v_cache, 0)
    s_old = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * sm_scale
    s_old = jnp.where(cache_valid[:, None, None], s_old, NEG_INF)  # [B, K, G, T, S]
    scores = jnp.concatenate([s_old, s_new], axis=-1)
    p = jax.nn.softmax(scores, axis=-1)
    s = k_cache.shape[1]
    out = jnp.einsum("bkgts,bskh->btkgh", p[..., :s].astype(v.dtype), v_cache)
    out = out + jnp.einsum("bkgts,bskh->btkgh", p[..., s:].astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def xla_cache_attention(q, k, v, mask, k_pages, v_pages, page_table, cache_valid, sm_scale):
    """Reference (XLA) attention over the WHOLE gathered paged prefix plus the new tokens (see ``attention``).
    Reads every page of the page table; ``paged_attention`` is the same math over the pages in use."""
    k_cache, v_cache = gather_layer(k_pages, v_pages, page_table, q.shape[-1])
    return attention(q, k, v, mask, k_cache=k_cache, v_cache=v_cache, cache_valid=cache_valid, sm_scale=sm_scale)


CACHE_BLOCK_TOKENS = 256  # paged_attention reads the cache in blocks of this many tokens (whole pages)


def _pages_einsum(dims: str, x, pages):
    """``einsum(dims, x, pages)`` in f32 over a block of gathered KV pages. fp32 pages on a TPU contract at HIGHEST
    precision: at JAX's default a TPU multiplies fp32 in one bf16 pass, and XLA then converted the whole
    loop-invariant pool to bf16 ahead of the attention loops (a bf16 copy of the draft's fp32 K/V pool on every
    speculative step, 1 GiB per chip at SmolLM2's shapes; 20 GiB for a 512-token prefill chunk on the XLA path: the
    TPU preflight's temp column). Other platforms and half-precision pages keep the default precision (a GPU runs fp32
    as TF32 and converts nothing)."""
    def dot(precision):
        return lambda x, pages: jnp.einsum(dims, x, pages, preferred_element_type=jnp.float32, precision=precision)
    if pages.dtype != jnp.float32:
        return dot(None)(x, pages)
    return platforms.select(x, pages, tpu=dot(jax.lax.Precision.HIGHEST), default=dot(None))


def _block_valid(key_pos, lengths, mask, positions, keys_in_pool: bool, sliding_window: int | None):
    """bool[B, T, S]: which of a block's cache slots ``key_pos`` (i32[S]) each new query may see: the committed
    prefix (slot < lengths[b]), with ``keys_in_pool`` also new token j at slot lengths[b] + j where mask[b, :, j]
    lets the query see it, within the sliding window if any."""
    b, t = mask.shape[:2]
    valid = key_pos[None, None, :] < lengths[:, None, None]  # bool[B, 1, S]
    if keys_in_pool:  # slot lengths[b] + j holds new token j, seen under mask[b, :, j]
        j_new = key_pos[None, :] - lengths[:, None]  # i32[B, S]
        idx = jnp.broadcast_to(jnp.clip(j_new, 0, t - 1)[:, None, :], (b, t, key_pos.shape[0]))
        new_seen = jnp.take_along_axis(mask, idx, axis=2) & ((j_new >= 0) & (j_new < t))[:, None, :]
        valid = valid | new_seen
    if sliding_window is not None:
        valid = valid & ((positions[:, :, None] - key_pos[None, None, :]) < sliding_window)
    return jnp.broadcast_to(valid, (b, t, key_pos.shape[0]))


def paged_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, positions, sm_scale, *,
                    sliding_window: int | None = None, block_tokens: int = CACHE_BLOCK_TOKENS, layer=None,
                    causal: bool = False, keys_in_pool: bool = False):
    """Attention of T new queries over the paged prefix (positions < lengths[b]) plus the new keys under ``mask``.

    Same math as ``xla_cache_attention`` (softmax in f32), but the prefix is read in blocks of whole pages by a
    ``while_loop`` that runs ceil(max(lengths) / block) times: a step reads the KV the longest row holds, not the
    page table's capacity. Online softmax (running max and sum) across blocks, so no [S]-wide score row exists.
    q: [B, T, N, H]; k, v: [B, T, K, H]; mask: bool[B, T, T]; k_pages, v_pages: [P, K, Z, H], or [L, P, K, Z, H]
    with ``layer`` (the pages are gathered from the stacked pool: slicing out the layer first can make XLA copy the
    layer's whole pool); page_table: i32[B, pps]; lengths: i32[B]; positions: i32[B, T] (for the sliding window).
    causal: ``mask`` hides every new key j > i from query i; a long span of new tokens (a prompt) then reads only the
    keys up to each query chunk's last row (``query_chunks``; the chunks are taken either way).
    keys_in_pool: new token j of row b is already in the pool at position lengths[b] + j (wherever ``mask`` lets a
    query see it): the blocks then read every key, the new ones included, and k, v are not used. A query's result
    then depends only on its own position's keys, the same bits whether it is a decode step's one token or a row of
    a verified chain (the keys a chain row sees before itself are the tokens a later decode step finds cached),
    which is what lets bf16 speculative greedy decoding reproduce plain greedy decoding bit for bit.
    Returns [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    z = page_size_of(k_pages, h)  # lane-packed pools [.., Z/f, f*H] (kv_cache.pack_factor) hold Z slots per page
    pps = page_table.shape[1]
    bp = max(1, min(pps, block_tokens // z))  # pages per block
    nblocks_max = -(-pps // bp)
    pt = jnp.pad(page_table, ((0, 0), (0, nblocks_max * bp - pps)))  # padded columns are masked by lengths
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    g = n // kh

    def update(carry, s_, valid, pv_of):  # one online-softmax step over a block of keys
        m, l, acc = carry  # s_ f32[B, K, G, T, S] raw scores; valid bool[B, T, S]; pv_of(p) -> f32[B, K, G, T, H]
        s_ = jnp.where(valid[:, None, None], s_ * sm_scale, NEG_INF)
        m_new = jnp.maximum(m, s_.max(-1))  # [B, K, G, T]
        p = jnp.where(valid[:, None, None], jnp.exp(s_ - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + row_sum(p), acc * alpha[..., None] + pv_of(p)

    def block(j, carry):
        cols = jax.lax.dynamic_slice_in_dim(pt, j * bp, bp, axis=1)  # i32[B, bp]
        at = cols if layer is None else (layer, cols)
        # [B, bp, K, Z, H], used in this layout (no transpose of the pages; a packed block is unpacked, not the pool)
        kb, vb = (take_pages(pages, at, h) for pages in (k_pages, v_pages))
        key_pos = j * bp * z + jnp.arange(bp * z, dtype=jnp.int32)
        valid = _block_valid(key_pos, lengths, mask, positions, keys_in_pool, sliding_window)  # bool[B, T, S]
        seen = valid.any(1).reshape(b, bp, 1, z, 1)
        vb = jnp.where(seen, vb, 0)  # garbage (even NaN) slots never reach the sum

        def pv_of(p):
            p = p.reshape(b, kh, g, t, bp, z).astype(vb.dtype)
            return _pages_einsum("bkgtpz,bpkzh->bkgth", p, vb)
        s_ = _pages_einsum("btkgh,bpkzh->bkgtpz", qg, kb)
        return update(carry, s_.reshape(b, kh, g, t, bp * z), valid, pv_of)

    carry = (jnp.full((b, kh, g, t), NEG_INF, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
             jnp.zeros((b, kh, g, t, h), jnp.float32))
    held = lengths + t if keys_in_pool else lengths  # the keys the blocks read, per row
    nblocks = jnp.minimum((held.max() + bp * z - 1) // (bp * z), nblocks_max)
    m, l, acc = jax.lax.fori_loop(0, nblocks, block, carry)
    def normalised(l, acc):  # rows that see nothing (padding) give 0, never read
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    if keys_in_pool:
        return merge_kv_heads([normalised(l, acc)]).astype(q.dtype)
    # the new tokens, kv-head-major: [B, K, G, T, H] queries, [B, K, Tk, H] keys and values
    qk, kk, vk = kv_head_major(q, k, jnp.where(mask.any(1)[:, :, None, None], v, 0))
    outs = []
    for a, z, e in query_chunks(t, k.shape[1], causal):  # the new keys by chunks of queries (carry's T axis: 3)
        m_, l_, acc_ = update(tuple(c[:, :, :, a:z] for c in (m, l, acc)),
                              jnp.einsum("bkgth,bksh->bkgts", qk[:, :, :, a:z], kk[:, :, :e],
                                         preferred_element_type=jnp.float32),
                              mask[:, a:z, :e],
                              lambda p: jnp.einsum("bkgts,bksh->bkgth", p.astype(vk.dtype), vk[:, :, :e],
                                                   preferred_element_type=jnp.float32))
        outs.append(normalised(l_, acc_))
    return merge_kv_heads(outs).astype(q.dtype)


def attend(q, k, v, mask, sm_scale: float, k_pages=None, v_pages=None, page_table=None, lengths=None, *,
           positions=None, sliding_window: int | None = None, kernel: Callable | None = None, layer=None,
           causal: bool = False, keys_in_pool: bool = False):
    """THE attention of every model layer (target, both draft heads, the speculative step): T new queries over the
    paged cache prefix (positions < lengths[b]) plus the new keys under ``mask``.

    q: [B, T, N, H]; k, v: [B, Tk, K, H]; mask: bool[B, T, Tk]. Without ``k_pages`` there is no cache (training,
    tests): plain ``attention``. With it: k_pages, v_pages [P, K, Z, H] (one layer's pool) or, with ``layer`` (an int
    or traced scalar), every layer's [L, P, K, Z, H] (model layer loops pass the pool whole so that the kernel reads
    it in place: a per-layer slice handed to a custom call is a copy), page_table i32[B, pps], lengths i32[B];
    ``kernel`` (a ``kernels.tree_attention.make_cache_attention`` hook, Tk == T) replaces the XLA ``paged_attention``;
    ``positions`` i32[B, T] and ``sliding_window`` restrict the window (XLA path only).
    ``causal``: ``mask`` is causal (see ``attention``); the XLA paths then skip the keys it hides.
    ``keys_in_pool``: the new tokens are already in the pool after the prefix (``paged_attention``; a kernel reads
    them from k, v either way).
    Returns [B, T, N, H] in q's dtype.
    """
    if k_pages is None:
        return attention(q, k, v, mask, sm_scale=sm_scale, causal=causal)
    if kernel is not None:
        if sliding_window is not None:
            raise ValueError("sliding-window models use the XLA attention path; do not pass a kernel")
        return kernel(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale, layer=layer)
    def xla(q, k, v, mask, k_pages, v_pages, page_table, lengths):
        return paged_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, positions, sm_scale,
                               sliding_window=sliding_window, layer=layer, causal=causal, keys_in_pool=keys_in_pool)

    if sliding_window is not None or not cpu_dense.supports_attention(q, k_pages, keys_in_pool):
        return xla(q, k, v, mask, k_pages, v_pages, page_table, lengths)

    def kernel(q, k, v, mask, k_pages, v_pages, page_table, lengths):
        pools, at = ((k_pages, v_pages), layer) if layer is not None else ((k_pages[None], v_pages[None]), 0)
        return cpu_dense.paged_attention(q, k, v, mask, *pools, page_table, lengths, at, sm_scale,
                                         keys_in_pool).astype(q.dtype)
    return platforms.select(q, k, v, mask, k_pages, v_pages, page_table, lengths, cpu=kernel, default=xla)


AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]  # (layer, q, k, v) -> o [B, T, N, H]


class CacheAttend:
    """Per-layer ``attend`` of a draft head's layer loop, an ``AttendFn``: layer i reads ``cache.k[i]`` /
    ``cache.v[i]`` (a ``kv_cache.KVCache``; None: no cache). sm_scale is head_dim ** -0.5.

    write: (positions i32[B, T], valid bool[B, T]): layer i first writes its new K/V there (``kv_cache.write``), so
    that its reads follow the scatter and a donated pool is updated in place; ``.cache`` is then the written cache
    (lengths unchanged). causal: ``mask`` is causal (``attention``)."""

    def __init__(self, mask, cache=None, kernel: Callable | None = None, write=None, causal: bool = False):
        if write is not None and cache is None:
            raise ValueError("CacheAttend: write needs a cache")
        self.mask, self.cache, self.kernel, self.write, self.causal = mask, cache, kernel, write, causal

    def __call__(self, i, q, k, v):
        scale = q.shape[-1] ** -0.5
        c = self.cache
        if c is None:
            return attend(q, k, v, self.mask, scale, causal=self.causal)
        if self.write is not None:
            c = self.cache = kv_write(c, k, v, *self.write, layer=i)
        return attend(q, k, v, self.mask, scale, c.k, c.v, c.page_table, c.lengths, kernel=self.kernel, layer=i,
                      causal=self.causal)

    def store(self, i, k, v):
        """Only write layer i's new K/V (a layer whose output nothing reads)."""
        self.cache = kv_write(self.cache, k, v, *self.write, layer=i)
