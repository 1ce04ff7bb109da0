"""Building blocks shared by the target decoder and the draft heads.

Axis letters used in einsums and shape comments throughout specjax:
  B batch, T new tokens (query length), S cached key length, N query heads, K kv heads, G = N // K query heads per
  kv head, H head dim, D model width, F MLP width, V vocabulary, L layers, P cache pages, Z page size.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite so that fully masked rows give uniform probs instead of NaN (they are never read)


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in fp32, returned in x's dtype (HF: weight * (x / rms(x)).to(dtype))."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
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


def apply_rope(x, positions, inv_freq):
    """HF rotate-half RoPE. x: [B, T, N, H]; positions: i32[B, T]; inv_freq: f32[H/2]."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # f32[B, T, H/2]
    cos = jnp.cos(ang)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def swiglu(x, w_gate, w_up, w_down):
    """down(silu(gate(x)) * up(x)). x: [B, T, D]; w_gate/w_up: [D, F]; w_down: [F, D]."""
    g = jnp.einsum("btd,df->btf", x, w_gate)
    u = jnp.einsum("btd,df->btf", x, w_up)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, w_down)


def causal_mask(valid):
    """bool[B, T, T]: query i sees key j iff j <= i and key j is a real (non-pad) token. valid: bool[B, T]."""
    t = valid.shape[1]
    tri = jnp.tril(jnp.ones((t, t), dtype=bool))
    return tri[None] & valid[:, None, :]


def attention(q, k, v, mask, *, k_cache=None, v_cache=None, cache_valid=None, sm_scale: float):
    """Attention of T new queries over (cached keys) + (new keys), GQA, softmax in fp32.

    q: [B, T, N, H]; k, v: [B, T, K, H]; mask: bool[B, T, T] (query i may see new key j);
    k_cache, v_cache: [B, S, K, H] or None; cache_valid: bool[B, T, S] (query i may see cached key s).
    Unused cache slots may hold anything, NaN included: they are masked and zeroed, never read.
    Returns [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    s_new = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    s_new = jnp.where(mask[:, None, None], s_new, NEG_INF)  # [B, K, G, T, T]
    if k_cache is None:
        p = jax.nn.softmax(s_new, axis=-1)
        out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v)
        return out.reshape(b, t, n, h)
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
