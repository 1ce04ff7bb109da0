"""The jitted EAGLE3 train step (train/train_step.py) on a tiny random target: it learns, gradient accumulation is
exact, a 4x4 (dp x tp) mesh of fake CPU devices matches one device, the offline step matches the online one, and a run
is reproducible from its seed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.models import eagle3, target
from specjax.sharding import make_mesh
from specjax.train import train_step as S
from specjax.train.loss import pool_metrics

V, T, TTT = 256, 32, 3


@pytest.fixture(scope="module")
def setup():
    tcfg = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=V, hidden_size=64,
                       intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                       dtype="float32")
    tparams = target.init_params(tcfg, jax.random.PRNGKey(0))
    tparams.final_norm = tparams.final_norm * 20  # peaked target distributions, so there is something to learn
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=128, dtype="float32")

    # Synthetic chats: a random walk over 32 token types with two successors each; the first 8 tokens are "prompt"
    # (loss mask 0) and every 4th sequence is right-padded.
    rng = np.random.default_rng(0)
    n = 64
    types = rng.choice(V, 32, replace=False)
    succ = rng.integers(0, 32, size=(32, 2))
    ids = np.zeros((n, T), np.int32)
    for i in range(n):
        x = rng.integers(32)
        for t in range(T):
            ids[i, t] = types[x]
            x = succ[x, rng.integers(2)]
    am = np.ones((n, T), np.int32)
    am[::4, -6:] = 0
    lm = np.ones((n, T), np.int32)
    lm[:, :8] = 0
    lm *= am
    # Draft vocab: the 128 most frequent target argmaxes at loss-masked positions (so d2t is far from identity).
    pos = jnp.broadcast_to(jnp.arange(T), (n, T))
    top = np.asarray(target.forward(tparams, tcfg, jnp.asarray(ids), pos).logits.argmax(-1))
    counts = np.bincount(top[lm > 0], minlength=V)
    vmap = eagle3.VocabMap.from_used_ids(np.argsort(-counts, kind="stable")[:128], V)
    data = dict(input_ids=ids, attention_mask=am, loss_mask=lm)
    return tcfg, tparams, hcfg, vmap, data


STEPS = 100


@pytest.fixture(scope="module")
def train_fns(setup):
    """One optimizer and one compiled train step / grad fn shared by the tests (compiling dominates their time)."""
    tcfg, _, hcfg, _, _ = setup
    opt = S.make_optimizer(lr=1e-2, total_steps=STEPS, warmup_ratio=0.05)
    return opt, S.make_train_step(tcfg, hcfg, opt, ttt_length=TTT), S.make_grad_fn(tcfg, hcfg, ttt_length=TTT)


def _batch(data, start, a, b):
    return {k: jnp.asarray(v[start:start + a * b].reshape(a, b, T)) for k, v in data.items()}


def _close(x, y, tol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(x)[0], jax.tree.leaves(y)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


def test_training_learns(setup, train_fns):
    tcfg, tparams, hcfg, vmap, data = setup
    opt, step, _ = train_fns
    steps = STEPS
    state = S.init_train_state(hcfg, 0, opt)
    tparams = jax.device_put(tparams, jax.devices()[0])  # committed, as the trainer's and bench train's targets
    ev = S.make_eval_step(tcfg, hcfg, ttt_length=TTT)
    ev_batch = _batch(data, 0, 1, 16)
    before = {k: float(v) for k, v in ev(state.params, tparams, vmap, ev_batch).items()}
    for i in range(steps):
        state, m = step(state, tparams, vmap, _batch(data, (i * 4) % 64, 1, 4))
        assert np.isfinite(float(m["loss"]))
        if i == 0:
            programs = step._cache_size()
    assert step._cache_size() == programs, "the step compiled again for a state it returned (uncommitted first state)"
    after = {k: float(v) for k, v in ev(state.params, tparams, vmap, ev_batch).items()}
    assert int(state.step) == steps
    assert after["loss"] < 0.8 * before["loss"], (before["loss"], after["loss"])
    assert after["acc_0"] > before["acc_0"] + 0.2, (before["acc_0"], after["acc_0"])
    assert after["acc_2"] > before["acc_2"] + 0.15
    # pooled over batches (the trainer's eval, bench heldout): the figures of one batch holding their rows
    pooled = pool_metrics([jax.device_get(ev(state.params, tparams, vmap, _batch(data, s, 1, 8))) for s in (0, 8)])
    for k in ("acc_0", "accept_len", "serving_accept_len", "valid_tokens", "rounds"):
        np.testing.assert_allclose(pooled[k], after[k], rtol=1e-5, err_msg=k)
    # the schedule ran: warmup from 0, cosine to 0 at the end
    assert float(m["lr"]) < 1e-4
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


def test_grad_accum_is_exact(setup, train_fns):
    tcfg, tparams, hcfg, vmap, data = setup
    opt, _, grad = train_fns
    params = S.init_train_state(hcfg, 1, opt).params
    g2, m2 = grad(params, tparams, vmap, _batch(data, 0, 2, 2))
    g1, m1 = grad(params, tparams, vmap, _batch(data, 0, 1, 4))
    _close(m2, m1)
    _close(g2, g1)
    assert float(m1["loss"]) > 0


def test_sharded_4x4_matches_one_device(setup, train_fns):
    tcfg, tparams, hcfg, vmap, data = setup
    opt, step1, _ = train_fns
    batch = _batch(data, 4, 2, 4)
    mesh = make_mesh(dp=4, tp=4)
    from specjax.weights import shard_params
    tp_sharded = shard_params(tparams, tcfg, mesh)
    # the head really is split over tp (heads, MLP width, draft vocab)
    psh = S.head_param_shardings(hcfg, mesh)
    assert psh.layers[0].w_gate.spec == jax.sharding.PartitionSpec(None, "tp")
    assert psh.lm_head.spec == jax.sharding.PartitionSpec(None, "tp")

    results = []
    for m, tps in ((None, tparams), (mesh, tp_sharded)):
        state = S.init_train_state(hcfg, 3, opt, m)
        step = step1 if m is None else S.make_train_step(tcfg, hcfg, opt, m, ttt_length=TTT, grad_accum=2)
        ms = []
        for _ in range(3):
            state, met = step(state, tps, vmap, batch)
            ms.append(jax.device_get(met))
        results.append((jax.device_get(state.params), ms))
    (p1, m1), (p16, m16) = results
    _close(m16, m1)
    _close(p16, p1)


def test_offline_step_matches_online(setup, train_fns):
    tcfg, tparams, hcfg, vmap, data = setup
    opt, _, grad = train_fns
    params = S.init_train_state(hcfg, 2, opt).params
    batch = _batch(data, 8, 1, 4)
    g_on, m_on = grad(params, tparams, vmap, batch)
    f = S.make_feature_fn(tcfg, hcfg)(tparams, batch["input_ids"][0], batch["attention_mask"][0])
    off = dict(batch, aux=f["aux"][None], target_hidden=f["target_hidden"][None])
    g_off, m_off = S.make_grad_fn(tcfg, hcfg, ttt_length=TTT, offline=True)(
        params, S.target_embeddings(tparams), vmap, off)
    _close(m_off, m_on)
    _close(g_off, g_on)


def test_same_seed_same_run(setup, train_fns):
    tcfg, tparams, hcfg, vmap, data = setup
    opt, step, _ = train_fns
    runs = []
    for _ in range(2):
        state = S.init_train_state(hcfg, 7, opt)
        for i in range(3):
            state, m = step(state, tparams, vmap, _batch(data, 4 * i, 1, 4))
        runs.append((jax.device_get(state), jax.device_get(m)))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = jax.device_get(S.init_train_state(hcfg, 8, opt).params)
    assert not np.array_equal(np.asarray(other.fc), np.asarray(runs[0][0].params.fc))


def test_bf16_compute_keeps_fp32_master(setup):
    tcfg, tparams, hcfg, vmap, data = setup
    hb = hcfg.replace(dtype="bfloat16")
    opt = S.make_optimizer(lr=1e-3, total_steps=10)
    state = S.init_train_state(hb, 0, opt)
    state, m = S.make_train_step(tcfg, hb, opt, ttt_length=1)(state, tparams, vmap, _batch(data, 0, 1, 4))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_lr_schedule_and_flops(setup):
    tcfg, _, hcfg, _, _ = setup
    sched = S.lr_schedule(1.0, 100, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert float(sched(0)) == 0.0 and abs(float(sched(10)) - 1.0) < 1e-6
    assert abs(float(sched(100)) - 0.1) < 1e-6 and 0.1 < float(sched(55)) < 1.0
    f = S.estimate_flops_per_token(tcfg, hcfg, T, TTT)
    target_only = f - S.estimate_flops_per_token(tcfg, hcfg, T, TTT, include_target=False)
    # the target's forward is about 2 FLOPs per (non-embedding) parameter plus attention
    approx = 2 * (tcfg.num_params() - V * 64) + tcfg.num_layers * 4 * T * 64
    assert abs(target_only - approx) / approx < 0.02
    assert f > target_only


def test_nonfinite_update_is_skipped(setup, train_fns):
    """A NaN in the target's features (a damaged input) gives a NaN loss: the update is dropped (params and optimizer
    state bitwise unchanged, ``skipped`` = 1, the step counter and so the schedule still advance) and the next finite
    batch trains from the parameters before it."""
    tcfg, tparams, hcfg, vmap, data = setup
    opt, step, _ = train_fns
    state = S.init_train_state(hcfg, 3, opt)
    state, m = step(state, tparams, vmap, _batch(data, 0, 1, 4))
    assert float(m["skipped"]) == 0.0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = dataclasses.replace(tparams, embed=tparams.embed.at[:].set(jnp.nan))
    state, m = step(state, bad, vmap, _batch(data, 4, 1, 4))
    assert not np.isfinite(float(m["loss"])) and float(m["skipped"]) == 1.0
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, np.asarray(b))
    state, m = step(state, tparams, vmap, _batch(data, 8, 1, 4))
    assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
