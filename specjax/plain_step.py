"""Prefill and decode primitives over the paged KV cache, shared by plain generation, the server's runners and the
speculative engine. Pure functions; callers jit them (with the cache donated)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import kv_cache
from specjax.config import ModelConfig
from specjax.models import target


def prefill(params: target.TargetParams, cfg: ModelConfig, cache: kv_cache.KVCache, tokens, valid, *,
            aux_layers=None, return_hidden: bool = False, all_logits: bool = False, cache_attention=None,
            keys_in_pool: bool = False):
    """Append a chunk of new tokens to each sequence (prompt prefill, chunked prefill, or one decode token).

    tokens: i32[B, T] right-padded; valid: bool[B, T] (a prefix of each row). Row b's tokens go to positions
    ``cache.lengths[b] + [0, n_b)`` and attend to the cached prefix plus themselves (causal).
    Returns (cache with lengths advanced, ForwardOut whose ``logits`` are f32[B, V] at each row's last valid token,
    or f32[B, T, V] when ``all_logits``). Rows with no valid token are untouched (their logits are garbage).
    keys_in_pool: attention reads the new tokens back from the pool (``target.forward``); decode steps do.
    """
    b, t = tokens.shape
    n = valid.sum(axis=1).astype(jnp.int32)  # i32[B]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # i32[B, T]
    last = jnp.maximum(n - 1, 0)[:, None]  # i32[B, 1]
    out = target.forward(params, cfg, tokens, positions, cache=cache, valid=valid,
                         aux_layers=aux_layers, logits_at=None if all_logits else last,
                         return_hidden=return_hidden, return_kv=False, cache_attention=cache_attention,
                         write_valid=valid, keys_in_pool=keys_in_pool)
    cache = dataclasses.replace(out.cache, lengths=cache.lengths + n)
    logits = out.logits if all_logits else out.logits[:, 0]
    return cache, dataclasses.replace(out, logits=logits, cache=None)


def decode(params: target.TargetParams, cfg: ModelConfig, cache: kv_cache.KVCache, tokens, active, *,
           cache_attention=None):
    """One plain decode step: tokens i32[B] at positions cache.lengths, for rows with ``active`` (bool[B]).
    Its token is read back from the pool with the prefix, so each row gets the bits a verified chain gives it
    (``target.forward(keys_in_pool=...)``). Returns (cache, logits f32[B, V])."""
    cache, out = prefill(params, cfg, cache, tokens[:, None], active[:, None], cache_attention=cache_attention,
                         keys_in_pool=True)
    return cache, out.logits
