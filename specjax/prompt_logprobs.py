"""Log-probabilities of a prompt's own tokens (OpenAI completions ``echo`` + ``logprobs``, SGLang's
``input_token_logprobs`` from ``logprob_start_len``): one causal target forward over the prompt, outside the KV pool.

Token i > 0 gets log_softmax(logits after token i-1 / temperature)[token i] (temperature 1 for greedy requests, no
penalties: they depend on the output) and the ``sampling.TOP_LOGPROBS`` most likely tokens of that distribution;
token 0 has no context and gets None, as in SGLang and OpenAI. Prompts are padded to a power of two (>= 16), so a
handful of compiled programs cover every length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.config import ModelConfig
from specjax.models import target
from specjax.sharding import use_mesh


@functools.partial(jax.jit, static_argnames=("cfg",))
def _score(params, cfg: ModelConfig, tokens, n, temperature):
    t = tokens.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    out = target.forward(params, cfg, tokens, positions, valid=positions < n)
    lp = jax.nn.log_softmax(out.logits[0, :-1].astype(jnp.float32) / temperature, axis=-1)  # predicts tokens[1:]
    top_lp, top_ids = jax.lax.top_k(lp, min(sampling.TOP_LOGPROBS, lp.shape[-1]))
    return jnp.take_along_axis(lp, tokens[0, 1:, None], axis=-1)[:, 0], top_lp, top_ids


def prompt_logprobs(params, cfg: ModelConfig, tokens, temperature: float = 0.0, mesh=None) -> list:
    """[(None, tokens[0], None), (logprob of tokens[1], tokens[1], top), ...] under the request's temperature;
    ``top``: [(logprob, token id), ...] of the most likely tokens at that position, best first."""
    tokens = [int(t) for t in tokens]
    n = len(tokens)
    t = max(16, 1 << (n - 1).bit_length())
    padded = np.zeros((1, t), np.int32)
    padded[0, :n] = tokens
    temp = np.float32(temperature if temperature > 0 else 1.0)
    with use_mesh(mesh):
        lp, top_lp, top_ids = (np.asarray(a) for a in _score(params, cfg, padded, np.int32(n), temp))
    return [(None, tokens[0], None)] + [
        (float(lp[i]), tokens[i + 1], list(zip(top_lp[i].tolist(), top_ids[i].tolist()))) for i in range(n - 1)]
