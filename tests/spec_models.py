"""Tiny targets and draft heads for the speculative-decoding tests.

``bigram_models`` builds a target whose next token is, most of the time, a fixed permutation ``perm`` of the current
one (plus a context-dependent part from small random layers and a random lm_head component, so the target does
deviate), and EAGLE3 / EAGLE heads built in closed form to predict that permutation, so acceptance is non-trivial
without training:
- embeddings are sqrt(D) * the rows of a random orthogonal matrix (V == D), so rms-normed embeddings stay exact;
- EAGLE3: fc picks the first aux feature (~ E[x_t]); the midlayer's SwiGLU is a lookup table that maps E[x] to
  E[perm x] (gate/up match E[x], down writes E[perm x] - E[x]); the head's lm_head reads perm again. So the head at
  the pair (aux_t, x_{t+1}) predicts perm(perm(x_t)) = x_{t+2} when the target follows perm, and a fed-back h keeps
  stepping along perm;
- EAGLE: fc passes the token embedding through, the layer adds almost nothing, and the target's lm_head gives
  perm(token): the draft proposes the target's bigram guess.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models import eagle, eagle3, random_params, target


def tiny_config(vocab: int = 64, hidden: int = 64, layers: int = 2, dtype: str = "float32") -> ModelConfig:
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0)
    return ModelConfig.from_hf_dict(hf, dtype=dtype)


def np_init(shapes, seed: int, scale: float):
    """Random params from a ``param_shapes`` tree with numpy (eager jax.random would compile once per shape)."""
    rng = np.random.default_rng(seed)
    normal = lambda _key, shape, dtype, scale: jnp.asarray(rng.normal(size=shape) * scale, dtype)
    return random_params(shapes, jax.random.PRNGKey(0), scale, normal=normal)


def random_models(cfg: ModelConfig, seed: int = 0, target_scale: float = 0.3, draft_vocab: int | None = None):
    """Random target, EAGLE3 head and EAGLE head; with ``draft_vocab`` < V both heads see a random subset (EAGLE3 d2t
    map, EAGLE FR-Spec hot ids)."""
    tp = np_init(target.param_shapes(cfg), seed, target_scale)
    e3cfg = eagle3.Eagle3Config.from_target(cfg, draft_vocab_size=draft_vocab or cfg.vocab_size)
    e3 = np_init(eagle3.param_shapes(e3cfg), seed + 1, 0.3)
    rng = np.random.default_rng(seed)
    used = np.sort(rng.choice(cfg.vocab_size, e3cfg.draft_vocab_size, replace=False))
    vmap = eagle3.VocabMap.from_used_ids(used, cfg.vocab_size)
    ecfg = eagle.EagleConfig.from_target(cfg)
    e1 = np_init(eagle.param_shapes(ecfg), seed + 2, 0.3)
    hot = used.astype(np.int32) if e3cfg.draft_vocab_size < cfg.vocab_size else None
    return tp, (e3cfg, e3, vmap), (ecfg, e1, hot)


def bigram_models(cfg: ModelConfig, seed: int = 0, beta: float = 0.5, noise: float = 0.3, layer_scale: float = 0.13,
                  draft_vocab: int | None = None):
    """(target params, perm, (EAGLE3 cfg, params, VocabMap), (EAGLE cfg, params, hot ids)); needs V == D.
    ``draft_vocab`` < V restricts both heads to a random subset of the vocab (EAGLE3 d2t map / EAGLE FR-Spec hot
    ids), which costs acceptance where the target's next token falls outside it."""
    v, d, f = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    assert v == d and f >= v, "the closed-form heads need vocab == hidden and intermediate >= vocab"
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    emb = np.sqrt(d) * q  # [V, D] rows with rms 1, mutually orthogonal
    perm = rng.permutation(v)
    pinv = np.argsort(perm)
    tp = np_init(target.param_shapes(cfg), seed, layer_scale)
    lm = beta * emb[pinv].T / np.sqrt(d) + noise * rng.normal(size=(d, v)) / np.sqrt(d)  # [D, V]
    tp = dataclasses.replace(tp, embed=jnp.asarray(emb, jnp.float32), lm_head=jnp.asarray(lm, jnp.float32))

    vd = draft_vocab or v
    used = np.sort(rng.choice(v, vd, replace=False)) if vd < v else np.arange(v)

    # EAGLE3 head.
    e3cfg = eagle3.Eagle3Config.from_target(cfg, draft_vocab_size=vd)
    e3 = np_init(eagle3.param_shapes(e3cfg), seed + 1, 0.02)
    fc = np.zeros((3 * d, d))
    fc[:d] = np.eye(d)
    c = 4.0
    silu_c = c / (1 + np.exp(-c))
    w_gate = np.zeros((d, f))
    w_up = np.zeros((d, f))
    w_down = np.zeros((f, d))
    w_gate[:, :v] = c * emb.T / d
    w_up[:, :v] = emb.T / d
    w_down[:v] = (emb[perm] - emb) / silu_c
    mid = dataclasses.replace(e3.layers[0], w_gate=jnp.asarray(w_gate, jnp.float32),
                              w_up=jnp.asarray(w_up, jnp.float32), w_down=jnp.asarray(w_down, jnp.float32))
    e3 = dataclasses.replace(e3, fc=jnp.asarray(fc, jnp.float32), layers=[mid],
                             lm_head=jnp.asarray(2.0 * emb[pinv[used]].T / np.sqrt(d), jnp.float32))

    # EAGLE head.
    ecfg = eagle.EagleConfig.from_target(cfg)
    e1 = np_init(eagle.param_shapes(ecfg), seed + 2, 0.02)
    fc1 = np.zeros((2 * d, d))
    fc1[:d] = np.eye(d)
    e1 = dataclasses.replace(e1, fc=jnp.asarray(fc1, jnp.float32), fc_bias=jnp.zeros((d,), jnp.float32))
    hot = None if vd == v else used.astype(np.int32)
    return tp, perm, (e3cfg, e3, eagle3.VocabMap.from_used_ids(used, v)), (ecfg, e1, hot)
