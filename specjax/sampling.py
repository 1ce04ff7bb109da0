"""Per-request sampling on device: one definition of the target distribution used by plain generation,
speculative verification and the server, so that "lossless" means the same thing everywhere.

Order (as in SGLang / HF): temperature -> top_k -> top_p -> min_p. temperature == 0 means greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Sampling parameters of B rows (requests / slots), as device arrays."""
    temperature: jax.Array  # f32[B]  0 = greedy
    top_k: jax.Array  # i32[B]  <= 0 = off
    top_p: jax.Array  # f32[B]  1 = off
    min_p: jax.Array  # f32[B]  0 = off
    key: jax.Array  # u32[B, 2] per-row PRNG key (a per-request seed gives reproducible output)

    @classmethod
    def make(cls, batch: int, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0) -> "SamplingBatch":
        def col(v, dt):
            return jnp.asarray(np.broadcast_to(np.asarray(v, dt), (batch,)).copy())
        seeds = np.broadcast_to(np.asarray(seed, np.uint32), (batch,))
        keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(int(s))) for s in seeds])
        return cls(temperature=col(temperature, np.float32), top_k=col(top_k, np.int32), top_p=col(top_p, np.float32),
                   min_p=col(min_p, np.float32), key=keys)

    @property
    def greedy(self):
        return self.temperature <= 0.0  # bool[B]


def validate(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Raise ValueError with a clear message for out-of-range sampling parameters."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or a positive integer, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def target_probs(logits, temperature, top_k, top_p, min_p):
    """Processed distribution f32[..., V] from logits f32[..., V]; params broadcast over the leading axes ([B] ->
    [B, ...] via explicit expand by the caller). Greedy rows (temperature 0) get a one-hot on the argmax."""
    v = logits.shape[-1]
    expand = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - a.ndim))
    t = expand(temperature)
    greedy = t <= 0
    x = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t)
    # top-k: keep values >= the k-th largest.
    k = expand(top_k)
    k = jnp.where(k <= 0, v, jnp.minimum(k, v))
    sorted_desc = -jnp.sort(-x, axis=-1)  # [..., V]
    kth = jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    # top-p over the top-k-filtered distribution: keep the smallest prefix (by prob) whose mass reaches top_p.
    p = jax.nn.softmax(x, axis=-1)
    ps = -jnp.sort(-p, axis=-1)
    cum_before = jnp.cumsum(ps, axis=-1) - ps
    keep_sorted = cum_before < expand(top_p)
    n_keep = jnp.maximum(keep_sorted.sum(-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(ps, n_keep - 1, axis=-1)
    p = jnp.where(p >= threshold, p, 0.0)
    # min-p: drop tokens below min_p * max prob.
    p = jnp.where(p >= expand(min_p) * p.max(-1, keepdims=True), p, 0.0)
    p = p / p.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(greedy, onehot, p)


def split_keys(keys):
    """Advance per-row keys: u32[B, 2] -> (new keys u32[B, 2], subkeys u32[B, 2])."""
    both = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k), 2))(keys)
    data = jax.vmap(jax.vmap(jax.random.key_data))(both)
    return data[:, 0], data[:, 1]


def sample_rows(probs, subkeys):
    """One categorical draw per row from f32[B, V] with u32[B, 2] keys -> i32[B]."""
    def one(p, k):
        return jax.random.categorical(jax.random.wrap_key_data(k), jnp.log(jnp.maximum(p, 1e-38)) + jnp.where(
            p > 0, 0.0, -jnp.inf))
    return jax.vmap(one)(probs, subkeys).astype(jnp.int32)


def sample_next(logits, sb: SamplingBatch):
    """Next token per row from f32[B, V] logits -> (i32[B], SamplingBatch with advanced keys)."""
    keys, sub = split_keys(sb.key)
    greedy_tok = jnp.argmax(logits, -1).astype(jnp.int32)  # i32[B]

    def sampled(_):
        probs = target_probs(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
        return jnp.where(sb.greedy, greedy_tok, sample_rows(probs, sub))

    # An all-greedy batch skips the two sorts over V per row (3x the cost of a SmolLM2 batch-8 decode step on CPU);
    # keys advance either way, so every row's random stream is unchanged.
    tok = jax.lax.cond(sb.greedy.all(), lambda _: greedy_tok, sampled, None)
    return tok, dataclasses.replace(sb, key=keys)
