"""The TTT loss (train/loss.py) against an independent per-step numpy reference (float64).

The reference follows docs/08-eagle-reference.md section 3 literally and SpecForge's way of writing it: token ids,
target logits and loss mask padded with zeros and shifted left by k+1, token 0 embedded past the end, target
distribution selected with the boolean t2d, and at each step ONE explicit attention over the concatenated keys of
all steps so far under an explicit [T, T*(k+1)] mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import eagle3
from specjax.train import loss as ttt

V, VD, HT = 64, 40, 32


def _cfg(num_layers=1):
    return eagle3.Eagle3Config(
        hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=V,
        draft_vocab_size=VD, target_hidden_size=HT, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, num_layers=num_layers, aux_layer_ids=(0, 1, 2), dtype="float32")


# ---- numpy reference --------------------------------------------------------------------------------------------
def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _rope(x, pos, theta):  # x [B, T, N, H], pos [B, T]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[..., None] * inv  # [B, T, H/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _pad_shift(x, s):  # SpecForge's padding(left=False), applied s times
    out = np.zeros_like(x)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def reference(params, cfg, embed, aux, ids, loss_mask, attn_mask, logits, t2d, ttt_length, decay):
    p = _np(params)
    embed, aux, logits = (np.asarray(a, np.float64) for a in (embed, aux, logits))
    t2d = np.asarray(t2d)
    used = np.nonzero(t2d)[0]  # draft id i -> target id used[i]
    b, t = ids.shape
    eps, n, kh, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    am = np.asarray(attn_mask)
    h = aux @ p.fc  # [B, T, H]
    cache = [([], []) for _ in p.layers]  # per layer: keys / values of every step so far, [B, T, K, Hd] each
    out = {"ploss": [], "acc": [], "acc_all": [], "pm": [], "chain": []}
    run = _pad_shift(np.asarray(loss_mask, np.float64) * am, 1)  # positions valid at step 0, all steps correct so far
    lead = np.zeros_like(run)  # leading correct steps per position
    for k in range(ttt_length):
        s = k + 1
        ids_k = _pad_shift(np.asarray(ids), s)
        emb = embed[ids_k]
        pos = np.broadcast_to(np.arange(t), (b, t)) + k
        x_h = h
        for li, lp in enumerate(p.layers):
            if li == 0:
                x = np.concatenate([_rms(emb, lp.input_norm, eps), _rms(x_h, lp.hidden_norm, eps)], -1)
            else:
                x = _rms(x_h, lp.input_norm, eps)
            q = _rope(np.einsum("btc,cnh->btnh", x, lp.wq), pos, cfg.rope_theta)
            kk = _rope(np.einsum("btc,ckh->btkh", x, lp.wk), pos, cfg.rope_theta)
            vv = np.einsum("btc,ckh->btkh", x, lp.wv)
            cache[li][0].append(kk)
            cache[li][1].append(vv)
            keys = np.concatenate(cache[li][0], axis=1)  # [B, T*(k+1), K, Hd], step-major
            vals = np.concatenate(cache[li][1], axis=1)
            mask = np.zeros((b, t, t * (k + 1)), bool)  # the explicit TTT mask
            for bb in range(b):
                for qi in range(t):
                    for j in range(qi + 1):
                        mask[bb, qi, j] = am[bb, j] == 1
                    for i in range(1, k + 1):
                        mask[bb, qi, i * t + qi] = True
            kr = np.repeat(keys, n // kh, axis=2)  # GQA: query head j uses kv head j // G
            vr = np.repeat(vals, n // kh, axis=2)
            sc = np.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(hd)
            sc = np.where(mask[:, None], sc, -np.inf)
            o = np.einsum("bnts,bsnh->btnh", _softmax(sc), vr)
            x_h = x_h + np.einsum("btnh,nhd->btd", o, lp.wo)
            y = _rms(x_h, lp.post_norm, eps)
            g = y @ lp.w_gate
            x_h = x_h + ((g / (1 + np.exp(-g))) * (y @ lp.w_up)) @ lp.w_down
        h = x_h
        draft = _rms(h, p.norm, eps) @ p.lm_head  # [B, T, Vd]
        z = _pad_shift(logits, s)
        lm = _pad_shift(np.asarray(loss_mask, np.float64) * am, s)
        top = z.argmax(-1)
        pm = lm * t2d[top]
        tp = _softmax(z[..., t2d])
        out["ploss"].append(-(pm * (tp * _log_softmax(draft)).sum(-1)).mean())
        hit = lm * (used[draft.argmax(-1)] == top)
        correct = hit.sum()
        run = run * hit
        lead += run
        out["chain"].append(run.sum())
        out["acc"].append(correct / max(lm.sum(), 1))
        out["acc_all"].append(correct / (b * t))
        out["pm"].append(pm)
    out["loss"] = sum(decay ** k * l for k, l in enumerate(out["ploss"]))
    out["accept_len"] = 1 + sum(out["chain"]) / max(_pad_shift(np.asarray(loss_mask, np.float64) * am, 1).sum(), 1)
    out["lead"] = lead
    rounds, tokens = walk_rounds(lead, _pad_shift(np.asarray(loss_mask, np.float64) * am, 1) > 0)
    out["serving_accept_len"] = tokens / max(rounds, 1)
    return out


def walk_rounds(lead, start):
    """A greedy chain server, one position at a time: a round at t emits lead[t] + 1 tokens, the next starts at
    t + lead[t] + 1; positions where no round may start are passed over."""
    rounds = tokens = 0
    for row_lead, row_start in zip(np.asarray(lead), np.asarray(start)):
        t = 0
        while t < len(row_lead):
            if row_start[t]:
                rounds += 1
                tokens += int(row_lead[t]) + 1
                t += int(row_lead[t]) + 1
            else:
                t += 1
    return rounds, tokens


# ---- fixtures ----------------------------------------------------------------------------------------------------
def _inputs(seed, b=3, t=12, num_layers=1):
    cfg = _cfg(num_layers)
    rng = np.random.default_rng(seed)
    params = eagle3.init_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    embed = rng.normal(size=(V, HT)).astype(np.float32)
    aux = rng.normal(size=(b, t, 3 * HT)).astype(np.float32)
    ids = rng.integers(0, V, size=(b, t)).astype(np.int32)
    attn = np.ones((b, t), np.int32)
    attn[1, t - 4:] = 0  # right padding
    attn[2, t - 1:] = 0
    loss_mask = np.ones((b, t), np.int32)
    loss_mask[0, : t // 2] = 0  # prompt part
    loss_mask[1, :3] = 0
    loss_mask *= attn
    logits = (rng.normal(size=(b, t, V)) * 3).astype(np.float32)
    used = np.sort(rng.choice(V, size=VD, replace=False))
    vmap = eagle3.VocabMap.from_used_ids(used, V)
    return cfg, params, embed, aux, ids, loss_mask, attn, logits, vmap


@pytest.mark.parametrize("ttt_length,num_layers", [(3, 1), (7, 1), (3, 2)])
def test_ttt_forward_matches_reference(ttt_length, num_layers):
    cfg, params, embed, aux, ids, lm, am, logits, vmap = _inputs(ttt_length + num_layers, num_layers=num_layers)
    fn = jax.jit(lambda *a: ttt.ttt_forward(*a, ttt_length=ttt_length, decay=0.8), static_argnums=1)
    loss, m = fn(params, cfg, embed, aux, ids, lm, am, logits, vmap)
    ref = reference(params, cfg, embed, aux, ids, lm, am, logits, np.asarray(vmap.t2d), ttt_length, 0.8)
    np.testing.assert_allclose(float(loss), ref["loss"], rtol=2e-5)
    np.testing.assert_allclose(float(m["loss"]), ref["loss"], rtol=2e-5)
    for k in range(ttt_length):
        np.testing.assert_allclose(float(m[f"ploss_{k}"]), ref["ploss"][k], rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(float(m[f"acc_{k}"]), ref["acc"][k], atol=1e-6)
        np.testing.assert_allclose(float(m[f"acc_{k}_allpos"]), ref["acc_all"][k], atol=1e-6)
        # the masks really bite: some loss-masked positions have a target argmax outside the draft vocab
        assert ref["pm"][k].sum() > 0
    assert float(m["valid_tokens"]) == float(_pad_shift(lm.astype(float) * am, 1).sum())
    np.testing.assert_allclose(float(m["accept_len"]), ref["accept_len"], atol=1e-6)
    np.testing.assert_allclose(float(m["serving_accept_len"]), ref["serving_accept_len"], atol=1e-6)
    # later steps see less valid data: the shifted masks are nested
    assert [float(m[f"acc_{k}_allpos"]) <= float(m[f"acc_{k}"]) for k in range(ttt_length)] == [True] * ttt_length


def test_accept_len_counts_leading_correct_steps():
    """accept_len = 1 + mean over step-0-valid positions of the number of LEADING correct steps: a position whose
    step 0 is wrong adds nothing even when later steps are right."""
    stats = {"ce_sum": jnp.zeros(3), "valid": jnp.asarray([4.0, 4.0, 4.0]), "positions": jnp.asarray(8.0),
             "correct": jnp.asarray([3.0, 2.0, 2.0]), "chain": jnp.asarray([3.0, 2.0, 1.0]),
             "rounds": jnp.asarray(2.0), "round_tokens": jnp.asarray(5.0)}
    m = ttt.finalize_metrics(stats, 0.8)
    np.testing.assert_allclose(float(m["accept_len"]), 1 + 6 / 4)
    np.testing.assert_allclose(float(m["serving_accept_len"]), 5 / 2)


@pytest.mark.parametrize("seed", range(4))
def test_serving_rounds_walk_the_sequence_like_a_server(seed):
    """The pointer-doubling walk equals a position-by-position server walk: prompts, padding, several answer
    segments per row (multi-turn), leads up to the rollout length and running past the end."""
    rng = np.random.default_rng(seed)
    b, t = 5, 37 + seed
    lead = rng.integers(0, 8, size=(b, t)).astype(np.float32)
    lead[:, : t // 3] = np.where(rng.random((b, t // 3)) < 0.2, 7, 0)  # long accepted runs early on
    start = rng.random((b, t)) < 0.8
    start[0, :10] = False  # a prompt
    start[1, 20:] = False  # padding
    start[2] = False  # an empty row
    rounds, tokens = jax.jit(ttt.serving_rounds)(jnp.asarray(lead), jnp.asarray(start))
    want_rounds, want_tokens = walk_rounds(lead, start)
    assert (float(rounds), float(tokens)) == (want_rounds, want_tokens)
    assert want_rounds < start.sum()  # the walk really skips positions inside accepted runs


def test_serving_prediction_is_below_the_position_average_when_difficulty_varies():
    """Half the answer hard (lead 0), half easy (lead 7): averaged over positions a round would emit 1 + 3.5 = 4.5
    tokens, but a server spends 16 one-token rounds on the hard half and 2 eight-token rounds on the easy half:
    32 tokens in 18 rounds, 1.78 per round (tau is a token-weighted harmonic mean of lead + 1)."""
    lead = np.asarray([[0.0] * 16 + [7.0] * 16], np.float32)
    start = np.ones_like(lead, bool)
    rounds, tokens = ttt.serving_rounds(jnp.asarray(lead), jnp.asarray(start))
    assert (float(rounds), float(tokens)) == (18.0, 32.0) == walk_rounds(lead, start)
    assert 1 + lead.mean() == 4.5


def test_padding_and_tail_do_not_leak():
    """Changing tokens / features at padded positions changes nothing (keys there are hidden from valid queries)."""
    cfg, params, embed, aux, ids, lm, am, logits, vmap = _inputs(11)
    fn = jax.jit(lambda *a: ttt.ttt_forward(*a, ttt_length=3), static_argnums=1)
    l1, _ = fn(params, cfg, embed, aux, ids, lm, am, logits, vmap)
    ids2, aux2, logits2 = ids.copy(), aux.copy(), logits.copy()
    pad = am == 0
    ids2[pad] = (ids2[pad] + 7) % V
    aux2[pad] += 5.0
    logits2[pad] *= -1
    l2, _ = fn(params, cfg, embed, aux2, ids2, lm, am, logits2, vmap)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)


@pytest.mark.parametrize("t", [6, 300])
def test_diagonal_attention_explicit_mask(t):
    """diagonal_attention == softmax over [step-0 keys | step-1..k keys] under an explicit [T, T*(k+1)] mask; at 300
    tokens it runs in causal chunks of queries (``layers.query_chunks``)."""
    rng = np.random.default_rng(0)
    b, n, kh, hd, k = 2, 4, 2, 8, 3
    q = rng.normal(size=(b, t, n, hd)).astype(np.float32)
    keys = [rng.normal(size=(b, t, kh, hd)).astype(np.float32) for _ in range(k + 1)]
    vals = [rng.normal(size=(b, t, kh, hd)).astype(np.float32) for _ in range(k + 1)]
    valid = np.ones((b, t), bool)
    valid[1, t - 2:] = False
    mask0 = np.tril(np.ones((t, t), bool))[None] & valid[:, None, :]
    got = ttt.diagonal_attention(jnp.asarray(q), jnp.asarray(keys[0]), jnp.asarray(vals[0]), jnp.asarray(mask0),
                                 jnp.stack(keys[1:], 3), jnp.stack(vals[1:], 3), sm_scale=hd ** -0.5)
    full_mask = np.concatenate([mask0] + [np.broadcast_to(np.eye(t, dtype=bool), (b, t, t))] * k, axis=-1)
    kc = np.repeat(np.concatenate(keys, 1), n // kh, 2).astype(np.float64)
    vc = np.repeat(np.concatenate(vals, 1), n // kh, 2).astype(np.float64)
    sc = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), kc) / np.sqrt(hd)
    sc = np.where(full_mask[:, None], sc, -np.inf)
    want = np.einsum("bnts,bsnh->btnh", _softmax(sc), vc)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # no diagonal keys: plain causal attention
    got0 = ttt.diagonal_attention(jnp.asarray(q), jnp.asarray(keys[0]), jnp.asarray(vals[0]), jnp.asarray(mask0),
                                  None, None, sm_scale=hd ** -0.5)
    sc0 = np.where(mask0[:, None], np.einsum("btnh,bsnh->bnts", q.astype(np.float64), kc[:, :t]) / np.sqrt(hd),
                   -np.inf)
    np.testing.assert_allclose(np.asarray(got0), np.einsum("bnts,bsnh->btnh", _softmax(sc0), vc[:, :t]),
                               rtol=1e-5, atol=1e-6)


def test_loss_gradient_flows_through_the_rollout():
    """Every head parameter gets a gradient, including the extra layer of a 2-layer head."""
    cfg, params, embed, aux, ids, lm, am, logits, vmap = _inputs(5, num_layers=2)
    g = jax.grad(lambda p: ttt.ttt_forward(p, cfg, embed, aux, ids, lm, am, logits, vmap, ttt_length=2)[0])(params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        assert np.abs(np.asarray(leaf)).sum() > 0, jax.tree_util.keystr(path)


def test_soft_cross_entropy_matches_autodiff_of_log_softmax():
    """The rollout's cross-entropy (one pass each way, a hand-written gradient) against autodiff of
    -sum(p * log_softmax(logits)), including a row with no target mass (a position past the end)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 5, VD)) * 3, jnp.float32)
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((3, 5, VD)), jnp.float32), axis=-1).at[0, 1].set(0.0)
    w = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    ref = lambda lg: jnp.sum(w * -jnp.sum(p * jax.nn.log_softmax(lg, axis=-1), axis=-1))
    got = lambda lg: jnp.sum(w * ttt.soft_cross_entropy(lg, p))
    np.testing.assert_allclose(float(jax.jit(got)(logits)), float(ref(logits)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(got))(logits)), np.asarray(jax.grad(ref)(logits)),
                               rtol=1e-4, atol=1e-6)
    assert float(ttt.soft_cross_entropy(logits, p)[0, 1]) == 0.0
