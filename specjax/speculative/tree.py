"""Draft-tree construction on device, with SGLang's EAGLE-2 semantics (docs/08-eagle-reference.md section 4).

Candidates are numbered in order of creation (docs/08-eagle-reference.md section 4):
- step 0: the top ``topk`` tokens of the draft distribution at the last accepted position, ids ``[0, topk)``,
  score = draft prob, parent = the root;
- step i (1 <= i < num_steps): each of the ``topk`` frontier nodes proposes its top ``topk`` children;
  candidate id ``topk + (i-1)*topk^2 + slot*topk + rank``, score = parent score * child prob; the best ``topk`` of
  these ``topk^2`` become the next frontier.
After ``num_steps`` steps the best ``num_draft_tokens - 1`` candidates (ties broken towards the lower id, so a
parent always precedes its equal-score child and every selected node's parent is selected) are sorted by id and put
behind the root (node 0, the last verified token). Node k's parent always has a smaller index.

The draft forward of the frontier nodes is a callback (``step_fn``) so that the same code serves the real heads and
hand-made distributions in tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def validate(num_steps: int, topk: int, num_draft_tokens: int, draft_vocab_size: int | None = None) -> None:
    """Raise ValueError with a clear message for an impossible (num_steps, topk, num_draft_tokens)."""
    if num_steps < 1:
        raise ValueError(f"speculative num_steps must be >= 1, got {num_steps}")
    if topk < 1:
        raise ValueError(f"speculative eagle_topk must be >= 1, got {topk}")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(f"with speculative eagle_topk == 1 (a chain) num_draft_tokens must be num_steps + 1 = "
                         f"{num_steps + 1}, got {num_draft_tokens}")
    if num_draft_tokens < 2:
        raise ValueError(f"speculative num_draft_tokens must be >= 2 (root + at least one draft), got "
                         f"{num_draft_tokens}")
    n_cand = num_candidates(num_steps, topk)
    if num_draft_tokens - 1 > n_cand:
        raise ValueError(f"speculative num_draft_tokens={num_draft_tokens} exceeds 1 + the {n_cand} candidates that "
                         f"num_steps={num_steps}, eagle_topk={topk} produce")
    if draft_vocab_size is not None and topk > draft_vocab_size:
        raise ValueError(f"eagle_topk={topk} exceeds the draft vocab size {draft_vocab_size}")


def num_candidates(num_steps: int, topk: int) -> int:
    return topk + (num_steps - 1) * topk * topk


def candidate_depth(num_steps: int, topk: int) -> np.ndarray:
    """i32[C] tree depth (>= 1) of each candidate id."""
    c = np.arange(num_candidates(num_steps, topk))
    return np.where(c < topk, 1, 2 + (c - topk) // (topk * topk)).astype(np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
    """Every scored candidate of one drafting round."""
    scores: jax.Array  # f32[B, C] product of draft probs along the path
    tokens: jax.Array  # i32[B, C] target token ids
    parents: jax.Array  # i32[B, C] candidate id of the parent, -1 for children of the root


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    """The draft tree of one speculative step; node 0 is the root (the last verified token)."""
    tokens: jax.Array  # i32[B, M] target token ids
    parent: jax.Array  # i32[B, M] parent node index, -1 for the root
    depth: jax.Array  # i32[B, M] 0 for the root
    positions: jax.Array  # i32[B, M] prefix length + depth (RoPE / cache positions of the verify forward)
    mask: jax.Array  # bool[B, M, M] node i sees node j iff j is i or an ancestor of i
    first_child: jax.Array  # i32[B, M] smallest child index, -1 for leaves
    next_sibling: jax.Array  # i32[B, M] next larger index with the same parent, -1 if none
    scores: jax.Array  # f32[B, M] path score (1 for the root)
    candidate: jax.Array  # i32[B, M] candidate id of each node, -1 for the root


StepFn = Callable[..., tuple[Any, jax.Array, jax.Array]]


def grow(step_fn: StepFn, carry, root_p, root_tokens, root_h, *, num_steps: int, topk: int, draft_ids):
    """Run the drafting rounds and return (carry, Candidates).

    root_p: f32[B, topk] top draft probs at the last accepted position; root_tokens: i32[B, topk] their target ids;
    root_h: [B, H] the draft's hidden state there (fed to the depth-1 nodes); draft_ids: i32[Vd] target id of each
    draft-vocab entry.
    ``step_fn(carry, tokens i32[B, k], h [B, k, H], depth i32[], ancestors bool[B, k, (num_steps-1)*k], slot0 i32[])
    -> (carry, h_out [B, k, H], probs f32[B, k, Vd])`` runs the draft on the k frontier nodes at ``depth``;
    ``ancestors`` marks which earlier frontier nodes (buffer slot ``(d-1)*k + s`` for the node of depth d in frontier
    slot s) are strict ancestors of each node; the frontier itself owns slots ``[slot0, slot0 + k)``.
    """
    b = root_p.shape[0]
    k = topk
    n_cand = num_candidates(num_steps, k)
    n_buf = max((num_steps - 1) * k, 1)
    scores = jnp.zeros((b, n_cand), jnp.float32).at[:, :k].set(root_p.astype(jnp.float32))
    tokens = jnp.zeros((b, n_cand), jnp.int32).at[:, :k].set(root_tokens)
    parents = jnp.full((b, n_cand), -1, jnp.int32)
    frontier = dict(
        cand=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),  # i32[B, k] candidate ids
        score=root_p.astype(jnp.float32),  # f32[B, k]
        tok=root_tokens.astype(jnp.int32),  # i32[B, k]
        h=jnp.broadcast_to(root_h[:, None, :], (b, k, root_h.shape[-1])),  # [B, k, H]
        anc=jnp.zeros((b, k, n_buf), bool))  # bool[B, k, n_buf] strict ancestors among earlier frontiers

    def body(i, loop):
        carry, scores, tokens, parents, fr = loop
        slot0 = (i - 1) * k
        carry, h_out, probs = step_fn(carry, fr["tok"], fr["h"], i, fr["anc"], slot0)
        child_p, child_idx = jax.lax.top_k(probs.astype(jnp.float32), k)  # [B, k, k] (slot, rank)
        child_tok = jnp.take(draft_ids, child_idx)  # i32[B, k, k]
        exp_scores = (fr["score"][:, :, None] * child_p).reshape(b, k * k)  # f32[B, k*k]
        off = k + (i - 1) * k * k
        scores = jax.lax.dynamic_update_slice(scores, exp_scores, (0, off))
        tokens = jax.lax.dynamic_update_slice(tokens, child_tok.reshape(b, k * k), (0, off))
        par = jnp.broadcast_to(fr["cand"][:, :, None], (b, k, k)).reshape(b, k * k)
        parents = jax.lax.dynamic_update_slice(parents, par, (0, off))
        # Next frontier: the best k of the k*k children (lax.top_k prefers the lower index on ties).
        sel_score, sel = jax.lax.top_k(exp_scores, k)  # [B, k]
        pslot = sel // k  # i32[B, k] frontier slot of each new node's parent
        own = jax.nn.one_hot(slot0 + jnp.arange(k), n_buf, dtype=bool)  # bool[k, n_buf]
        anc_self = fr["anc"] | own[None]  # ancestors-or-self of the current frontier
        fr = dict(cand=off + sel, score=sel_score, tok=jnp.take_along_axis(child_tok.reshape(b, k * k), sel, axis=1),
                  h=jnp.take_along_axis(h_out, pslot[:, :, None], axis=1),
                  anc=jnp.take_along_axis(anc_self, pslot[:, :, None], axis=1))
        return carry, scores, tokens, parents, fr

    if num_steps > 1:
        carry, scores, tokens, parents, _ = jax.lax.fori_loop(1, num_steps, body,
                                                              (carry, scores, tokens, parents, frontier))
    return carry, Candidates(scores=scores, tokens=tokens, parents=parents)


def select(cands: Candidates, root_token, prefix_len, *, num_steps: int, topk: int, num_draft_tokens: int) -> Tree:
    """Pick the best ``num_draft_tokens - 1`` candidates and build the tree tensors.
    root_token: i32[B] the last verified token; prefix_len: i32[B] committed tokens (the root's position)."""
    b, n_cand = cands.scores.shape
    m = num_draft_tokens
    ids = jnp.broadcast_to(jnp.arange(n_cand, dtype=jnp.int32), (b, n_cand))
    # Sort by (-score, id): the best first, ties towards the lower id (parents before their equal-score children).
    _, order = jax.lax.sort((-cands.scores, ids), dimension=1, num_keys=2)
    chosen = jnp.sort(order[:, :m - 1], axis=1)  # i32[B, M-1] candidate ids in creation order
    cand_par = jnp.take_along_axis(cands.parents, chosen, axis=1)  # i32[B, M-1]
    match = chosen[:, None, :] == cand_par[:, :, None]  # [B, M-1, M-1] node j's parent is selected node i
    parent_node = jnp.where(cand_par < 0, 0, 1 + jnp.argmax(match, axis=-1)).astype(jnp.int32)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent_node], axis=1)  # i32[B, M]
    depth_c = jnp.asarray(candidate_depth(num_steps, topk))
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take(depth_c, chosen)], axis=1)
    tokens = jnp.concatenate([root_token[:, None].astype(jnp.int32),
                              jnp.take_along_axis(cands.tokens, chosen, axis=1)], axis=1)
    scores = jnp.concatenate([jnp.ones((b, 1), jnp.float32), jnp.take_along_axis(cands.scores, chosen, axis=1)], 1)
    return Tree(tokens=tokens, parent=parent, depth=depth, positions=prefix_len[:, None] + depth,
                mask=ancestor_mask(parent, num_steps), first_child=first_child(parent),
                next_sibling=next_sibling(parent), scores=scores,
                candidate=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), chosen], axis=1))


def ancestor_mask(parent, max_depth: int):
    """bool[B, M, M]: node i sees node j iff j == i or j is an ancestor of i. parent: i32[B, M] (-1 for the root)."""
    b, m = parent.shape
    eye = jnp.broadcast_to(jnp.eye(m, dtype=bool), (b, m, m))
    par = jnp.maximum(parent, 0)

    def body(_, anc):
        inherited = jnp.take_along_axis(anc, par[:, :, None], axis=1) & (parent >= 0)[:, :, None]
        return eye | inherited

    return jax.lax.fori_loop(0, max_depth, body, eye)


def first_child(parent):
    """i32[B, M]: the smallest index whose parent is this node, -1 for leaves."""
    m = parent.shape[1]
    is_child = parent[:, None, :] == jnp.arange(m)[None, :, None]  # [B, node, k]
    return jnp.where(is_child.any(-1), jnp.argmax(is_child, -1), -1).astype(jnp.int32)


def next_sibling(parent):
    """i32[B, M]: the next larger index with the same parent, -1 if none (and for the root)."""
    m = parent.shape[1]
    idx = jnp.arange(m)
    sib = (parent[:, None, :] == parent[:, :, None]) & (idx[None, None, :] > idx[None, :, None])
    sib = sib & (parent >= 0)[:, :, None]
    return jnp.where(sib.any(-1), jnp.argmax(sib, -1), -1).astype(jnp.int32)
