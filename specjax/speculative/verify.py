"""Acceptance of a verified draft tree: greedy and lossless sampling (SGLang's tree rule), vectorised over rows,
with a ``lax.fori_loop`` over depth.

Children of a node are tried in index order (= creation order = SGLang's first-child / next-sibling order).
- Greedy: accept the child whose token equals the target argmax at the parent; the bonus token is the target argmax
  at the last accepted node. Output = plain greedy decoding.
- Sampling, with target distribution p at the current node (``sampling.target_probs``): SGLang's rule accepts
  child c with probability p(c), on rejection sets p(c) = 0 and renormalises, and if every child is rejected
  samples the bonus from what is left of p. Here the same law is drawn as plain sampling draws its token: the
  target's token at the node is drawn from p (``sampling.inverse_cdf`` at the uniform ``sampling.token_uniforms``
  gives the request's n-th token), the child holding it is accepted, and if no child does, that token is the bonus
  (p restricted to the other tokens). Each child is accepted with probability p(c), as in SGLang, and the tokens
  emitted are the ones plain sampling emits with the same seed, whatever tree the step ran (the server's tree
  shape follows its batch), so a seeded request repeats under speculation as it does without.
- Relaxed sampling (SGLang's ``--speculative-accept-threshold-single`` / ``-acc``, ``Thresholds``): child k is also
  accepted when ``p(k) >= single``, and (one uniform coin u per level, child k taken when ``cum_{k-1} <= u <
  cum_k``, cum the running sum of p over the children) the running sum is read as ``cum_k / acc`` (a child's chance rises from p to
  min(1, p / acc) given the siblings before it); the first child that passes either test wins. More draft tokens are
  accepted and the output no longer follows the target's distribution; (1, 1), the default, is the lossless rule.
  Greedy rows are never relaxed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.speculative.tree import Tree


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """SGLang's relaxed acceptance for sampled rows (``--speculative-accept-threshold-single`` / ``-acc``, each in
    [0, 1]); the default (1, 1) is lossless. Static (hashable): part of the compiled step."""
    single: float = 1.0
    acc: float = 1.0

    def __post_init__(self):
        for name in ("single", "acc"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"acceptance threshold {name} must be in [0, 1] (got {v})")

    @property
    def lossless(self) -> bool:
        return self.single == 1.0 and self.acc == 1.0


LOSSLESS = Thresholds()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    path: jax.Array  # i32[B, S+1] node index of the j-th accepted node (path[:, 0] = 0, the root); j > accept_len: 0
    accept_len: jax.Array  # i32[B] accepted draft tokens (0..S)
    tokens: jax.Array  # i32[B, S+1] emitted tokens: the accepted draft tokens, then the bonus; count = accept_len + 1
    bonus: jax.Array  # i32[B] the token after the accepted path (the next tree root)


def _first_sibling_occurrence(tree: Tree):
    """bool[B, M]: False for a node whose token repeats an earlier sibling's (never tried twice)."""
    m = tree.parent.shape[1]
    idx = jnp.arange(m)
    dup = ((tree.parent[:, None, :] == tree.parent[:, :, None]) & (tree.tokens[:, None, :] == tree.tokens[:, :, None])
           & (idx[None, None, :] < idx[None, :, None]))  # [B, node, earlier]
    return ~dup.any(-1)


def _finish(tree: Tree, path, n, bonus, num_steps: int) -> Accepted:
    j = jnp.arange(num_steps + 1)
    nxt = jnp.take_along_axis(tree.tokens, jnp.roll(path, -1, axis=1), axis=1)  # token of path[j+1]
    tokens = jnp.where(j[None] < n[:, None], nxt, bonus[:, None])
    tokens = jnp.where(j[None] <= n[:, None], tokens, 0)
    return Accepted(path=path, accept_len=n, tokens=tokens.astype(jnp.int32), bonus=bonus.astype(jnp.int32))


def _walk(hit, b: int, num_steps: int):
    """Walk down from the root for up to ``num_steps`` levels. ``hit(d, cur) -> bool[B, M]`` marks the child of node
    ``cur`` accepted at depth d (the first marked node wins; none = stop). Returns (last accepted node i32[B],
    path i32[B, S+1] of node indices with the root at 0, accepted draft tokens i32[B])."""
    def body(d, st):
        cur, done, path, n = st
        h = hit(d, cur)
        found = h.any(-1) & ~done
        nxt = jnp.argmax(h, -1).astype(jnp.int32)
        cur = jnp.where(found, nxt, cur)
        path = path.at[:, d + 1].set(jnp.where(found, nxt, 0))
        return cur, done | ~found, path, n + found.astype(jnp.int32)

    init = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), jnp.zeros((b, num_steps + 1), jnp.int32),
            jnp.zeros((b,), jnp.int32))
    if num_steps == 0:  # a root-only tree (``spec_step.target_step``): the body would index an empty axis
        return init[0], init[2], init[3]
    cur, _, path, n = jax.lax.fori_loop(0, num_steps, body, init)
    return cur, path, n


def greedy_accept(tree: Tree, target_argmax, num_steps: int) -> Accepted:
    """target_argmax: i32[B, M] the target's argmax token after each node."""
    b = tree.tokens.shape[0]
    rows = jnp.arange(b)
    first = _first_sibling_occurrence(tree)

    def hit(d, cur):
        want = target_argmax[rows, cur]  # i32[B]
        return (tree.parent == cur[:, None]) & (tree.tokens == want[:, None]) & first  # [B, M]

    cur, path, n = _walk(hit, b, num_steps)
    return _finish(tree, path, n, target_argmax[rows, cur], num_steps)


def sample_accept(tree: Tree, probs, uniforms, num_steps: int, thresholds: Thresholds = LOSSLESS) -> Accepted:
    """probs: f32[B, M, V] target distribution after each node; uniforms: f32[B, S+1, 2] the draws of the tokens this
    step may emit (``sampling.token_uniforms``: [:, d] belongs to the d-th); ``thresholds``: the relaxed rule.
    Lossless: at depth d the target's token is drawn as plain sampling draws it (``sampling.inverse_cdf`` at
    uniforms[:, d, 0]) and the child holding it is accepted, else it is the bonus: each child is accepted with
    probability p(child), the bonus follows p without the children, and the tokens are plain sampling's with the
    same seed, whatever the tree. Relaxed: the module docstring's coin rule (coin uniforms[:, d, 0]), the bonus
    drawn at uniforms[:, n, 1] from p without the children tried."""
    b = tree.tokens.shape[0]
    rows = jnp.arange(b)
    first = _first_sibling_occurrence(tree)

    def hit(d, cur):
        p_cur = probs[rows, cur]  # f32[B, V]
        child = (tree.parent == cur[:, None]) & first
        if thresholds.lossless:
            return child & (tree.tokens == sampling_lib.inverse_cdf(p_cur, uniforms[:, d, 0])[:, None])
        p_tok = jnp.take_along_axis(p_cur, tree.tokens, axis=1)  # f32[B, M] p of each node's token
        cum = jnp.cumsum(jnp.where(child, p_tok, 0.0), axis=1)  # children in index order
        # SGLang divides by acc floored at 1e-9: acc 0 accepts the first child with any probability
        passes = (uniforms[:, d, 0][:, None] < cum / max(thresholds.acc, 1e-9)) | (p_tok >= thresholds.single)
        return child & passes

    cur, path, n = _walk(hit, b, num_steps)
    p_cur = probs[rows, cur]
    u = jnp.take_along_axis(uniforms, n[:, None, None], axis=1)[:, 0]  # f32[B, 2]: the draws of the bonus
    if thresholds.lossless:
        return _finish(tree, path, n, sampling_lib.inverse_cdf(p_cur, u[:, 0]), num_steps)
    # The bonus: p at the last accepted node with all its children (all tried and rejected) removed.
    child = tree.parent == cur[:, None]
    killed = jnp.zeros(p_cur.shape, bool).at[rows[:, None], tree.tokens].max(child)
    resid = jnp.where(killed, 0.0, p_cur)
    resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_cur)  # fp round-off guard
    return _finish(tree, path, n, sampling_lib.inverse_cdf(resid, u[:, 1]), num_steps)


def accept(tree: Tree, logits, sb: sampling_lib.SamplingBatch, num_steps: int, sample_accept_fn=None,
           may_sample: bool = True, active=None, thresholds: Thresholds = LOSSLESS):
    """Acceptance for a batch mixing greedy, sampling and penalised rows. logits: f32[B, M, V] target logits after
    each node; each node's penalties count the tokens drafted on its path (``sampling.process_logits``), so a node's
    distribution is exactly the one plain decoding would use after that prefix. ``may_sample=False`` (static)
    promises that every row is greedy; ``thresholds`` relaxes the sampled rows' acceptance. Returns (Accepted,
    SamplingBatch with the emitted tokens counted and their logprobs recorded); rows outside
    ``active`` (bool[B], default all) keep theirs."""
    x = sampling_lib.process_logits(logits, sb, (tree.tokens, tree.mask, tree.depth))
    greedy = greedy_accept(tree, sampling_lib.argmax(x), num_steps)
    fn = sample_accept_fn or functools.partial(sample_accept, thresholds=thresholds)

    def sampled():
        probs = sampling_lib.target_probs(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
        index = sb.generated[:, None] + jnp.arange(num_steps + 1, dtype=jnp.int32)[None]  # the tokens it may emit
        s = fn(tree, probs, sampling_lib.token_uniforms(sb.key, index), num_steps)
        g = sb.greedy
        return jax.tree.map(lambda a, c: jnp.where(g.reshape(g.shape + (1,) * (a.ndim - 1)), a, c), greedy, s)

    acc = greedy if not may_sample else jax.lax.cond(jnp.all(sb.greedy), lambda: greedy, sampled)
    # The logits of each emitted token are the path's nodes' (gathered only when a row wants logprobs).
    return acc, sampling_lib.record(sb, acc.tokens, acc.accept_len + 1, x, active, x_rows=acc.path)
