"""SpecRunner: EAGLE3 / EAGLE speculative decoding behind the ``Runner`` protocol (serve/runners/base.py), one
draft-verify-commit step per call; the slots' rows are viewed and merged inside the jitted phases of
``specjax.speculative.spec_step``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import sampling as sampling_lib
from specjax.batching import PREFILL_CHUNK, page_buckets, pick, pow2_buckets
from specjax.config import ModelConfig
from specjax.kernels.tree_attention import make_cache_attention
from specjax.kv_cache import KVCache
from specjax.models import target
from specjax.serve.runners.base import Launched, RunnerCommon, prefill_buckets
from specjax.sharding import put_kv_pool, use_mesh
from specjax.speculative import draft as draft_lib, spec_step as step_lib
from specjax.speculative.draft import Draft
from specjax.speculative.tune import TreeChoice
from specjax.speculative.verify import LOSSLESS, Thresholds

log = logging.getLogger("specjax.serve")

def _row(a, slot):
    return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0)


def _put_row(full, row, slot):
    return jax.lax.dynamic_update_slice_in_dim(full, row.astype(full.dtype), slot, axis=0)


_ROW_FIELDS = ("last_token", "root_h", "root_feat", "root_stale")


def _slot_view(state: step_lib.SpecState, slot) -> step_lib.SpecState:
    cache = KVCache(k=state.cache.k, v=state.cache.v, page_table=_row(state.cache.page_table, slot),
                    lengths=_row(state.cache.lengths, slot))
    rows = {f: _row(getattr(state, f), slot) for f in _ROW_FIELDS}
    return step_lib.SpecState(cache=cache, draft_k=state.draft_k, draft_v=state.draft_v,
                              sampling=jax.tree.map(lambda a: _row(a, slot), state.sampling), **rows)


def _merge_slot(state: step_lib.SpecState, sub: step_lib.SpecState, slot) -> step_lib.SpecState:
    cache = KVCache(k=sub.cache.k, v=sub.cache.v, page_table=_put_row(state.cache.page_table, sub.cache.page_table,
                                                                       slot),
                    lengths=_put_row(state.cache.lengths, sub.cache.lengths, slot))
    rows = {f: _put_row(getattr(state, f), getattr(sub, f), slot) for f in _ROW_FIELDS}
    return step_lib.SpecState(cache=cache, draft_k=sub.draft_k, draft_v=sub.draft_v,
                              sampling=jax.tree.map(lambda a, r: _put_row(a, r, slot), state.sampling, sub.sampling),
                              **rows)


@functools.partial(jax.jit, static_argnames=("tcfg", "scfg"), donate_argnames=("state",))
def _prefill_slot(tparams, tcfg, draft, scfg, state, slot, tokens, next_tokens, valid, last, write_from):
    sub, first = step_lib.prefill(tparams, tcfg, draft, scfg, _slot_view(state, slot), tokens, next_tokens, valid,
                                  last, write_from)
    return _merge_slot(state, sub, slot), first[0]


@functools.partial(jax.jit, donate_argnames=("state",))
def _begin_slot(state, slot, page_row, start, sampling_row):
    cache = dataclasses.replace(state.cache, page_table=state.cache.page_table.at[slot].set(page_row),
                                lengths=state.cache.lengths.at[slot].set(start))
    sb = jax.tree.map(lambda a, r: _put_row(a, r, slot), state.sampling, sampling_row)
    return dataclasses.replace(state, cache=cache, sampling=sb)


@functools.partial(jax.jit, donate_argnames=("state",))
def _release_slot(state, slot):
    return dataclasses.replace(state, cache=dataclasses.replace(state.cache,
                                                                lengths=state.cache.lengths.at[slot].set(0)))


@functools.partial(jax.jit, static_argnames=("tcfg", "scfg", "nb", "npages", "draft_tokens"),
                   donate_argnames=("state",))
def _step_rows(tparams, tcfg, draft, scfg, state, active, *, nb: int, npages: int, draft_tokens: bool = True):
    """``spec_step`` (``target_step`` when not ``draft_tokens``) on the first ``nb`` slots, reading the first
    ``npages`` page-table columns: the running batch is packed at the front (the scheduler hands out the lowest free
    slot), so a step costs what is running, not what could run. Returns (state, tokens i32[nb, S+1], counts
    i32[nb])."""
    c = state.cache
    view = step_lib.SpecState(
        cache=KVCache(k=c.k, v=c.v, page_table=c.page_table[:nb, :npages], lengths=c.lengths[:nb]),
        draft_k=state.draft_k, draft_v=state.draft_v, sampling=jax.tree.map(lambda a: a[:nb], state.sampling),
        **{f: getattr(state, f)[:nb] for f in _ROW_FIELDS})
    step = step_lib.spec_step if draft_tokens else step_lib.target_step
    view, toks, counts = step(tparams, tcfg, draft, scfg, view, active[:nb])
    cache = KVCache(k=view.cache.k, v=view.cache.v, page_table=c.page_table,
                    lengths=c.lengths.at[:nb].set(view.cache.lengths))
    return step_lib.SpecState(
        cache=cache, draft_k=view.draft_k, draft_v=view.draft_v,
        sampling=jax.tree.map(lambda a, r: a.at[:nb].set(r), state.sampling, view.sampling),
        **{f: getattr(state, f).at[:nb].set(getattr(view, f)) for f in _ROW_FIELDS}), toks, counts


_CHOOSE = object()  # SpecRunner.step's default: the runner chooses the tree


class SpecRunner(RunnerCommon):
    """EAGLE3 / EAGLE speculative decoding behind the ``Runner`` protocol (one draft-verify-commit step per call,
    1..num_steps+1 tokens per slot). The target and draft pools share the page table, so the scheduler's page ids
    index both; it must give a slot pages for ``tokens_per_step`` positions beyond its length before a step.

    ``batch_shapes`` ({batch size: (num_steps, topk, num_draft_tokens) or None}, ``bench tune``'s table, or a
    ``tune.TreeChoice`` that re-decides it from the head's live acceptance) makes the tree follow the running batch:
    each step takes the entry of the largest listed size not above the step's batch bucket ``nb``, and None runs
    ``target_step`` (plain decoding that keeps the draft cache in step), so a batch large enough to be
    compute-bound stops paying for trees it cannot use. The bucket, not the number of running requests, because a
    step computes all ``nb`` rows: r running rows gain r x (tau - 1) tokens at the cost of an nb-row tree step, so
    the speedup over an nb-row plain step is the same for any r, and ``bench tune`` measured it with every row
    running. Every shape runs on one state sized for the widest of them; the output is
    the same token for token whatever shape a step takes. ``thresholds``: SGLang's relaxed acceptance of sampled
    rows (``verify.Thresholds``; the default is lossless)."""

    def __init__(self, target_cfg: ModelConfig, target_params: target.TargetParams, algorithm: str, draft_cfg,
                 draft_params, vocab_map_or_token_map=None, *, num_steps: int, topk: int, num_draft_tokens: int,
                 max_batch: int, pages_per_seq: int, page_size: int, num_pages: int, attention_impl: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK, mesh=None,
                 batch_shapes: dict[int, tuple[int, int, int] | None] | TreeChoice | None = None,
                 thresholds: Thresholds = LOSSLESS):
        self.target_cfg = target_cfg
        # Per-layer weights (one copy at start-up): every verify forward reads them in place.
        self.target_params = target_params = target.unstack_layers(target_params)
        self.algorithm = algorithm.upper()
        # draft_cfg may be a built Draft (``specjax.preflight`` passes abstract shapes), else the head's parts.
        self.draft = draft_lib.as_draft(draft_cfg if isinstance(draft_cfg, Draft) else
                               (draft_cfg, draft_params, vocab_map_or_token_map), self.algorithm, target_params)
        self.cache_attention = attend = make_cache_attention(attention_impl, target_cfg.sliding_window)
        self.scfg = step_lib.SpecConfig(num_steps, topk, num_draft_tokens, attend, thresholds=thresholds)
        # the tree of each step by batch bucket (None: every step runs self.scfg)
        self.trees = batch_shapes if isinstance(batch_shapes, TreeChoice) or not batch_shapes else \
            TreeChoice.fixed(batch_shapes)
        self._configs = {self.scfg.shape: self.scfg}  # every tree a step may run, by shape
        for shape in self.trees.shapes() if self.trees else ():
            self._configs.setdefault(shape, step_lib.SpecConfig(*shape, attend, thresholds=thresholds))
        shapes = list(self._configs.values())
        for c in shapes:
            step_lib.check_compatible(target_cfg, self.draft, c)
        self.max_batch, self.pages_per_seq, self.page_size, self.num_pages = max_batch, pages_per_seq, page_size, \
            num_pages
        self.tokens_per_step = max(c.tokens_per_step for c in shapes)
        self.prefill_chunk = prefill_chunk
        self.prefill_buckets = prefill_buckets(prefill_chunk, mesh)
        self.batch_buckets = pow2_buckets(1, max_batch)
        self.page_buckets = page_buckets(page_size, pages_per_seq, xla_path=attend is None)
        self._seeds = sampling_lib.Seeds()
        self._lengths = np.zeros((max_batch,), np.int64)  # committed tokens per slot, mirrored on the host
        self._inflight = np.zeros((max_batch,), np.int64)  # most tokens the launched, uncollected steps may add
        # On a (dp, tp) mesh the target params arrive sharded (weights.load_model(mesh=...)); the draft is small and
        # replicated, the KV pools are split over kv heads on tp like the attention weights.
        self.mesh = mesh
        if mesh is not None:
            self.draft = jax.tree.map(self._on_mesh, self.draft)
        self.prefill_draft = draft_lib.for_prefill(self.draft)

    def set_target_params(self, params) -> None:
        """New target weights of the same shapes, dtypes and shardings (``update_weights_from_disk``); the head is
        kept (an EAGLE head's vocabulary head is the target's lm_head, its FR-Spec rows: taken from the new one).
        Nothing recompiles."""
        params = target.unstack_layers(params)
        draft = self.draft
        if draft.algorithm == "EAGLE":  # built before anything is replaced: a failure leaves the old weights whole
            ids, v = np.asarray(draft.ids), target.lm_head_weight(params).shape[1]
            full = np.array_equal(ids, np.arange(v))  # every target id in order: no FR-Spec map
            lm_head = draft_lib.eagle_lm_head(params, None if full else draft.ids)
            draft = dataclasses.replace(draft, lm_head=self._on_mesh(lm_head) if self.mesh is not None else lm_head)
        prefill_draft = draft_lib.for_prefill(draft) if draft is not self.draft else self.prefill_draft
        self.target_params, self.draft, self.prefill_draft = params, draft, prefill_draft

    def _on_mesh(self, x, spec=P()):
        if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == self.mesh:
            return x
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def init_state(self) -> step_lib.SpecState:
        self._lengths[:] = self._inflight[:] = 0
        state = step_lib.init_state(self.target_cfg, self.draft, self.scfg, self.max_batch,
                                    self.pages_per_seq * self.page_size, page_size=self.page_size,
                                    num_pages=self.num_pages, width=self.tokens_per_step)
        if self.mesh is None:
            return state
        state = jax.tree.map(self._on_mesh, state)  # replicated, then the KV pools re-placed below
        put = lambda pool: put_kv_pool(pool, self.mesh)
        cache = dataclasses.replace(state.cache, k=put(state.cache.k), v=put(state.cache.v))
        return dataclasses.replace(state, cache=cache, draft_k=put(state.draft_k), draft_v=put(state.draft_v))

    def prefill(self, state, slot: int, tokens: np.ndarray, page_row: np.ndarray, row: sampling_lib.SamplingRow,
                cached: int = 0) -> tuple[Any, int]:
        tokens = np.asarray(tokens, np.int32)
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        if n + self.tokens_per_step > self.pages_per_seq * self.page_size:
            raise ValueError(f"prompt of {n} tokens leaves no room for a speculative step in "
                             f"{self.pages_per_seq * self.page_size} positions")
        # With a reused prefix, recompute its last token for its features (the draft pair at cached-1 needs the
        # next token, which differs between requests) without rewriting its target K/V.
        start = max(int(cached) - 1, 0) if cached else 0
        batch = self.row_batch(row, tokens, width=self.tokens_per_step)
        state = _begin_slot(state, jnp.int32(slot), np.asarray(page_row, np.int32), jnp.int32(start), batch)
        rest = tokens[start:]
        nxt_all = np.concatenate([rest[1:], [0]]).astype(np.int32)
        first = 0
        pos = 0
        for m, t in self.prefill_chunks(len(rest), cached=start > 0):
            seg = rest[pos:pos + m]
            toks = np.zeros((1, t), np.int32)
            nxt = np.zeros((1, t), np.int32)
            toks[0, :m] = seg
            nxt[0, :m] = nxt_all[pos:pos + m]
            valid = np.arange(t)[None, :] < m
            is_last = pos + m >= len(rest)
            with use_mesh(self.mesh):
                state, f = _prefill_slot(self.target_params, self.target_cfg, self.prefill_draft,
                                         self.scfg.for_prefill(), state, jnp.int32(slot), toks, nxt, valid,
                                         np.asarray([is_last]), np.asarray([int(cached)], np.int32))
            if is_last:
                first = int(f)
            pos += m
        self._lengths[slot], self._inflight[slot] = n, 0
        return state, first

    def launch(self, state, active: np.ndarray, tree=_CHOOSE):
        """Dispatch one step of the ``active`` slots; ``tree``: a (num_steps, topk, num_draft_tokens) shape or None
        (a target-only step); by default the runner chooses it for the batch bucket (``batch_shapes``)."""
        active = np.asarray(active, bool)
        w = self.tokens_per_step
        idx = np.nonzero(active)[0]
        if len(idx) == 0:
            return state, Launched(active)
        nb = pick(self.batch_buckets, int(idx[-1]) + 1)
        # the tree reaches w positions past the committed length, which steps in flight may each advance by w
        longest = min(int((self._lengths[idx] + self._inflight[idx]).max()) + w, self.pages_per_seq * self.page_size)
        npages = pick(self.page_buckets, -(-longest // self.page_size))
        scfg = self.shape_for(nb) if tree is _CHOOSE else None if tree is None else self._configs[tuple(tree)]
        with use_mesh(self.mesh):
            state, toks, counts = _step_rows(self.target_params, self.target_cfg, self.draft, scfg or self.scfg,
                                             state, active, nb=nb, npages=npages,
                                             draft_tokens=scfg is not None)
        self._inflight[idx] += w
        chosen = scfg.shape if scfg is not None and tree is _CHOOSE else None  # recorded for the live acceptance
        drafts = scfg.num_draft_tokens - 1 if scfg is not None else 0
        return state, Launched(active, nb, toks, counts, chosen, drafts)

    def collect(self, launched: Launched, keep=None):
        keep = launched.kept(keep)
        tokens, num = launched.read(self.tokens_per_step, keep)
        self._lengths += num
        self._inflight[keep] -= self.tokens_per_step
        if self.trees is not None and launched.shape is not None:
            self.trees.record(launched.shape, int(num.sum()), int(keep.sum()))
        return tokens, num

    def warmup(self, state, log_fn=log.info):
        """Compile every prefill bucket, and the step of every batch bucket (in its tree shape) at the shortest page
        bucket (the only one on the XLA path); returns the state."""
        t0 = time.perf_counter()
        state = self.warm_prefills(state)
        steps = 0
        for nb in self.batch_buckets:
            active = np.zeros((self.max_batch,), bool)
            active[nb - 1] = True  # the bucket's highest slot runs, so the step takes this bucket (and its shape)
            for tree in self.trees.options(nb) if self.trees else [self.scfg.shape]:
                state = self.step_at_zero(state, active, tree=tree)
                steps += 1
        log_fn(f"warmup: compiled {len(self.prefill_buckets)} prefill and {steps} step shapes in "
               f"{time.perf_counter() - t0:.1f}s")
        return state

    def shape_for(self, nb: int) -> step_lib.SpecConfig | None:
        """The tree shape of a step over batch bucket ``nb`` (None: a target-only step)."""
        if self.trees is None:
            return self.scfg
        tree = self.trees.choose(nb)
        return None if tree is None else self._configs[tree]

    def release(self, state, slot: int):
        self._lengths[slot] = self._inflight[slot] = 0
        return _release_slot(state, jnp.int32(slot))
