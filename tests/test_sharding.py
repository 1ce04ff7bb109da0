"""Tensor + data parallel forward on 16 fake CPU devices equals the single-device forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hf_tiny_models import build
from specjax.config import ModelConfig
from specjax.models import target
from specjax.sharding import ShardingError, kv_pool_sharding, make_mesh, put_kv_pool, use_mesh
from specjax.weights import load_model, load_target_params, param_shardings, shard_params

BATCH, SEQ, VOCAB = 16, 8, 256
# 8 query heads and 4 kv heads: at tp=8 the kv heads fall back to replication, at tp=2/4 they are sharded.
TINY = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB)
MESHES = [(4, 4), (8, 2), (2, 8)]  # (dp, tp)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_tp")
    build("llama", folder, config=TINY)
    cfg, params = load_model(str(folder), dtype="float32")
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    return str(folder), cfg, params, tokens


def _forward(params, cfg, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = target.forward(params, cfg, tokens, positions, aux_layers=())
    return out.logits, out.aux


@pytest.fixture(scope="module")
def reference(model):
    _, cfg, params, tokens = model
    dev = jax.devices()[0]
    logits, aux = jax.jit(_forward, static_argnums=1)(jax.device_put(params, dev), cfg, jax.device_put(tokens, dev))
    return np.asarray(logits), np.asarray(aux)


@pytest.mark.parametrize("dp,tp", MESHES)
def test_sharded_forward_matches_single_device(model, reference, dp, tp):
    _, cfg, params, tokens = model
    mesh = make_mesh(dp, tp)
    p_shard = param_shardings(cfg, mesh)
    batch = NamedSharding(mesh, P("dp", None))
    fn = jax.jit(lambda p, t: _forward(p, cfg, t), in_shardings=(p_shard, batch))
    with use_mesh(mesh):
        logits, aux = fn(shard_params(params, cfg, mesh), jax.device_put(tokens, batch))
    assert logits.sharding.mesh.shape == {"dp": dp, "tp": tp}
    np.testing.assert_allclose(np.asarray(logits), reference[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(aux), reference[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dp,tp", [(4, 4), (2, 8)])
def test_load_straight_onto_mesh(model, dp, tp):
    folder, cfg, params, _ = model
    mesh = make_mesh(dp, tp)
    sharded = load_target_params(folder, cfg, mesh)
    want_shardings = param_shardings(cfg, mesh)
    for got, want, sh in zip(jax.tree.leaves(sharded), jax.tree.leaves(params), jax.tree.leaves(want_shardings)):
        assert got.sharding == sh
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wq = sharded.layers.wq.sharding.spec  # [L, D, N, H]: heads over tp
    assert wq[2] == "tp"
    wk = sharded.layers.wk.sharding.spec  # 4 kv heads: sharded at tp=4, replicated at tp=8
    assert (wk[2] if len(wk) > 2 else None) == ("tp" if tp == 4 else None)


def _cfg(**kw):
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=48, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6)
    return ModelConfig.from_hf_dict({**hf, **kw}, dtype="float32")


def test_indivisible_heads_raise():
    cfg = _cfg()
    with pytest.raises(ShardingError, match=r"dimension heads=6 does not divide by mesh axis tp=4"):
        param_shardings(cfg, make_mesh(4, 4))
    with pytest.raises(ShardingError, match="heads=6"):
        shard_params(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target.param_shapes(cfg)), cfg,
                     make_mesh(4, 4))
    param_shardings(cfg, make_mesh(8, 2))  # 6 heads divide by tp=2


def test_indivisible_vocab_raises():
    with pytest.raises(ShardingError, match=r"dimension vocab=250 does not divide by mesh axis tp=4"):
        param_shardings(_cfg(num_attention_heads=4, num_key_value_heads=4, vocab_size=250), make_mesh(4, 4))


def test_kv_pool_split_over_kv_heads_on_tp():
    """[L, P, K, Z, H] pools: split over K on tp when it divides (as the attention weights), else replicated."""
    assert kv_pool_sharding(make_mesh(4, 4), (2, 8, 4, 4, 16)).spec == P(None, None, "tp", None, None)
    assert kv_pool_sharding(make_mesh(2, 8), (2, 8, 4, 4, 16)).spec == P(None, None, None, None, None)
    pool = put_kv_pool(jnp.zeros((2, 8, 4, 4, 16)), make_mesh(8, 2))
    assert {s.data.shape for s in pool.addressable_shards} == {(2, 8, 2, 4, 16)}


def test_generate_on_mesh_matches_single_device(model):
    from specjax.generate import generate
    folder, cfg, params, tokens = model
    prompts = [list(map(int, tokens[i, : 3 + i])) for i in range(4)]
    want = generate(params, cfg, prompts, max_new_tokens=6, stop_token_ids=())
    mesh = make_mesh(4, 4)
    got = generate(load_target_params(folder, cfg, mesh), cfg, prompts, max_new_tokens=6, stop_token_ids=(),
                   mesh=mesh)
    assert got == want
