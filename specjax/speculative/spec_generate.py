"""Offline speculative decoding: ``speculative_generate`` over a batch of prompts (the server's slot runner,
``specjax.serve.runners.spec.SpecRunner``, drives the same jitted phases one step at a time).

Both run the prompt through the target and the draft (``step.prefill``), then ``step.spec_step`` — a whole
draft-verify-commit step in one jitted call with the state donated. ``speculative_generate`` loops with
``step.generate_loop`` (a ``lax.while_loop`` that returns to Python only when every row is done); the runner does
one step per call because the server's scheduler adds and removes requests between steps.

Output convention (as ``specjax.generate``): generated tokens only, the stop token that ended a row included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache, sampling as sampling_lib
from specjax.batching import capacity_for, prefill_plan, validate_requests
from specjax.config import ModelConfig
from specjax.kernels.tree_attention import make_cache_attention
from specjax.models import target
from specjax.sharding import committed_device
from specjax.speculative import draft as draft_lib, spec_step as step_lib, verify as verify_lib

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

def _prefill_prompts(target_params, target_cfg: ModelConfig, d, scfg, state, prompts, options: tuple):
    """Run the prompts through target and draft in ``batching.prefill_plan``'s chunks; returns (state, first token
    per row)."""
    tokens, plan = prefill_plan(prompts)
    first = np.zeros((len(prompts),), np.int32)
    prefill_fn = _jitted("prefill", options)
    for lo, hi, valid, last in plan:
        state, f = prefill_fn(target_params, target_cfg, d, scfg.for_prefill(), state, jnp.asarray(tokens[:, lo:hi]),
                              jnp.asarray(tokens[:, lo + 1:hi + 1]), jnp.asarray(valid), jnp.asarray(last))
        first = np.where(last, np.asarray(f), first)
    return state, first


def speculative_generate(target_params: target.TargetParams, target_cfg: ModelConfig, draft, prompts, *,
                         algorithm: str = "EAGLE3", num_steps: int = 5, topk: int = 4, num_draft_tokens: int = 8,
                         max_new_tokens=128, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0,
                         stop_token_ids: Sequence[int] | None = None, page_size: int | None = None,
                         attention_impl: str = "auto", sample_accept_fn=None, compiler_options: dict | None = None,
                         rows: Sequence[sampling_lib.SamplingRow] | None = None, capacity: int | None = None,
                         thresholds: verify_lib.Thresholds = verify_lib.LOSSLESS):
    """Speculative decoding of a batch of prompts (lists of token ids, any lengths).

    draft: a ``speculative.draft.Draft`` or (draft_cfg, draft_params, vocab) as ``load_draft`` returns.
    ``max_new_tokens``, the sampling parameters and ``seed`` are scalars or one value per prompt (temperature 0 =
    greedy); each row stops on its own at a stop token or its own token budget.
    Returns (outputs list[list[int]], stats) with stats = {verify_steps: per row, accept_lengths: per row the tokens
    emitted by each verify step, completion_tokens: per row, tau: total completion tokens / total verify steps}.
    ``completion_tokens`` counts the first token (from prefill) too, as SGLang's spec_accept_length does.
    ``compiler_options``: XLA options for the jitted calls (tests use {"xla_backend_optimization_level": 0} to
    compile faster on CPU). ``sample_accept_fn``: tests only, replaces the sampling acceptance rule.
    ``rows``: one ``sampling.SamplingRow`` per prompt (penalties, logit_bias, min_new_tokens...), replacing the
    scalar sampling arguments. ``page_size``: slots per KV page (default: ``kv_cache.default_page_size``).
    ``capacity``: size the cache and output buffers for this many new tokens instead of the call's largest
    ``max_new_tokens`` (as ``specjax.generate.generate``): a short call then compiles the programs of a longer one.
    ``thresholds``: SGLang's relaxed acceptance of the sampled rows (``verify.Thresholds``; default lossless).
    """
    if not prompts:
        return [], dict(verify_steps=[], accept_lengths=[], completion_tokens=[], tau=0.0)
    target_params = target.unstack_layers(target_params)  # one copy per call; pass unstacked params to skip it
    d = draft_lib.as_draft(draft, algorithm, target_params)
    b = len(prompts)
    if rows is not None:
        temperature = [r.temperature for r in rows]
    may_sample = bool(np.any(np.broadcast_to(np.asarray(temperature, np.float32), (b,)) > 0))
    scfg = step_lib.SpecConfig(num_steps, topk, num_draft_tokens,
                               make_cache_attention(attention_impl, target_cfg.sliding_window), may_sample,
                               sample_accept_fn, thresholds)
    step_lib.check_compatible(target_cfg, d, scfg)
    budget = validate_requests(prompts, target_cfg.vocab_size, max_new_tokens, temperature, top_k, top_p,
                               min_p).astype(np.int32)
    if budget.max() == 0:
        return [[] for _ in prompts], dict(verify_steps=[0] * b, accept_lengths=[[] for _ in prompts],
                                           completion_tokens=[0] * b, tau=0.0)
    room = capacity_for(budget, capacity)
    page_size = page_size or kv_cache.default_page_size(target_cfg.head_dim, target_cfg.dtype, jax.default_backend())
    lengths = np.asarray([len(p) for p in prompts])
    # Bucketed (multiples of 64 tokens) so that prompts of similar lengths share one compiled loop.
    bucket = max(64, page_size)
    max_len = -(-(int(lengths.max()) + room + num_steps + 2) // bucket) * bucket
    max_len = -(-max_len // page_size) * page_size
    state = step_lib.init_state(target_cfg, d, scfg, b, max_len, page_size=page_size)
    if rows is not None:
        for r in rows:
            r.validate(target_cfg.vocab_size)
        sb = sampling_lib.SamplingBatch.from_rows(rows, target_cfg.vocab_size, prompts, width=scfg.tokens_per_step)
    else:
        sb = sampling_lib.SamplingBatch.make(b, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                             seed=seed, vocab=target_cfg.vocab_size, width=scfg.tokens_per_step)
    # committed as the prefill chunks' outputs will be, so that every chunk runs one compiled program
    state = jax.device_put(dataclasses.replace(state, sampling=sb), committed_device(target_params, d))

    state, first = _prefill_prompts(target_params, target_cfg, d, scfg, state, prompts,
                                    _options(compiler_options))
    stop = tuple(target_cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)
    out = step_lib.LoopOut(tokens=jnp.zeros((b, room), jnp.int32).at[:, 0].set(jnp.asarray(first)),
                           num_tokens=jnp.asarray(np.minimum(budget, 1)), verify_steps=jnp.zeros((b,), jnp.int32),
                           step_counts=jnp.zeros((b, room), jnp.int32))
    done = np.isin(first, np.asarray(stop)) | (budget <= 1)
    if not done.all():  # every row done after its first token (e.g. max_new_tokens=1): no loop to compile or run
        state, out = _jitted("loop", _options(compiler_options))(target_params, target_cfg, d, scfg, state, out,
                                                                 jnp.asarray(done), jnp.asarray(budget), stop_ids)
    toks, num, steps, counts = (np.asarray(a) for a in (out.tokens, out.num_tokens, out.verify_steps,
                                                        out.step_counts))
    outputs = [toks[i, :num[i]].tolist() for i in range(b)]
    total_steps = int(steps.sum())
    stats = dict(verify_steps=steps.tolist(), completion_tokens=num.tolist(),
                 accept_lengths=[counts[i, :steps[i]].tolist() for i in range(b)],
                 tau=float(num.sum()) / total_steps if total_steps else 0.0)
    return outputs, stats
