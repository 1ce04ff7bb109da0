"""The speculative step, draft -> tree -> verify -> accept -> commit, as pure functions meant for ONE jit with the
state donated, and a ``lax.while_loop`` over steps that never returns to Python.

State invariant between steps, per row b (n = ``cache.lengths[b]``):
- the target cache holds positions [0, n); ``last_token`` (x_n, already emitted) is not yet in it;
- the draft cache holds the pairs (feature_t, x_{t+1}) for t in [0, n) at position t (same pages, same lengths);
- ``root_h`` is the draft's output at position n-1 (its top-k is the depth-1 distribution of the next tree). A
  target-only step only extends the draft cache (the pair's K/V: no attention or MLP in the head's last layer) and
  marks ``root_stale``; the next drafting step first recomputes ``root_h`` from ``root_feat``, the pair's feature.
A step drafts a tree rooted at x_n (position n), verifies all M nodes in ONE target forward under the ancestor mask,
accepts a path of a <= num_steps draft tokens plus a bonus, writes the path's target KV at n..n+a, runs the draft over
the a+1 new pairs (extending its cache and producing the next root) and leaves n' = n + a + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specjax import kv_cache, layers, sampling as sampling_lib
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache
from specjax.models import target
from specjax.speculative import draft as draft_lib, tree as tree_lib, verify as verify_lib
from specjax.speculative.draft import Draft


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of the speculative step (hashable: a jit static argument)."""
    num_steps: int  # tree depth S
    topk: int  # branching
    num_draft_tokens: int  # M, tree size incl. the root
    cache_attention: Callable | None = None  # target.forward's cache_attention hook (None: XLA)
    sampling: bool = True  # False: every row is greedy (the sampling acceptance is not even compiled)
    sample_accept_fn: Callable | None = None  # tests only: replaces verify.sample_accept
    thresholds: verify_lib.Thresholds = verify_lib.LOSSLESS  # SGLang's relaxed acceptance of sampled rows

    def __post_init__(self):
        tree_lib.validate(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def tokens_per_step(self) -> int:
        return self.num_steps + 1

    @property
    def chain(self) -> bool:
        """topk 1: the tree is a chain, node j at depth j (position prefix + j), so its K/V can go straight into the
        pool before the verify reads it (``verify_phase``)."""
        return self.topk == 1

    def nodes_in_pool(self, m: int) -> bool:
        """Does the verify of an M-node tree write every node into the pool (a chain, or a root-only tree), so that
        its attention reads them there and the commit has nothing left to write?"""
        return self.chain or m == 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens): the tree's key in ``bench tune``'s table."""
        return self.num_steps, self.topk, self.num_draft_tokens

    def for_prefill(self) -> "SpecConfig":
        """The part of the config that prefill depends on (so one prefill compile serves every tree shape)."""
        return SpecConfig(1, self.topk, 2, self.cache_attention, self.sampling)


def check_compatible(tcfg: ModelConfig, draft: Draft, scfg: SpecConfig) -> None:
    """Raise ValueError when the head, the target and the tree shape do not fit together."""
    vd = int(draft.ids.shape[0])
    if scfg.topk > vd:
        raise ValueError(f"eagle_topk={scfg.topk} exceeds the draft vocab size {vd}")
    if draft.cfg.hidden_size != tcfg.hidden_size and draft.algorithm == "EAGLE":
        raise ValueError(f"EAGLE head hidden_size {draft.cfg.hidden_size} != target {tcfg.hidden_size}")
    if draft.algorithm == "EAGLE3" and max(draft.cfg.aux_layer_ids) >= tcfg.num_layers:
        raise ValueError(f"EAGLE3 head reads target layers {draft.cfg.aux_layer_ids}; the target has only "
                         f"{tcfg.num_layers}")
    if scfg.cache_attention is not None and tcfg.sliding_window is not None:
        raise ValueError("sliding-window targets use the XLA attention path (attention_impl='xla')")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: KVCache  # target cache; its page_table and lengths are the draft cache's too
    draft_k: jax.Array  # [Ld, P, Kd, Z, Hd] draft key pages
    draft_v: jax.Array  # [Ld, P, Kd, Z, Hd]
    last_token: jax.Array  # i32[B] newest emitted token = next tree root (not yet in the target cache)
    root_h: jax.Array  # [B, H] draft output at position lengths-1 (the next tree's depth-1 distribution)
    sampling: sampling_lib.SamplingBatch
    root_feat: jax.Array  # [B, H] the draft's incoming feature at position lengths-1 (to recompute a stale root_h)
    root_stale: jax.Array  # bool[B] a prefill or target-only step committed the row's last pair without root_h


def draft_cache(state: SpecState) -> KVCache:
    return KVCache(k=state.draft_k, v=state.draft_v, page_table=state.cache.page_table, lengths=state.cache.lengths)


def init_state(tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, batch: int, max_len: int, *,
               page_size: int = kv_cache.DEFAULT_PAGE_SIZE, num_pages: int | None = None, dtype=None,
               width: int | None = None) -> SpecState:
    """Empty state: contiguous page table when ``num_pages`` covers the batch, else zeros (the server assigns).
    ``width`` (default: ``scfg.tokens_per_step``) sizes the per-step logprob buffers for the deepest of several tree
    shapes run on the same state."""
    dtype = jnp.dtype(dtype or tcfg.dtype)
    width = width or scfg.tokens_per_step
    cache = kv_cache.init_cache(tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim, batch, max_len,
                                page_size=page_size, dtype=dtype, num_pages=num_pages)
    nl, kh, hd = draft_lib.draft_head_dims(draft.cfg)
    shape = kv_cache.pool_shape(nl, cache.k.shape[1], kh, page_size, hd, dtype)
    hidden = lambda: jnp.zeros((batch, draft.cfg.hidden_size), jnp.dtype(draft.cfg.dtype))  # one buffer each
    return SpecState(cache=cache, draft_k=jnp.zeros(shape, dtype), draft_v=jnp.zeros(shape, dtype),
                     last_token=jnp.zeros((batch,), jnp.int32), root_h=hidden(),
                     sampling=sampling_lib.SamplingBatch.make(batch, vocab=tcfg.vocab_size, width=width),
                     root_feat=hidden(), root_stale=jnp.zeros((batch,), bool))


def _root(draft: Draft, h, topk: int):
    """Top-k of the draft distribution from h [B, H] -> (f32[B, k], target ids i32[B, k])."""
    p = jax.nn.softmax(draft_lib.logits(draft, h), axis=-1)
    top_p, idx = jax.lax.top_k(p, topk)
    return top_p, jnp.take(draft.ids, idx)


def _where_rows(cond, new, old):
    return jax.tree.map(lambda a, b: jnp.where(cond.reshape(cond.shape + (1,) * (a.ndim - 1)), a, b), new, old)


# ---- prefill ----------------------------------------------------------------------------------------------------
def prefill(tparams: target.TargetParams, tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, state: SpecState,
            tokens, next_tokens, valid, last, write_from=None):
    """Append a prompt chunk per row to the target and draft caches.

    tokens: i32[B, T] right-padded; valid: bool[B, T] (a prefix of each row); next_tokens: i32[B, T] the token after
    each one (tokens shifted left; its entry at a row's last valid index is replaced by the sampled first token when
    ``last[b]``). write_from: i32[B] positions below it are already in the target cache (prefix reuse) and are only
    recomputed for their features, not rewritten. Rows with no valid token are untouched.
    The head only writes its K/V over the chunk (no attention or MLP in its last layer): a finished row's root is
    left stale, as after a target-only step, for the first ``spec_step`` to compute from its last pair (one token),
    and a row that a server runs target-only never computes it.
    Returns (state, first token i32[B] — meaningful where ``last``).
    """
    b, t = tokens.shape
    cache = state.cache
    n = valid.sum(axis=1).astype(jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # i32[B, T]
    lastidx = jnp.maximum(n - 1, 0)
    mask = layers.causal_mask(valid)
    wvalid = valid if write_from is None else valid & (positions >= write_from[:, None])
    out = target.forward(tparams, tcfg, tokens, positions, cache=cache, valid=valid,  # the default mask: causal
                         logits_at=lastidx[:, None], return_kv=False, cache_attention=scfg.cache_attention,
                         write_valid=wvalid, **draft_lib.target_kwargs(draft))
    new_cache = out.cache
    first, sb = sampling_lib.sample_next(out.logits[:, 0], state.sampling)
    sb = _where_rows(last, sb, state.sampling)
    at_last = (jnp.arange(t)[None, :] == lastidx[:, None]) & last[:, None]
    nxt = jnp.where(at_last, first[:, None], next_tokens)
    emb = target.embed_tokens(tparams, nxt)
    feat = draft_lib.target_features(draft, out)
    dcache = draft_cache(state)
    attend = layers.CacheAttend(mask, dcache, scfg.cache_attention, write=(positions, valid), causal=True)
    draft_lib.forward(draft, emb, feat, positions, attend, kv_only=True)
    dcache = attend.cache
    new_cache = dataclasses.replace(new_cache, lengths=cache.lengths + n)
    feat_last = jnp.take_along_axis(feat, lastidx[:, None, None], axis=1)[:, 0]  # [B, H]
    done = last & (n > 0)
    last_token, root_feat, root_stale = _where_rows(
        done, (first, feat_last.astype(state.root_feat.dtype), jnp.ones_like(state.root_stale)),
        (state.last_token, state.root_feat, state.root_stale))
    state = SpecState(cache=new_cache, draft_k=dcache.k, draft_v=dcache.v, last_token=last_token,
                      root_h=state.root_h, sampling=sb, root_feat=root_feat, root_stale=root_stale)
    return state, first


# ---- the step, by phases ----------------------------------------------------------------------------------------
def draft_phase(tparams: target.TargetParams, draft: Draft, scfg: SpecConfig, state: SpecState) -> tree_lib.Tree:
    """Grow the draft tree from the root's draft distribution (num_steps - 1 draft forwards) and select it.

    Each frontier node attends to the committed draft cache plus, from a tree buffer, its TRUE ancestors' draft K/V
    (not SGLang's per-branch slots), so the draft sees exactly the context it would see on the real path."""
    k = scfg.topk
    dcache = draft_cache(state)
    lengths = dcache.lengths
    b = lengths.shape[0]
    nl, kh, hd = draft_lib.draft_head_dims(draft.cfg)
    n_buf = max((scfg.num_steps - 1) * k, 1)
    buf = (jnp.zeros((nl, b, n_buf, kh, hd), state.draft_k.dtype), jnp.zeros((nl, b, n_buf, kh, hd),
                                                                             state.draft_v.dtype))
    self_mask = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))

    def step_fn(carry, toks, h, depth, anc, slot0):
        bk, bv = carry
        positions = jnp.broadcast_to(lengths[:, None] + depth - 1, (b, k)).astype(jnp.int32)
        mask = jnp.concatenate([anc, self_mask], axis=-1)  # bool[B, k, n_buf + k]: true ancestors, then itself

        def attend(i, q, kk, vv):
            # The committed prefix is read from the pages in use; the tree buffer and the nodes themselves are the
            # "new" keys under the ancestor mask.
            return layers.attend(q, jnp.concatenate([bk[i], kk.astype(bk.dtype)], axis=1),
                                 jnp.concatenate([bv[i], vv.astype(bv.dtype)], axis=1), mask, q.shape[-1] ** -0.5,
                                 dcache.k, dcache.v, dcache.page_table, lengths, layer=i)

        h_out, ks, vs = draft_lib.forward(draft, target.embed_tokens(tparams, toks), h, positions, attend)
        bk = jax.lax.dynamic_update_slice_in_dim(bk, ks.astype(bk.dtype), slot0, axis=2)
        bv = jax.lax.dynamic_update_slice_in_dim(bv, vs.astype(bv.dtype), slot0, axis=2)
        probs = jax.nn.softmax(draft_lib.logits(draft, h_out), axis=-1)
        return (bk, bv), h_out.astype(h.dtype), probs

    root_p, root_ids = _root(draft, state.root_h, k)
    _, cands = tree_lib.grow(step_fn, buf, root_p, root_ids, state.root_h, num_steps=scfg.num_steps, topk=k,
                             draft_ids=draft.ids)
    return tree_lib.select(cands, state.last_token, lengths, num_steps=scfg.num_steps, topk=k,
                           num_draft_tokens=scfg.num_draft_tokens)


def verify_phase(tparams: target.TargetParams, tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, state: SpecState,
                 tree: tree_lib.Tree, active) -> target.ForwardOut:
    """ONE target forward over the M tree tokens under the ancestor mask against the committed prefix: logits
    f32[B, M, V] after every node, the draft's features (aux or hidden) and the nodes' K/V.

    The root (node 0: the last emitted token, at the committed length) is accepted whatever happens, so each layer
    writes its K/V into the pool of the ``active`` rows before reading it (``ForwardOut.cache``): then the reads
    follow a write, as in a plain decode step, which XLA:CPU runs twice as fast as reads straight from the entry
    buffer (SmolLM2, a target-only step at batch 16: 104.5 -> 46.9 ms; plain 48.8). The other nodes of a tree are
    written by ``commit_phase``. A chain (``SpecConfig.chain``, and a root-only tree) writes every node at its own
    position and attention reads them back from the pool (``target.forward(keys_in_pool=True)``), so each node's
    logits are the bits a plain decode step would compute there: speculative greedy output is plain greedy output
    bit for bit, bf16 included. A wider tree's nodes share positions and read their ancestors from the new keys
    under the ancestor mask; the CPU attention kernel sums them where a decode step finds them once accepted, so
    with specjax's CPU kernels (up to ``cpu_dense.MAX_TOKENS`` nodes) a tree node's bits are the decode step's too."""
    m = tree.tokens.shape[1]
    chain = scfg.nodes_in_pool(m)
    write = active[:, None] & ((jnp.arange(m)[None, :] == 0) | chain)  # bool[B, M]
    return target.forward(tparams, tcfg, tree.tokens, tree.positions, cache=state.cache, mask=tree.mask,
                          return_kv=True, cache_attention=scfg.cache_attention, write_valid=write,
                          keys_in_pool=chain, **draft_lib.target_kwargs(draft))


def commit_phase(tparams: target.TargetParams, draft: Draft, scfg: SpecConfig, state: SpecState, acc, out, active,
                 sb, *, root: bool = True) -> SpecState:
    """Write the accepted path's target K/V at consecutive positions (rejected nodes are dropped), run the draft
    over the a+1 new pairs (feature at path[j], token after it) to extend its cache and get the next root.
    ``root=False`` (a target-only step): only the draft cache is extended, and the root is left stale. ``sb``: from
    ``verify.accept(..., active=active)``, which leaves the inactive rows' sampling state as it was."""
    s1 = acc.path.shape[1]  # num_steps + 1 (1 for a target-only step)
    cache = state.cache
    j = jnp.arange(s1, dtype=jnp.int32)
    valid = (j[None, :] <= acc.accept_len[:, None]) & active[:, None]  # bool[B, S+1]
    positions = cache.lengths[:, None] + j[None, :]
    idx = acc.path[None, :, :, None, None]
    new_cache = cache
    if not scfg.nodes_in_pool(out.k_new.shape[2]):  # else in place already (``verify_phase``)
        new_cache = kv_cache.write(cache, jnp.take_along_axis(out.k_new, idx, axis=2),
                                   jnp.take_along_axis(out.v_new, idx, axis=2), positions, valid)
    raw = jnp.take_along_axis(draft_lib.raw_features(draft, out), acc.path[:, :, None], axis=1)  # [B, S+1, C]
    feat = draft_lib.project(draft, raw)
    emb = target.embed_tokens(tparams, acc.tokens)
    dcache = draft_cache(state)
    attend = layers.CacheAttend(layers.causal_mask(valid), dcache, scfg.cache_attention, write=(positions, valid))
    h, _, _ = draft_lib.forward(draft, emb, feat, positions, attend, kv_only=not root)
    dcache = attend.cache
    at_last = lambda a: jnp.take_along_axis(a, acc.accept_len[:, None, None], axis=1)[:, 0]
    new_cache = dataclasses.replace(new_cache, lengths=cache.lengths + jnp.where(active, acc.accept_len + 1, 0))
    if root:
        new_root, root_feat, stale = at_last(h).astype(state.root_h.dtype), state.root_feat, False
    else:
        new_root, root_feat, stale = state.root_h, at_last(feat).astype(state.root_feat.dtype), True
    last_token, root_h, root_feat, root_stale = _where_rows(
        active, (acc.bonus, new_root, root_feat, jnp.full_like(state.root_stale, stale)),
        (state.last_token, state.root_h, state.root_feat, state.root_stale))
    return SpecState(cache=new_cache, draft_k=dcache.k, draft_v=dcache.v, last_token=last_token, root_h=root_h,
                     sampling=sb, root_feat=root_feat, root_stale=root_stale)


def refresh_root(tparams: target.TargetParams, draft: Draft, scfg: SpecConfig, state: SpecState) -> SpecState:
    """Recompute ``root_h`` of the rows a target-only step left stale: the draft over their last committed pair
    (feature ``root_feat``, token ``last_token``) at position n-1, attending to the cache below it and to itself
    (its K/V, already in the cache, are recomputed, not rewritten). Skipped when no row is stale."""
    def recompute():
        n1 = jnp.maximum(state.cache.lengths - 1, 0)
        b = n1.shape[0]
        dcache = dataclasses.replace(draft_cache(state), lengths=n1)
        attend = layers.CacheAttend(jnp.ones((b, 1, 1), bool), dcache, scfg.cache_attention)
        h, _, _ = draft_lib.forward(draft, target.embed_tokens(tparams, state.last_token[:, None]),
                                    state.root_feat[:, None], n1[:, None], attend)
        return jnp.where(state.root_stale[:, None], h[:, 0].astype(state.root_h.dtype), state.root_h)

    root_h = jax.lax.cond(state.root_stale.any(), recompute, lambda: state.root_h)
    return dataclasses.replace(state, root_h=root_h, root_stale=jnp.zeros_like(state.root_stale))


def spec_step(tparams: target.TargetParams, tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, state: SpecState,
              active):
    """One speculative step for the rows with ``active`` (bool[B]).
    Returns (state, tokens i32[B, S+1], counts i32[B]): row b emitted tokens[b, :counts[b]] (0 if inactive)."""
    state = refresh_root(tparams, draft, scfg, state)
    tree = draft_phase(tparams, draft, scfg, state)
    out = verify_phase(tparams, tcfg, draft, scfg, state, tree, active)
    state = dataclasses.replace(state, cache=out.cache)
    acc, sb = verify_lib.accept(tree, out.logits, state.sampling, scfg.num_steps, scfg.sample_accept_fn,
                                may_sample=scfg.sampling, active=active, thresholds=scfg.thresholds)
    state = commit_phase(tparams, draft, scfg, state, acc, out, active, sb)
    counts = jnp.where(active, acc.accept_len + 1, 0).astype(jnp.int32)
    return state, acc.tokens, counts


def root_tree(state: SpecState) -> tree_lib.Tree:
    """The tree of a step that drafts nothing: the root alone (the last emitted token at the committed length)."""
    b = state.last_token.shape[0]
    none = jnp.full((b, 1), -1, jnp.int32)
    return tree_lib.Tree(tokens=state.last_token[:, None], parent=none, depth=jnp.zeros((b, 1), jnp.int32),
                         positions=state.cache.lengths[:, None], mask=jnp.ones((b, 1, 1), bool), first_child=none,
                         next_sibling=none, scores=jnp.ones((b, 1), jnp.float32), candidate=none)


def target_step(tparams: target.TargetParams, tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, state: SpecState,
                active):
    """One token per active row with no drafting: ``spec_step`` over the root-only tree. The target forward is a
    plain decode step (the token is the plain one: argmax or a draw from the same distribution); the commit still
    writes the new pair's draft K/V (only those), so the draft cache stays in step and the next step may draft again
    (``spec_step`` recomputes the stale root first).
    What a server runs when its running batch is large enough that verifying a tree costs more than it saves.
    Returns (state, tokens i32[B, 1], counts i32[B])."""
    tree = root_tree(state)
    out = verify_phase(tparams, tcfg, draft, scfg, state, tree, active)
    state = dataclasses.replace(state, cache=out.cache)
    acc, sb = verify_lib.accept(tree, out.logits, state.sampling, 0, may_sample=scfg.sampling, active=active)
    state = commit_phase(tparams, draft, scfg, state, acc, out, active, sb, root=False)
    return state, acc.tokens, active.astype(jnp.int32)


# ---- the device loop ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopOut:
    tokens: jax.Array  # i32[B, cap] generated tokens (the first one from prefill included)
    num_tokens: jax.Array  # i32[B] completion tokens per row
    verify_steps: jax.Array  # i32[B] speculative steps (target verify forwards) each row took part in
    step_counts: jax.Array  # i32[B, cap] tokens emitted by each of the row's steps (first verify_steps entries)


def generate_loop(tparams: target.TargetParams, tcfg: ModelConfig, draft: Draft, scfg: SpecConfig, state: SpecState,
                  out: LoopOut, done, max_new, stop_ids):
    """Speculative steps in a ``lax.while_loop`` until every row is done (stop token or ``max_new`` i32[B] tokens).
    ``out`` holds the first token per row already; stop_ids: i32[n] (may be empty). Returns (state, LoopOut)."""
    s1 = scfg.num_steps + 1
    cap = out.tokens.shape[1]
    j = jnp.arange(s1, dtype=jnp.int32)
    rows = jnp.arange(done.shape[0])

    def cond(c):
        return jnp.any(~c[2])

    def body(c):
        state, o, done = c
        active = ~done
        state, toks, counts = spec_step(tparams, tcfg, draft, scfg, state, active)
        is_stop = jnp.isin(toks, stop_ids) & (j[None] < counts[:, None])
        stop_at = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, -1) + 1, s1)
        n = jnp.minimum(jnp.minimum(counts, stop_at), max_new - o.num_tokens)
        n = jnp.where(active, jnp.maximum(n, 0), 0)
        dst = jnp.where(j[None] < n[:, None], o.num_tokens[:, None] + j[None], cap)
        tokens = o.tokens.at[rows[:, None], dst].set(toks, mode="drop")
        step_counts = o.step_counts.at[rows, jnp.where(active, o.verify_steps, cap)].set(n, mode="drop")
        num = o.num_tokens + n
        hit_stop = is_stop.any(-1) & (stop_at <= n)
        done = done | hit_stop | (num >= max_new)
        o = LoopOut(tokens=tokens, num_tokens=num, verify_steps=o.verify_steps + active.astype(jnp.int32),
                    step_counts=step_counts)
        return state, o, done

    state, out, _ = jax.lax.while_loop(cond, body, (state, out, done))
    return state, out

