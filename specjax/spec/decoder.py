"""Speculative decoding front ends: offline ``speculative_generate`` and ``SpecRunner`` (the server's slot runner).

Both run the prompt through the target and the draft (``step.prefill``), then ``step.spec_step`` — a whole
draft-verify-commit step in one jitted call with the state donated. ``speculative_generate`` loops with
``step.generate_loop`` (a ``lax.while_loop`` that returns to Python only when every row is done); the runner does
one step per call because the server's scheduler adds and removes requests between steps.

Output convention (as ``specjax.generate``): generated tokens only, the stop token that ended a row included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import prompt_logprobs
from specjax import sampling as sampling_lib
from specjax.batching import MIN_PREFILL_BUCKET, pow2_bucket, validate_requests
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache
from specjax.models import target
from specjax.spec import draft as draft_lib
from specjax.spec import step as step_lib
from specjax.spec.draft import Draft
from specjax.kernels.tree_attention import make_cache_attention
from specjax.sharding import put_kv_pool, use_mesh

_JIT = {"prefill": (step_lib.prefill, ("state",)), "loop": (step_lib.generate_loop, ("state", "out")),
        "step": (step_lib.spec_step, ("state",))}


@functools.lru_cache(maxsize=None)
def _jitted(name: str, compiler_options: tuple = ()):
    """The jitted phase ``name`` (static: tcfg, scfg; state donated), optionally with XLA compiler options."""
    fn, donate = _JIT[name]
    return jax.jit(fn, static_argnames=("tcfg", "scfg"), donate_argnames=donate,
                   compiler_options=dict(compiler_options) or None)


def _options(compiler_options: dict | None) -> tuple:
    return tuple(sorted((compiler_options or {}).items()))

PREFILL_CHUNK = 512


def _as_draft(draft, algorithm: str, target_params) -> Draft:
    if isinstance(draft, Draft):
        return draft
    cfg, params, vocab = draft
    return draft_lib.make_draft(algorithm, cfg, params, target_params, vocab)


def speculative_generate(target_params: target.TargetParams, target_cfg: ModelConfig, draft, prompts, *,
                         algorithm: str = "EAGLE3", num_steps: int = 5, topk: int = 4, num_draft_tokens: int = 8,
                         max_new_tokens=128, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0,
                         stop_token_ids: Sequence[int] | None = None, page_size: int = 16,
                         attention_impl: str = "auto", sample_accept_fn=None, compiler_options: dict | None = None,
                         rows: Sequence[sampling_lib.SamplingRow] | None = None):
    """Speculative decoding of a batch of prompts (lists of token ids, any lengths).

    draft: a ``spec.draft.Draft`` or (draft_cfg, draft_params, vocab) as ``load_draft`` returns.
    ``max_new_tokens``, the sampling parameters and ``seed`` are scalars or one value per prompt (temperature 0 =
    greedy); each row stops on its own at a stop token or its own token budget.
    Returns (outputs list[list[int]], stats) with stats = {verify_steps: per row, accept_lengths: per row the tokens
    emitted by each verify step, completion_tokens: per row, tau: total completion tokens / total verify steps}.
    ``completion_tokens`` counts the first token (from prefill) too, as SGLang's spec_accept_length does.
    ``compiler_options``: XLA options for the jitted calls (tests use {"xla_backend_optimization_level": 0} to
    compile faster on CPU). ``sample_accept_fn``: tests only, replaces the sampling acceptance rule.
    ``rows``: one ``sampling.SamplingRow`` per prompt (penalties, logit_bias, min_new_tokens...), replacing the
    scalar sampling arguments.
    """
    if not prompts:
        return [], dict(verify_steps=[], accept_lengths=[], completion_tokens=[], tau=0.0)
    target_params = target.unstack_layers(target_params)  # one copy per call; pass unstacked params to skip it
    d = _as_draft(draft, algorithm, target_params)
    b = len(prompts)
    if rows is not None:
        temperature = [r.temperature for r in rows]
    may_sample = bool(np.any(np.broadcast_to(np.asarray(temperature, np.float32), (b,)) > 0))
    scfg = step_lib.SpecConfig(num_steps, topk, num_draft_tokens, make_cache_attention(attention_impl, target_cfg.sliding_window),
                               may_sample, sample_accept_fn)
    step_lib.check_compatible(target_cfg, d, scfg)
    budget = validate_requests(prompts, target_cfg.vocab_size, max_new_tokens, temperature, top_k, top_p,
                               min_p).astype(np.int32)
    if budget.max() == 0:
        return [[] for _ in prompts], dict(verify_steps=[0] * b, accept_lengths=[[] for _ in prompts],
                                           completion_tokens=[0] * b, tau=0.0)
    max_new_tokens = int(budget.max())
    lengths = np.asarray([len(p) for p in prompts])
    # Bucketed (multiples of 64 tokens) so that prompts of similar lengths share one compiled loop.
    bucket = max(64, page_size)
    max_len = -(-(int(lengths.max()) + max_new_tokens + num_steps + 2) // bucket) * bucket
    max_len = -(-max_len // page_size) * page_size
    state = step_lib.init_state(target_cfg, d, scfg, b, max_len, page_size=page_size)
    if rows is not None:
        for r in rows:
            r.validate(target_cfg.vocab_size)
        sb = sampling_lib.SamplingBatch.from_rows(rows, target_cfg.vocab_size, prompts, width=scfg.tokens_per_step)
    else:
        sb = sampling_lib.SamplingBatch.make(b, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                             seed=seed, vocab=target_cfg.vocab_size, width=scfg.tokens_per_step)
    state = dataclasses.replace(state, sampling=sb)

    chunk = pow2_bucket(int(lengths.max()), MIN_PREFILL_BUCKET, PREFILL_CHUNK)
    n_chunks = -(-int(lengths.max()) // chunk)
    full = np.zeros((b, n_chunks * chunk + 1), np.int32)
    for i, p in enumerate(prompts):
        full[i, :len(p)] = p
    first = np.zeros((b,), np.int32)
    prefill_fn = _jitted("prefill", _options(compiler_options))
    for c in range(n_chunks):
        lo, hi = c * chunk, (c + 1) * chunk
        toks = full[:, lo:hi]
        nxt = full[:, lo + 1:hi + 1]
        valid = np.arange(lo, hi)[None, :] < lengths[:, None]
        last = (lengths > lo) & (lengths <= hi)
        state, f = prefill_fn(target_params, target_cfg, d, scfg.for_prefill(), state, jnp.asarray(toks),
                              jnp.asarray(nxt), jnp.asarray(valid), jnp.asarray(last))
        first = np.where(last, np.asarray(f), first)

    stop = tuple(target_cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)
    cap = max_new_tokens
    out = step_lib.LoopOut(tokens=jnp.zeros((b, cap), jnp.int32).at[:, 0].set(jnp.asarray(first)),
                           num_tokens=jnp.asarray(np.minimum(budget, 1)), verify_steps=jnp.zeros((b,), jnp.int32),
                           step_counts=jnp.zeros((b, cap), jnp.int32))
    done = jnp.asarray(np.isin(first, np.asarray(stop)) | (budget <= 1))
    max_new = jnp.asarray(budget)
    state, out = _jitted("loop", _options(compiler_options))(target_params, target_cfg, d, scfg, state, out, done,
                                                             max_new, stop_ids)
    toks, num, steps, counts = (np.asarray(a) for a in (out.tokens, out.num_tokens, out.verify_steps,
                                                        out.step_counts))
    outputs = [toks[i, :num[i]].tolist() for i in range(b)]
    total_steps = int(steps.sum())
    stats = dict(verify_steps=steps.tolist(), completion_tokens=num.tolist(),
                 accept_lengths=[counts[i, :steps[i]].tolist() for i in range(b)],
                 tau=float(num.sum()) / total_steps if total_steps else 0.0)
    return outputs, stats


# ---- the server's runner ----------------------------------------------------------------------------------------
def _row(a, slot):
    return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0)


def _put_row(full, row, slot):
    return jax.lax.dynamic_update_slice_in_dim(full, row.astype(full.dtype), slot, axis=0)


_ROW_FIELDS = ("last_token", "root_h", "root_p", "root_ids")


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


@functools.partial(jax.jit, static_argnames=("tcfg", "scfg", "nb", "npages"), donate_argnames=("state",))
def _step_rows(tparams, tcfg, draft, scfg, state, active, *, nb: int, npages: int):
    """``spec_step`` on the first ``nb`` slots, reading the first ``npages`` page-table columns: the running batch is
    packed at the front (the scheduler hands out the lowest free slot), so a step costs what is running, not what
    could run. Returns (state, tokens i32[nb, S+1], counts i32[nb])."""
    c = state.cache
    view = step_lib.SpecState(
        cache=KVCache(k=c.k, v=c.v, page_table=c.page_table[:nb, :npages], lengths=c.lengths[:nb]),
        draft_k=state.draft_k, draft_v=state.draft_v, sampling=jax.tree.map(lambda a: a[:nb], state.sampling),
        **{f: getattr(state, f)[:nb] for f in _ROW_FIELDS})
    view, toks, counts = step_lib.spec_step(tparams, tcfg, draft, scfg, view, active[:nb])
    cache = KVCache(k=view.cache.k, v=view.cache.v, page_table=c.page_table,
                    lengths=c.lengths.at[:nb].set(view.cache.lengths))
    return step_lib.SpecState(
        cache=cache, draft_k=view.draft_k, draft_v=view.draft_v,
        sampling=jax.tree.map(lambda a, r: a.at[:nb].set(r), state.sampling, view.sampling),
        **{f: getattr(state, f).at[:nb].set(getattr(view, f)) for f in _ROW_FIELDS}), toks, counts


class SpecRunner:
    """EAGLE3 / EAGLE speculative decoding behind ``specjax.runner.Runner`` (one draft-verify-commit step per call,
    1..num_steps+1 tokens per slot). The target and draft pools share the page table, so the scheduler's page ids
    index both; it must give a slot pages for ``tokens_per_step`` positions beyond its length before a step."""

    def __init__(self, target_cfg: ModelConfig, target_params: target.TargetParams, algorithm: str, draft_cfg,
                 draft_params, vocab_map_or_token_map=None, *, num_steps: int, topk: int, num_draft_tokens: int,
                 max_batch: int, pages_per_seq: int, page_size: int, num_pages: int, attention_impl: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK, mesh=None):
        self.target_cfg = target_cfg
        # Per-layer weights (one copy at start-up): every verify forward reads them in place.
        self.target_params = target_params = target.unstack_layers(target_params)
        self.algorithm = algorithm.upper()
        # draft_cfg may be a built Draft (``specjax.preflight`` passes abstract shapes), else the head's parts.
        self.draft = _as_draft(draft_cfg if isinstance(draft_cfg, Draft) else
                               (draft_cfg, draft_params, vocab_map_or_token_map), self.algorithm, target_params)
        self.scfg = step_lib.SpecConfig(num_steps, topk, num_draft_tokens,
                                        make_cache_attention(attention_impl, target_cfg.sliding_window))
        step_lib.check_compatible(target_cfg, self.draft, self.scfg)
        self.max_batch, self.pages_per_seq, self.page_size, self.num_pages = max_batch, pages_per_seq, page_size, \
            num_pages
        self.tokens_per_step = num_steps + 1
        self.prefill_chunk = prefill_chunk
        self._seeds = sampling_lib.Seeds()
        self._lengths = np.zeros((max_batch,), np.int64)  # committed tokens per slot, mirrored on the host
        # On a (dp, tp) mesh the target params arrive sharded (weights.load_model(mesh=...)); the draft is small and
        # replicated, the KV pools are split over kv heads on tp like the attention weights.
        self.mesh = mesh
        if mesh is not None:
            self.draft = jax.tree.map(self._on_mesh, self.draft)

    def _on_mesh(self, x, spec=P()):
        if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == self.mesh:
            return x
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def init_state(self) -> step_lib.SpecState:
        state = step_lib.init_state(self.target_cfg, self.draft, self.scfg, self.max_batch,
                                    self.pages_per_seq * self.page_size, page_size=self.page_size,
                                    num_pages=self.num_pages)
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
        row = sampling_lib.SamplingRow.coerce(row)
        batch = sampling_lib.SamplingBatch.from_rows([row], self.target_cfg.vocab_size, [tokens],
                                                     width=self.tokens_per_step, seeds=[self._seeds.next(row)])
        state = _begin_slot(state, jnp.int32(slot), jnp.asarray(page_row, jnp.int32), jnp.int32(start), batch)
        rest = tokens[start:]
        nxt_all = np.concatenate([rest[1:], [0]]).astype(np.int32)
        first = 0
        pos = 0
        while pos < len(rest):
            t = pow2_bucket(len(rest) - pos, MIN_PREFILL_BUCKET, self.prefill_chunk)
            seg = rest[pos:pos + t]
            m = len(seg)
            toks = np.zeros((1, t), np.int32)
            nxt = np.zeros((1, t), np.int32)
            toks[0, :m] = seg
            nxt[0, :m] = nxt_all[pos:pos + m]
            valid = np.arange(t)[None, :] < m
            is_last = pos + m >= len(rest)
            with use_mesh(self.mesh):
                state, f = _prefill_slot(self.target_params, self.target_cfg, self.draft, self.scfg.for_prefill(),
                                         state, jnp.int32(slot), jnp.asarray(toks), jnp.asarray(nxt),
                                         jnp.asarray(valid), jnp.asarray([is_last]), jnp.asarray([int(cached)],
                                                                                                   jnp.int32))
            if is_last:
                first = int(f)
            pos += m
        self._lengths[slot] = n
        return state, first

    def step(self, state, active: np.ndarray):
        active = np.asarray(active, bool)
        b, w = self.max_batch, self.tokens_per_step
        idx = np.nonzero(active)[0]
        if len(idx) == 0:
            return state, np.zeros((b, w), np.int32), np.zeros((b,), np.int32)
        nb = pow2_bucket(int(idx[-1]) + 1, 1, b)
        longest = int(self._lengths[idx].max()) + w  # the tree reaches w positions past the committed length
        npages = pow2_bucket(-(-longest // self.page_size), 1, self.pages_per_seq)
        with use_mesh(self.mesh):
            state, toks, counts = _step_rows(self.target_params, self.target_cfg, self.draft, self.scfg, state,
                                             jnp.asarray(active), nb=nb, npages=npages)
        tokens = np.zeros((b, w), np.int32)
        num = np.zeros((b,), np.int32)
        tokens[:nb], num[:nb] = np.asarray(toks), np.asarray(counts)
        self._lengths += num
        return state, tokens, num

    def logprobs(self, state):
        """``sampling.read_logprobs`` of the slots: the logprobs of the tokens of the latest prefill / step."""
        return sampling_lib.read_logprobs(state.sampling)

    def prompt_logprobs(self, tokens, temperature: float):
        """``prompt_logprobs.prompt_logprobs`` of ``tokens`` under this runner's target."""
        return prompt_logprobs.prompt_logprobs(self.target_params, self.target_cfg, tokens, temperature, self.mesh)

    def release(self, state, slot: int):
        self._lengths[slot] = 0
        return _release_slot(state, jnp.int32(slot))


make_draft = draft_lib.make_draft

__all__ = ["speculative_generate", "SpecRunner", "make_draft"]
