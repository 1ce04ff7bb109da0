"""Full-size configs without memory: ``jax.eval_shape`` of the params and of a forward pass for the published
Qwen2.5-7B and Llama-3.1-8B configs shipped in configs/models/."""

import math
import os

import jax
import jax.numpy as jnp
import pytest

from specjax.config import ModelConfig, default_aux_layer_ids
from specjax.models import target

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")

# name -> (config file, exact parameter count of the published checkpoint, default EAGLE3 aux layer ids)
MODELS = {
    "qwen2.5-7b": ("qwen2.5-7b.json", 7_615_616_512, (1, 13, 24)),
    "llama-3.1-8b": ("llama-3.1-8b.json", 8_030_261_248, (1, 15, 28)),
}


def _cfg(name):
    return ModelConfig.from_pretrained(os.path.join(CONFIGS, MODELS[name][0]))


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count(name):
    cfg = _cfg(name)
    want = MODELS[name][1]
    shapes = jax.eval_shape(lambda k: target.init_params(cfg, k), jax.random.PRNGKey(0))
    n = _count(shapes)
    assert abs(n - want) / want < 0.005, (n, want)
    assert n == cfg.num_params() == _count(target.param_shapes(cfg))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name", list(MODELS))
def test_default_aux_layers(name):
    cfg = _cfg(name)
    assert default_aux_layer_ids(cfg.num_layers) == MODELS[name][2]


def test_qwen25_7b_config():
    cfg = _cfg("qwen2.5-7b")
    assert (cfg.family, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == ("qwen2", 3584, 18944, 28)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (28, 4, 128, 152064)
    assert cfg.qkv_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-6, 32768)
    assert cfg.rope_scaling is None and cfg.sliding_window is None
    shapes = target.param_shapes(cfg)
    assert shapes.layers.wq.shape == (28, 3584, 28, 128)
    assert shapes.layers.bk.shape == (28, 4, 128)
    assert shapes.lm_head.shape == (3584, 152064)


def test_llama31_8b_config():
    cfg = _cfg("llama-3.1-8b")
    assert (cfg.family, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == ("llama", 4096, 14336, 32)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 128256)
    assert not cfg.qkv_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (5e5, 131072)
    assert cfg.rope_scaling_dict == dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert target.param_shapes(cfg).layers.wk.shape == (32, 4096, 8, 128)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_shapes(name):
    """Trace (not run) a full-size forward with the default aux layers: logits [B, T, V], aux [B, T, 3*D]."""
    cfg = _cfg(name)
    params = target.param_shapes(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    out = jax.eval_shape(lambda p, t: target.forward(p, cfg, t, jnp.broadcast_to(jnp.arange(16), t.shape),
                                                     aux_layers=()), params, tokens)
    assert out.logits.shape == (2, 16, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.aux.shape == (2, 16, 3 * cfg.hidden_size) and out.aux.dtype == jnp.bfloat16
