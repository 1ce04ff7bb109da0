"""PlainRunner: the ``specjax.serve.runners.base.Runner`` protocol for plain decoding (one token per slot per step).

Shapes are bucketed so that a handful of compiled programs cover every request mix:
- prefill runs one slot at a time on a B=1 view of the shared page pool, its new tokens padded to a bucket of
  ``runners.base.prefill_buckets`` (powers of two from 16 to max_prefill_tokens; on a CPU also 8 and 15, which
  the few-row kernels take);
- decode runs the first ``nb`` slots only (nb = power of two covering the highest active slot; the scheduler hands
  out the lowest free slot first, so the running batch stays packed at the front);
- both see ``np`` page-table columns (``batching.page_buckets``: the whole table on the XLA path, a power of two
  covering the longest active sequence for the Pallas kernel); attention reads what the sequences hold either way.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax import kv_cache, plain_step as decode, sampling
from specjax.batching import PREFILL_CHUNK, page_buckets, pick, pow2_buckets
from specjax.config import ModelConfig
from specjax.kernels.tree_attention import make_cache_attention
from specjax.models import target
from specjax.serve.runners.base import Launched, RunnerCommon, prefill_buckets
from specjax.sharding import put_kv_pool, use_mesh

log = logging.getLogger("specjax.serve")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PlainState:
    cache: kv_cache.KVCache  # pool [L, P, K, Z, H]; page_table i32[B, pps]; lengths i32[B]
    sampling: sampling.SamplingBatch  # per-slot sampling parameters and PRNG keys, [B]
    last: jax.Array  # i32[B] last emitted token of each slot (the next decode input)


class PlainRunner(RunnerCommon):
    """Plain decoding over a paged pool shared by ``max_batch`` slots."""

    tokens_per_step = 1

    def __init__(self, cfg: ModelConfig, params, *, max_batch: int, pages_per_seq: int, page_size: int,
                 num_pages: int, max_prefill_tokens: int = PREFILL_CHUNK, attention_impl: str = "auto",
                 mesh: Mesh | None = None):
        # Per-layer weights (one copy at start-up): every decode step reads them in place (target.unstack_layers).
        self.cfg, self.params, self.mesh = cfg, target.unstack_layers(params), mesh
        self.max_batch, self.pages_per_seq, self.page_size, self.num_pages = max_batch, pages_per_seq, page_size, \
            num_pages
        self.cache_attention = make_cache_attention(attention_impl, cfg.sliding_window)
        max_tokens = pages_per_seq * page_size
        self.prefill_buckets = prefill_buckets(min(max(max_prefill_tokens, 1), max_tokens), mesh)
        self.batch_buckets = pow2_buckets(1, max_batch)
        self.page_buckets = page_buckets(page_size, pages_per_seq, xla_path=self.cache_attention is None)
        self._lengths = np.zeros((max_batch,), np.int64)  # host mirror of cache lengths, for bucketing
        self._active = np.zeros((max_batch,), bool)
        self._compiled: set = set()
        self._seeds = sampling.Seeds()
        self._prefill_jit = jax.jit(self._prefill, static_argnames=("npages",), donate_argnums=(1,))
        self._step_jit = jax.jit(self._step, static_argnames=("nb", "npages"), donate_argnums=(1,))

    @property
    def target_params(self):
        return self.params

    def set_target_params(self, params) -> None:
        """New target weights of the same shapes, dtypes and shardings (``update_weights_from_disk``): the compiled
        programs take them as arguments, so nothing recompiles."""
        self.params = target.unstack_layers(params)

    @property
    def target_cfg(self) -> ModelConfig:
        return self.cfg

    # ---- device state --------------------------------------------------------------------------------------------
    def init_state(self) -> PlainState:
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        shape = kv_cache.pool_shape(c.num_layers, self.num_pages, c.num_kv_heads, self.page_size, c.head_dim, dt)
        k = jnp.zeros(shape, dt)
        v = jnp.zeros(shape, dt)
        if self.mesh is not None:
            k, v = put_kv_pool(k, self.mesh), put_kv_pool(v, self.mesh)
        b = self.max_batch
        cache = kv_cache.KVCache(k=k, v=v, page_table=jnp.zeros((b, self.pages_per_seq), jnp.int32),
                                 lengths=jnp.zeros((b,), jnp.int32))
        self._lengths[:] = 0
        self._active[:] = False
        return PlainState(cache=cache, sampling=sampling.SamplingBatch.make(b, vocab=c.vocab_size),
                          last=jnp.zeros((b,), jnp.int32))

    # ---- jitted bodies -------------------------------------------------------------------------------------------
    def _prefill(self, params, state: PlainState, slot, tokens, n, cached, page_row, row: sampling.SamplingBatch, *,
                 npages: int):
        t = tokens.shape[0]
        view = kv_cache.KVCache(k=state.cache.k, v=state.cache.v, page_table=page_row[None, :npages],
                                lengths=cached[None])
        valid = (jnp.arange(t) < n)[None]  # bool[1, T]
        view, out = decode.prefill(params, self.cfg, view, tokens[None], valid, cache_attention=self.cache_attention)
        tok, sb = sampling.sample_next(out.logits, row)  # i32[1]; row: the request's fresh row (its own stream)
        cache = kv_cache.KVCache(k=view.k, v=view.v, page_table=state.cache.page_table.at[slot].set(page_row),
                                 lengths=state.cache.lengths.at[slot].set(cached + n))
        samp = jax.tree.map(lambda a, r: a.at[slot].set(r[0]), state.sampling, sb)
        return PlainState(cache=cache, sampling=samp, last=state.last.at[slot].set(tok[0])), tok[0]

    def _step(self, params, state: PlainState, active, *, nb: int, npages: int):
        c = state.cache
        view = kv_cache.KVCache(k=c.k, v=c.v, page_table=c.page_table[:nb, :npages], lengths=c.lengths[:nb])
        act = active[:nb]
        view, logits = decode.decode(params, self.cfg, view, state.last[:nb], act,
                                     cache_attention=self.cache_attention)
        sb = jax.tree.map(lambda a: a[:nb], state.sampling)
        tok, sb = sampling.sample_next(logits, sb, act)  # i32[nb]
        tok = jnp.where(act, tok, 0)
        samp = jax.tree.map(lambda a, r: a.at[:nb].set(r), state.sampling, sb)
        cache = kv_cache.KVCache(k=view.k, v=view.v, page_table=c.page_table, lengths=c.lengths.at[:nb].set(
            view.lengths))
        return PlainState(cache=cache, sampling=samp, last=state.last.at[:nb].set(
            jnp.where(act, tok, state.last[:nb]))), tok

    def _note_compile(self, key, t0):
        if key not in self._compiled:
            self._compiled.add(key)
            log.debug("compiled %s in %.2fs", key, time.perf_counter() - t0)

    # ---- protocol ------------------------------------------------------------------------------------------------
    def prefill(self, state, slot: int, tokens, page_row, row: sampling.SamplingRow, cached: int = 0):
        tokens = np.asarray(tokens, np.int32)
        page_row = np.asarray(page_row, np.int32)
        args = [self.row_batch(row, tokens)]
        pos, total, tok = int(cached), len(tokens), None
        if total <= pos:
            raise ValueError(f"prefill needs at least one uncached token (cached={pos}, tokens={total})")
        for n, t in self.prefill_chunks(total - pos, cached=pos > 0):
            npages = pick(self.page_buckets, -(-(pos + n) // self.page_size))
            chunk = np.zeros((t,), np.int32)
            chunk[:n] = tokens[pos:pos + n]
            t0 = time.perf_counter()
            with use_mesh(self.mesh):
                state, tok = self._prefill_jit(self.params, state, np.int32(slot), chunk, np.int32(n),
                                               np.int32(pos), page_row, *args, npages=npages)
            self._note_compile(("prefill", t, npages), t0)
            pos += n
        self._lengths[slot] = total
        self._active[slot] = True
        return state, int(tok)

    def launch(self, state, active):
        active = np.asarray(active, bool)
        idx = np.nonzero(active)[0]
        if len(idx) == 0:
            return state, Launched(active)
        nb = pick(self.batch_buckets, int(idx[-1]) + 1)
        longest = int(self._lengths[idx].max()) + 1
        npages = pick(self.page_buckets, -(-longest // self.page_size))
        t0 = time.perf_counter()
        with use_mesh(self.mesh):
            state, tok = self._step_jit(self.params, state, active, nb=nb, npages=npages)
        self._note_compile(("step", nb, npages), t0)
        self._lengths[idx] += 1  # one token per active slot: the mirror is exact at launch
        return state, Launched(active, nb, tok)

    def collect(self, launched: Launched, keep=None):
        return launched.read(1, keep)

    def release(self, state, slot: int):
        self._lengths[slot] = 0
        self._active[slot] = False
        return state

    def warmup(self, state, log_fn=log.info):
        """Compile every prefill bucket and every batch bucket at the shortest page bucket (the only one on the XLA
        path); returns the state."""
        t0 = time.perf_counter()
        state = self.warm_prefills(state)
        for nb in self.batch_buckets:
            active = np.zeros((self.max_batch,), bool)
            active[nb - 1] = True
            state = self.step_at_zero(state, active)
        log_fn(f"warmup: compiled {len(self.prefill_buckets)} prefill and {len(self.batch_buckets)} decode shapes in "
               f"{time.perf_counter() - t0:.1f}s")
        return state
