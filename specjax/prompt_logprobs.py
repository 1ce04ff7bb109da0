"""Log-probabilities of a prompt's own tokens (OpenAI completions ``echo`` + ``logprobs``, SGLang's
``input_token_logprobs`` from ``logprob_start_len``), scored chunk by chunk against the prompt's K/V in the paged pool.

Token i > 0 gets log_softmax(logits after token i-1 / temperature)[token i] (temperature 1 for greedy requests, no
penalties: they depend on the output), the ``sampling.TOP_LOGPROBS`` most likely tokens of that distribution and the
logprobs of the ids the request names (SGLang's ``token_ids_logprob``); token 0 has no context and gets None, as in
SGLang and OpenAI.

Scoring runs after the prompt's prefill has written its K/V: a chunk of positions [c, c + n) is one forward over those
tokens that reads the prefix [0, c) from the pool and writes nothing, so its compiled programs are the prefill's
shape buckets (bounded, whatever the prompt's length), the logits it holds are [chunk, V] rather than [prompt, V],
and the scheduler spreads a long prompt's chunks over its rounds as it does prefill chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.batching import pick
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache
from specjax.models import target
from specjax.sharding import use_mesh


@functools.partial(jax.jit, static_argnames=("cfg", "npages", "cache_attention"))
def _score_chunk(params, cfg: ModelConfig, k, v, page_row, tokens, next_tokens, n, start, temperature, ids, *,
                 npages: int, cache_attention=None):
    """(logprob of next_tokens[j], top logprobs, top ids, logprobs of ``ids`` i32[K]) after tokens[j] at position
    start + j, for j < n (the rest padding); the prefix [0, start) is read from the pool (``page_row``), nothing is
    written."""
    t = tokens.shape[0]
    view = KVCache(k=k, v=v, page_table=page_row[None, :npages], lengths=start[None])
    positions = start + jnp.arange(t, dtype=jnp.int32)
    out = target.forward(params, cfg, tokens[None], positions[None], cache=view,
                         valid=(jnp.arange(t) < n)[None], return_kv=False, cache_attention=cache_attention)
    lp = jax.nn.log_softmax(out.logits[0].astype(jnp.float32) / temperature, axis=-1)  # [T, V]
    top_lp, top_ids = jax.lax.top_k(lp, min(sampling.TOP_LOGPROBS, lp.shape[-1]))
    return jnp.take_along_axis(lp, next_tokens[:, None], axis=-1)[:, 0], top_lp, top_ids, lp[:, ids]


def score_prompt(params, cfg: ModelConfig, cache: KVCache, page_row, tokens, begin: int, count: int,
                 temperature: float, *, buckets: list[int], page_size: int, page_buckets: list[int],
                 cache_attention=None, mesh=None, logprob_ids=()) -> list:
    """Entries [(logprob of tokens[p + 1], tokens[p + 1], top, by_id), ...] for positions p in [begin, begin +
    count) (< len(tokens) - 1), whose K/V the pool already holds under ``page_row``; ``top``: [(logprob, token id),
    ...] best first; ``by_id``: the logprobs of ``logprob_ids``, in their order. Chunks of at most the largest of
    ``buckets`` (the runner's prefill buckets)."""
    tokens = np.asarray(tokens, np.int32)
    if begin < 0 or count < 0 or begin + count > len(tokens) - 1:
        raise ValueError(f"positions [{begin}, {begin + count}) are not inside the prompt's first "
                         f"{len(tokens) - 1} positions")
    temp = np.float32(temperature if temperature > 0 else 1.0)
    page_row = np.asarray(page_row, np.int32)
    ids = np.zeros((sampling.MAX_TOKEN_IDS_LOGPROB,), np.int32)  # one shape for every request: no recompiles
    ids[:len(logprob_ids)] = logprob_ids
    entries, pos = [], begin
    while pos < begin + count:
        n = min(begin + count - pos, buckets[-1])
        t = pick(buckets, n)
        chunk, nxt = np.zeros((t,), np.int32), np.zeros((t,), np.int32)
        chunk[:n], nxt[:n] = tokens[pos:pos + n], tokens[pos + 1:pos + n + 1]
        npages = pick(page_buckets, -(-(pos + n) // page_size))
        with use_mesh(mesh):
            lp, top_lp, top_ids, by_id = (np.asarray(a) for a in _score_chunk(
                params, cfg, cache.k, cache.v, page_row, chunk, nxt, np.int32(n), np.int32(pos), temp, ids,
                npages=npages, cache_attention=cache_attention))
        entries += [(float(lp[j]), int(nxt[j]), list(zip(top_lp[j].tolist(), top_ids[j].tolist())),
                     by_id[j, :len(logprob_ids)].tolist()) for j in range(n)]
        pos += n
    return entries
