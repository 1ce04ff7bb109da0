"""EAGLE3 training-time-test (TTT) loss: docs/08-eagle-reference.md section 3.

For a micro-batch of sequences x_0 .. x_{T-1} with the frozen target's aux features ``aux[t]`` (which encode
x_0..x_t) and logits ``z[t]`` (the target's prediction of x_{t+1}), the head is unrolled ``ttt_length`` times with
``h = fc(aux)`` computed once. At step k (s = k + 1) every position t is shifted left by s:

  input token   x_{t+s}               (its target embedding; past the end: zeros, masked)
  RoPE position position_ids[t] + k
  target        p = softmax(z[t+s] restricted to the draft vocab), a = argmax z[t+s] over the whole vocab
  loss mask     loss_mask[t+s] * attention_mask[t+s] * t2d[a]      (the "position mask")
  hidden input  step 0: fc(aux[t]); step k > 0: step k-1's output at t, before ``norm``
  attention     the query at t sees step 0's keys at positions <= t (causal, padding keys hidden) plus, for each
                i = 1..k, only step i's key at the SAME position t; one softmax over all of them.

The diagonal part is an elementwise q.k per position (``[B, K, G, T, k]`` scores), so a step costs one [T, T]
score matrix (its query against step 0's keys) plus k dot products per position, never a [T, T] per cached step.

Normalisation (the ``.mean()`` of docs/08-eagle-reference.md section 3):
``loss_k = sum(position_mask * CE) / (B * T)``, a mean over ALL positions of the micro-batch, padding included.
Micro-batches of equal shape therefore average exactly to the loss of their concatenation (gradient accumulation is
exact), at the price of a loss scale that shrinks with the padding fraction. Total loss = sum_k decay**k * loss_k.

Chain accept length: ``chain[k]`` counts the step-0-valid positions whose steps 0..k are all correct. Given correct
steps 0..k-1, step k's inputs (the true tokens) are exactly what a chain draft would feed it when the verified text is
the target's greedy output (as in regenerated data), so ``1 + sum_k chain[k] / valid[0]`` is the expected number of
tokens per verify step of a greedy chain draft of ``ttt_length`` steps (``accept_len``; the first k terms for k steps).

That average weighs every position equally, but a server does not draft from every position: a round starting at t
emits lead[t] + 1 tokens (``lead[t]``: the leading correct steps at t) and the next round starts at t + lead[t] + 1.
Served tau is tokens / rounds, so a hard stretch (one token per round) costs a round per token while an easy one
costs a round per lead + 1 tokens: tau behaves like a token-weighted harmonic mean of lead + 1, and falls below the
arithmetic mean above once difficulty varies along the answer (a better head widens the spread).
``serving_accept_len`` walks each sequence as a greedy chain server would (:func:`serving_rounds`) and divides the
tokens its rounds emit by their number: the prediction to compare with a served tau.

Accuracy: ``acc_k`` = correct / positions with ``loss_mask`` set (valid positions, including those whose target
argmax lies outside the draft vocab, which the draft cannot get right), where correct means
``argmax(draft) + d2t[argmax(draft)] == argmax(target)``. ``acc_k_allpos`` divides the same count by all B*T
positions, as SpecJAX does (it understates accuracy; reported only for comparison with SpecJAX's numbers).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax import layers, platforms, sampling
from specjax.models import eagle3
from specjax.models.eagle3 import Eagle3Config, Eagle3Params, VocabMap
from specjax.sharding import constrain

# Accumulable statistics of a rollout (sums over a micro-batch): f32[ttt_length] each for STAT_KEYS, f32[] each for
# SCALAR_STAT_KEYS. ``chain[k]``: step-0-valid positions whose steps 0..k are ALL correct (what a chain draft gets
# accepted for); ``rounds`` / ``round_tokens``: the verify rounds of a greedy chain server walking the sequences and
# the tokens they emit (:func:`serving_rounds`).
STAT_KEYS = ("ce_sum", "correct", "valid", "chain")
SCALAR_STAT_KEYS = ("positions", "rounds", "round_tokens")


def shift_left(x, n: int, fill=0):
    """x shifted left by n along axis 1 (the sequence): out[:, t] = x[:, t + n], ``fill`` past the end."""
    if n == 0:
        return x
    t = x.shape[1]
    if n >= t:
        return jnp.full_like(x, fill)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x[:, n:], pad, constant_values=fill)


def serving_rounds(lead, start):
    """(rounds f32[], tokens f32[]) of a greedy chain server walking each row of ``lead`` f32[B, T] (the leading
    correct draft steps at each position) over the positions where ``start`` bool[B, T] allows a round (step 0
    valid): a round at t emits lead[t] + 1 tokens (the accepted drafts and the bonus) and the next one starts at
    t + lead[t] + 1; positions where no round may start are stepped over one by one (the prompt, padding).

    The walk is a pointer chain, computed by doubling: after j levels ``nxt[t]`` is where 2**j moves from t land and
    ``cnt``/``tok`` what those moves add up, so T.bit_length() levels of gathers (2**levels > T moves) reach the end
    from position 0 (every move advances at least one position; column T is an absorbing end)."""
    b, t = lead.shape
    idx = jnp.arange(t, dtype=jnp.int32)[None]
    jump = jnp.where(start, idx + lead.astype(jnp.int32) + 1, idx + 1)
    end = jnp.full((b, 1), t, jnp.int32)
    zero = jnp.zeros((b, 1), jnp.float32)
    nxt = jnp.concatenate([jnp.minimum(jump, t), end], axis=1)
    cnt = jnp.concatenate([start.astype(jnp.float32), zero], axis=1)
    tok = jnp.concatenate([jnp.where(start, lead + 1.0, 0.0), zero], axis=1)
    for _ in range(max(1, t.bit_length())):  # 2**levels > T moves
        cnt = cnt + jnp.take_along_axis(cnt, nxt, axis=1)
        tok = tok + jnp.take_along_axis(tok, nxt, axis=1)
        nxt = jnp.take_along_axis(nxt, nxt, axis=1)
    return jnp.sum(cnt[:, 0]), jnp.sum(tok[:, 0])


def _columns_cpu(x, ids):
    """x[..., ids] on a CPU by take_along_axis: XLA:CPU wrote ``take``'s gather as [Vd, B, T] and transposed it
    (54 -> 26 ms with the softmax after it, SmolLM2 at B x T = 512). Elsewhere ``take`` stays: this form's
    broadcast index array is as large as its output (0.5 GB for a 7B recipe's micro-batch)."""
    return jnp.take_along_axis(x, jnp.broadcast_to(ids, x.shape[:-1] + ids.shape), axis=-1)


def target_distribution(target_logits, vocab_map: VocabMap):
    """The target side of the loss, per (unshifted) position.

    target_logits: f32[B, T, V]. Returns p f32[B, T, Vd] (softmax over the target logits of the draft vocab's
    tokens, in draft-id order = increasing target id, i.e. the t2d selection), top i32[B, T] (target argmax over
    the whole vocab) and in_draft bool[B, T] (t2d[top]).
    """
    vd = vocab_map.d2t.shape[0]
    draft_to_target = jnp.arange(vd, dtype=jnp.int32) + vocab_map.d2t.astype(jnp.int32)  # i32[Vd]
    restricted = platforms.select(target_logits, draft_to_target, cpu=_columns_cpu,
                                  default=lambda x, ids: jnp.take(x, ids, axis=-1)).astype(jnp.float32)  # [B, T, Vd]
    restricted = constrain(restricted, ("batch", "seq", "draft_vocab"))
    p = jax.nn.softmax(restricted, axis=-1)
    top = sampling.argmax(target_logits)  # i32[B, T]
    return p, top, vocab_map.t2d[top]


@jax.custom_vjp
def soft_cross_entropy(logits, p):
    """-sum(p * log_softmax(logits)) over the last axis: f32[..., V] x f32[..., V] -> f32[...], differentiable in
    ``logits`` only (``p``, the target's distribution, is data). Written as ``lse * sum(p) - sum(p * logits)`` with a
    hand-written gradient ``g * (softmax(logits) * sum(p) - p)``: one pass over the [..., V] operands each way where
    autodiff of ``log_softmax`` made several (each TTT step's [B, T, Vd] tensors are the largest of the rollout)."""
    return _soft_ce_parts(logits, p)[0]


def _soft_ce_parts(logits, p):
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = top[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    mass = jnp.sum(p, axis=-1)
    return lse * mass - jnp.sum(p * logits, axis=-1), lse, mass


def _soft_ce_fwd(logits, p):
    ce, lse, mass = _soft_ce_parts(logits, p)
    return ce, (logits, p, lse, mass)


def _soft_ce_bwd(res, g):
    logits, p, lse, mass = res
    d = g[..., None] * (jnp.exp(logits - lse[..., None]) * mass[..., None] - p)
    return d, None  # p is data: no cotangent (None: a symbolic zero, nothing written)


soft_cross_entropy.defvjp(_soft_ce_fwd, _soft_ce_bwd)


def diagonal_attention(q, k0, v0, mask0, diag_k, diag_v, *, sm_scale: float):
    """TTT attention of one step.

    q: [B, T, N, H] this step's queries; k0, v0: [B, T, K, H] step 0's keys/values; mask0: bool[B, T, T] (causal &
    key valid); diag_k, diag_v: [B, T, K, i, H] the keys/values of steps 1..i at each query's own position (i may
    be 0, then None). Softmax in fp32 over [step-0 keys | diagonal keys]. Returns [B, T, N, H] in q's dtype.
    """
    t = q.shape[1]
    if diag_k is None:
        return layers.attention(q, k0, v0, mask0, sm_scale=sm_scale, causal=True)
    # a long sequence is attended by causal chunks of queries (``layers.query_chunks``: a chunk reads the step-0
    # keys up to its last row, which mask0 hides beyond), each query's own diagonal keys beside them
    qk, k0k, v0k = layers.kv_head_major(q, k0, v0)  # [B, K, G, T, H], [B, K, T, H] x2
    outs = []
    for a, z, e in layers.query_chunks(t, t, causal=True):
        qc = qk[:, :, :, a:z]
        s0 = jnp.einsum("bkgth,bksh->bkgts", qc, k0k[:, :, :e], preferred_element_type=jnp.float32) * sm_scale
        s0 = jnp.where(mask0[:, None, None, a:z, :e], s0, layers.NEG_INF)  # [B, K, G, T', S']
        sd = jnp.einsum("bkgth,btkih->bkgti", qc, diag_k[:, a:z], preferred_element_type=jnp.float32) * sm_scale
        p = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1)  # [B, K, G, T', S' + i]
        out = jnp.einsum("bkgts,bksh->bkgth", p[..., :e].astype(v0.dtype), v0k[:, :, :e])
        outs.append(out + jnp.einsum("bkgti,btkih->bkgth", p[..., e:].astype(diag_v.dtype), diag_v[:, a:z]))
    return layers.merge_kv_heads(outs)


def _step_outputs(head_params: Eagle3Params, head_cfg: Eagle3Config, h, p_all, s: int):
    """(cross-entropy f32[B, T], draft argmax i32[B, T]) of one TTT step whose positions t predict x_{t+s+1}:
    p_all[:, t + s] is the target at t. Only the T - s positions with a target get logits (the rest are 0, masked
    out by the caller), so neither the [B, T, Vd] target nor the logits are shifted or padded, only [B, T] rows."""
    b, t = h.shape[:2]
    n = t - s
    if n <= 0:
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.int32)
    logits = eagle3.draft_logits(head_params, head_cfg, h[:, :n])  # f32[B, n, Vd]
    logits = constrain(logits, ("batch", "seq", "draft_vocab"))
    ce = soft_cross_entropy(logits, p_all[:, s:])
    pred = sampling.argmax(jax.lax.stop_gradient(logits))  # draft ids
    pad = ((0, 0), (0, s))
    return jnp.pad(ce, pad), jnp.pad(pred, pad)


def ttt_rollout(head_params: Eagle3Params, head_cfg: Eagle3Config, embed, aux, input_ids, loss_mask, attention_mask,
                target_logits, vocab_map: VocabMap, *, ttt_length: int = 7, decay: float = 0.8, position_ids=None):
    """The TTT rollout: (loss f32[], stats) where stats holds the accumulable sums of ``STAT_KEYS``.

    The head computes in the dtype of ``head_params`` (cast fp32 master weights before calling for bf16 compute).
    embed: [V, Ht] the target's embedding table; aux: [B, T, 3*Ht]; input_ids, loss_mask, attention_mask: [B, T]
    (right padding: attention_mask 0 on pads); target_logits: f32[B, T, V] (unshifted: z[t] predicts x_{t+1});
    position_ids: i32[B, T] (default arange(T)).
    """
    b, t = input_ids.shape
    dt = head_params.norm.dtype  # the activations' (a loaded head may keep its matrices narrower)
    sm_scale = head_cfg.head_dim ** -0.5
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = attention_mask.astype(bool)
    mask0 = layers.causal_mask(valid)  # bool[B, T, T], the same for every step
    loss_mask = loss_mask.astype(jnp.float32) * valid.astype(jnp.float32)  # never train on padding

    emb_all = jnp.take(embed, input_ids, axis=0).astype(dt)  # [B, T, H] embeddings of x_t, shifted per step
    emb_all = constrain(emb_all, ("batch", "seq", "embed"))
    p_all, top_all, in_draft_all = target_distribution(target_logits, vocab_map)
    d2t = vocab_map.d2t.astype(jnp.int32)

    h = eagle3.project_aux(head_params, aux)  # [B, T, H]
    h = constrain(h, ("batch", "seq", "embed"))
    nl = len(head_params.layers)
    step0_kv: list[tuple[Any, Any]] = []  # per layer: step 0's (k, v) [B, T, K, Hd]
    diag_kv: list[list[tuple[Any, Any]]] = [[] for _ in range(nl)]  # per layer: steps 1..k
    losses, stats = [], {k: [] for k in STAT_KEYS}
    start = shift_left(loss_mask, 1)  # f32[B, T]: step-0-valid positions (where a served round may start)
    run = start  # f32[B, T]: step-0-valid positions still correct at every step so far
    lead = jnp.zeros_like(run)  # f32[B, T]: leading correct steps per position
    for k in range(ttt_length):
        s = k + 1
        emb = shift_left(emb_all, s)  # [B, T, H]
        pos = position_ids + k
        x_h = h
        for li, lp in enumerate(head_params.layers):
            x = eagle3.layer_input(lp, head_cfg, emb, x_h)  # [B, T, 2H] (midlayer) or [B, T, H]
            q, kk, vv = eagle3.qkv(lp, head_cfg, x, pos)
            q = constrain(q, ("batch", "seq", "heads", "head_dim"))
            if k == 0:
                step0_kv.append((kk, vv))
                dk = dv = None
            else:
                diag_kv[li].append((kk, vv))
                dk = jnp.stack([e[0] for e in diag_kv[li]], axis=3)  # [B, T, K, k, Hd]
                dv = jnp.stack([e[1] for e in diag_kv[li]], axis=3)
            o = diagonal_attention(q, step0_kv[li][0], step0_kv[li][1], mask0, dk, dv, sm_scale=sm_scale)
            x_h = eagle3.finish_layer(lp, head_cfg, x_h, o)  # [B, T, H]
            x_h = constrain(x_h, ("batch", "seq", "embed"))
        h = x_h  # fed to the next step before the final norm
        ce, pred = _step_outputs(head_params, head_cfg, h, p_all, s)  # f32[B, T], i32[B, T]
        top = shift_left(top_all, s)  # i32[B, T]
        lm = shift_left(loss_mask, s)  # f32[B, T]
        position_mask = lm * shift_left(in_draft_all, s, False).astype(jnp.float32)
        ce_sum = jnp.sum(position_mask * ce)
        hit = lm * ((pred + d2t[pred]) == top).astype(jnp.float32)  # f32[B, T]
        correct = jnp.sum(hit)
        run = run * hit
        lead = lead + run
        losses.append(ce_sum / (b * t))
        stats["ce_sum"].append(ce_sum)
        stats["correct"].append(correct)
        stats["chain"].append(jnp.sum(run))
        stats["valid"].append(jnp.sum(lm))
    loss = sum((decay ** k) * l for k, l in enumerate(losses))
    out = {k: jnp.stack(v) for k, v in stats.items()}
    out["positions"] = jnp.asarray(b * t, jnp.float32)
    out["rounds"], out["round_tokens"] = serving_rounds(lead, start > 0)
    return loss, out


def finalize_metrics(stats, decay: float) -> dict[str, jax.Array]:
    """Metrics from (summed) rollout stats: loss, ploss_k, acc_k (valid positions), acc_k_allpos, valid_tokens and
    ``accept_len``: the chain accept length (tokens per verify step) that a chain draft of ``ttt_length`` steps
    would get from this head on these positions under greedy verification, 1 + sum_k chain[k] / valid[0] (every
    position weighed equally), and ``serving_accept_len``: the tokens per round of a greedy chain server walking the
    same sequences (round_tokens / rounds), the figure a served tau measures."""
    n = stats["positions"]
    ploss = stats["ce_sum"] / n
    acc = stats["correct"] / jnp.maximum(stats["valid"], 1.0)
    acc_all = stats["correct"] / n
    out = {"loss": sum((decay ** k) * ploss[k] for k in range(ploss.shape[0])),
           "valid_tokens": stats["valid"][0],
           "accept_len": 1.0 + jnp.sum(stats["chain"]) / jnp.maximum(stats["valid"][0], 1.0),
           "serving_accept_len": stats["round_tokens"] / jnp.maximum(stats["rounds"], 1.0),
           "rounds": stats["rounds"]}
    for k in range(ploss.shape[0]):
        out[f"ploss_{k}"] = ploss[k]
        out[f"acc_{k}"] = acc[k]
        out[f"acc_{k}_allpos"] = acc_all[k]
    return out


def pool_metrics(batches: list[dict]) -> dict[str, float]:
    """Several batches' ``finalize_metrics`` as one set: each batch weighed by its valid tokens (a batch of long
    conversations counts for its tokens, not as one batch of short ones), ``serving_accept_len`` by its rounds,
    ``valid_tokens`` and ``rounds`` summed. acc_0, accept_len and serving_accept_len are then exactly the figures of
    one batch holding all the rows; the loss, ploss_k, acc_k for k > 0 (over valid[k]) and acc_k_allpos are their
    token-weighted means. Batches without a valid token weigh nothing (all of them: their plain mean)."""
    tokens = sum(float(m["valid_tokens"]) for m in batches)
    rounds = sum(float(m.get("rounds", 0.0)) for m in batches)
    out = {}
    for k in batches[0]:
        if k in ("valid_tokens", "rounds"):
            out[k] = sum(float(m[k]) for m in batches)
        elif k == "serving_accept_len" and rounds > 0:
            out[k] = sum(float(m[k]) * float(m["rounds"]) for m in batches) / rounds
        elif tokens > 0:
            out[k] = sum(float(m[k]) * float(m["valid_tokens"]) for m in batches) / tokens
        else:
            out[k] = sum(float(m[k]) for m in batches) / len(batches)
    return out


def ttt_forward(head_params: Eagle3Params, head_cfg: Eagle3Config, embed, aux, input_ids, loss_mask, attention_mask,
                target_logits, vocab_map: VocabMap, *, ttt_length: int = 7, decay: float = 0.8, position_ids=None):
    """TTT loss of one micro-batch: (loss f32[], metrics). See the module docstring for the exact definition.

    Metrics: ``loss``, ``ploss_k``, ``acc_k`` (over valid positions), ``acc_k_allpos`` (over all B*T positions,
    SpecJAX's normalisation) for k < ttt_length, and ``valid_tokens`` (loss-masked positions at step 0).
    """
    loss, stats = ttt_rollout(head_params, head_cfg, embed, aux, input_ids, loss_mask, attention_mask, target_logits,
                              vocab_map, ttt_length=ttt_length, decay=decay, position_ids=position_ids)
    return loss, finalize_metrics(jax.lax.stop_gradient(stats), decay)


__all__ = ["ttt_forward", "ttt_rollout", "finalize_metrics", "pool_metrics", "target_distribution", "diagonal_attention",
           "shift_left", "serving_rounds", "STAT_KEYS", "SCALAR_STAT_KEYS"]
