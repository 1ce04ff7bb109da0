"""Draft trees and acceptance on literal, hand-made inputs (SGLang's EAGLE-2 semantics,
docs/08-eagle-reference.md section 4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.speculative import tree as tree_lib, verify
from specjax.speculative.spec_step import SpecConfig

V = 8
ROOT_TOKEN = 0
PREFIX = np.array([10, 3], np.int32)  # committed lengths of the two rows


def dist(**p):
    """A draft distribution over V tokens: the given probs, the rest spread evenly."""
    out = np.zeros(V, np.float32)
    for k, v in p.items():
        out[int(k[1:])] = v
    rest = [i for i in range(V) if out[i] == 0]
    out[rest] = (1.0 - out.sum()) / len(rest)
    return out


# Draft distribution after each token (the hand-made "draft head"): rows are indexed by the parent token.
CHILD = np.stack([dist(t1=0.2)] * V)
CHILD[3] = dist(t1=0.5, t2=0.3)
CHILD[5] = dist(t4=0.8, t6=0.1)
CHILD[1] = dist(t7=0.7, t0=0.2)
CHILD[4] = dist(t2=0.6, t3=0.35)


def table_step(carry, toks, h, depth, anc, slot0):
    """Draft callback: probs looked up by token; h_out = one-hot(token) * 10 + depth; records what it was fed."""
    seen_h, seen_anc, seen_tok = carry
    seen_h = seen_h.at[depth].set(h)
    seen_anc = seen_anc.at[depth].set(anc)
    seen_tok = seen_tok.at[depth].set(toks)
    h_out = jax.nn.one_hot(toks, V) * 10.0 + depth
    return (seen_h, seen_anc, seen_tok), h_out, jnp.asarray(CHILD)[toks]


def build(num_steps, topk, m, root_p, root_ids):
    b = root_p.shape[0]
    n_buf = max((num_steps - 1) * topk, 1)
    carry = (jnp.zeros((num_steps, b, topk, V)), jnp.zeros((num_steps, b, topk, n_buf), bool),
             jnp.zeros((num_steps, b, topk), jnp.int32))
    root_h = jnp.full((b, V), -1.0)

    @jax.jit
    def run(root_p, root_ids, root_h, carry):
        carry, cands = tree_lib.grow(table_step, carry, root_p, root_ids, root_h, num_steps=num_steps, topk=topk,
                                     draft_ids=jnp.arange(V, dtype=jnp.int32))
        t = tree_lib.select(cands, jnp.full((b,), ROOT_TOKEN, jnp.int32), jnp.asarray(PREFIX[:b]),
                            num_steps=num_steps, topk=topk, num_draft_tokens=m)
        return carry, cands, t

    return run(jnp.asarray(root_p), jnp.asarray(root_ids), root_h, carry)


@pytest.fixture(scope="module")
def tree3():
    """(num_steps, topk, M) = (3, 2, 6) from root probs {3: 0.6, 5: 0.25}, two identical rows."""
    root_p = np.array([[0.6, 0.25]] * 2, np.float32)
    root_ids = np.array([[3, 5]] * 2, np.int32)
    return build(3, 2, 6, root_p, root_ids)


def test_candidates_scores_and_parents(tree3):
    _, c, _ = tree3
    # ids: step 0 = [0, 2); step 1 = [2, 6) (frontier {3, 5}); step 2 = [6, 10) (frontier {1 (0.30), 4 (0.20)}).
    np.testing.assert_allclose(np.asarray(c.scores[0]),
                               [0.6, 0.25, 0.30, 0.18, 0.20, 0.025, 0.21, 0.06, 0.12, 0.07], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(c.tokens[0]), [3, 5, 1, 2, 4, 6, 7, 0, 2, 3])
    np.testing.assert_array_equal(np.asarray(c.parents[0]), [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4])


def test_selected_tree(tree3):
    _, _, t = tree3
    # Best 5 of the candidates: ids 0 (.6), 2 (.30), 1 (.25), 6 (.21), 4 (.20) -> creation order [0, 1, 2, 4, 6].
    np.testing.assert_array_equal(np.asarray(t.candidate[0]), [-1, 0, 1, 2, 4, 6])
    np.testing.assert_array_equal(np.asarray(t.tokens[0]), [ROOT_TOKEN, 3, 5, 1, 4, 7])
    np.testing.assert_array_equal(np.asarray(t.parent[0]), [-1, 0, 0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(t.depth[0]), [0, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(t.positions), PREFIX[:, None] + np.array([0, 1, 1, 2, 2, 3]))
    expected_mask = np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1]], bool)
    np.testing.assert_array_equal(np.asarray(t.mask[0]), expected_mask)
    np.testing.assert_array_equal(np.asarray(t.mask[1]), expected_mask)
    np.testing.assert_array_equal(np.asarray(t.first_child[0]), [1, 3, 4, 5, -1, -1])
    np.testing.assert_array_equal(np.asarray(t.next_sibling[0]), [-1, 2, -1, -1, -1, -1])
    np.testing.assert_allclose(np.asarray(t.scores[0]), [1.0, 0.6, 0.25, 0.30, 0.20, 0.21], rtol=1e-5)


def test_draft_sees_true_ancestors_and_parent_state(tree3):
    (seen_h, seen_anc, seen_tok), _, _ = tree3
    # Step 1 runs the depth-1 frontier {3, 5}: both fed the root's h, no ancestors in the tree buffer.
    np.testing.assert_array_equal(np.asarray(seen_tok[1, 0]), [3, 5])
    np.testing.assert_array_equal(np.asarray(seen_h[1, 0]), -np.ones((2, V)))
    assert not np.asarray(seen_anc[1]).any()
    # Step 2 runs {1 (child of 3, buffer slot 0), 4 (child of 5, slot 1)}: each fed its own parent's h_out.
    np.testing.assert_array_equal(np.asarray(seen_tok[2, 0]), [1, 4])
    np.testing.assert_array_equal(np.asarray(seen_h[2, 0]), np.eye(V)[[3, 5]] * 10 + 1)
    np.testing.assert_array_equal(np.asarray(seen_anc[2, 0]), [[1, 0, 0, 0], [0, 1, 0, 0]])


def test_equal_scores_keep_parents_before_children():
    # Child prob 1.0 makes a child's score equal to its parent's; with room for 3 nodes, the parents win the ties.
    child = np.zeros((V, V), np.float32)
    child[:, 6] = 1.0
    root_p = np.array([[0.5, 0.5]], np.float32)
    root_ids = np.array([[2, 3]], np.int32)
    global CHILD
    saved, CHILD = CHILD, child
    try:
        _, _, t = build(2, 2, 4, root_p, root_ids)
    finally:
        CHILD = saved
    np.testing.assert_array_equal(np.asarray(t.candidate[0]), [-1, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(t.tokens[0]), [ROOT_TOKEN, 2, 3, 6])
    np.testing.assert_array_equal(np.asarray(t.parent[0]), [-1, 0, 0, 1])


def test_chain():
    root_p = np.array([[0.9]], np.float32)
    root_ids = np.array([[3]], np.int32)
    _, _, t = build(3, 1, 4, root_p, root_ids)  # 3 -> 1 (0.5) -> 7 (0.7)... chain of the argmax
    np.testing.assert_array_equal(np.asarray(t.tokens[0]), [ROOT_TOKEN, 3, 1, 7])
    np.testing.assert_array_equal(np.asarray(t.parent[0]), [-1, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(t.mask[0]), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(np.asarray(t.first_child[0]), [1, 2, 3, -1])
    np.testing.assert_array_equal(np.asarray(t.next_sibling[0]), [-1, -1, -1, -1])


def test_chain_mode_error():
    with pytest.raises(ValueError, match="num_draft_tokens must be num_steps \\+ 1 = 4"):
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=8)
    with pytest.raises(ValueError, match="exceeds"):
        SpecConfig(num_steps=1, topk=2, num_draft_tokens=4)
    SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    SpecConfig(num_steps=5, topk=8, num_draft_tokens=64)


def literal_tree(b):
    """The (3, 2, 6) tree above as plain arrays, for acceptance tests: tokens [R, 3, 5, 1, 4, 7]."""
    parent = np.array([-1, 0, 0, 1, 2, 3], np.int32)
    tok = np.array([ROOT_TOKEN, 3, 5, 1, 4, 7], np.int32)
    t = lambda a: jnp.asarray(np.broadcast_to(a, (b,) + a.shape).copy())
    return tree_lib.Tree(tokens=t(tok), parent=t(parent), depth=t(np.array([0, 1, 1, 2, 2, 3], np.int32)),
                         positions=t(np.zeros(6, np.int32)), mask=tree_lib.ancestor_mask(t(parent), 3),
                         first_child=tree_lib.first_child(t(parent)), next_sibling=tree_lib.next_sibling(t(parent)),
                         scores=t(np.ones(6, np.float32)), candidate=t(np.arange(6, dtype=np.int32)))


def test_greedy_acceptance_literal():
    t = literal_tree(4)
    argmax = np.array([
        [3, 1, 0, 2, 0, 0],  # 3 -> 1 -> (argmax 2: no such child) stop; bonus 2
        [6, 0, 0, 0, 0, 0],  # no child of the root is 6: nothing accepted, bonus 6
        [5, 0, 4, 0, 1, 0],  # 5 -> 4 (a leaf); bonus = argmax at node 4 = 1
        [3, 1, 0, 7, 0, 2],  # 3 -> 1 -> 7: the full depth; bonus 2
    ], np.int32)
    acc = jax.jit(verify.greedy_accept, static_argnums=2)(t, jnp.asarray(argmax), 3)
    np.testing.assert_array_equal(np.asarray(acc.accept_len), [2, 0, 2, 3])
    np.testing.assert_array_equal(np.asarray(acc.path), [[0, 1, 3, 0], [0, 0, 0, 0], [0, 2, 4, 0], [0, 1, 3, 5]])
    np.testing.assert_array_equal(np.asarray(acc.tokens), [[3, 1, 2, 0], [6, 0, 0, 0], [5, 4, 1, 0], [3, 1, 7, 2]])
    np.testing.assert_array_equal(np.asarray(acc.bonus), [2, 6, 1, 2])


def test_sampling_acceptance_literal():
    # At the root p = {3: 0.2, 5: 0.3, 6: 0.5}; at node 1 (token 3) p = {1: 1.0}; node 3 (token 1) p = {2: 1.0}.
    t = literal_tree(3)
    probs = np.zeros((3, 6, V), np.float32)
    probs[:, 0, [3, 5, 6]] = [0.2, 0.3, 0.5]
    probs[:, 1, 1] = 1.0
    probs[:, 3, 2] = 1.0
    probs[:, 2, 4] = 1.0
    probs[:, 4, 0] = 1.0
    coins = np.array([[0.1, 0.5, 0.5], [0.4, 0.5, 0.5], [0.7, 0.5, 0.5]], np.float32)
    acc = jax.jit(verify.sample_accept, static_argnums=3)(t, jnp.asarray(probs), _uniforms(coins), 3)
    # The target's draw at the root, in id order: 3 for u in [0, 0.2), 5 in [0.2, 0.5), 6 in [0.5, 1).
    # Row 0: u 0.1 draws 3 -> node 1; then 1 -> node 3 (p = 1); at node 3 the draw is 2, not its child 7: the
    # bonus is 2.
    # Row 1: u 0.4 draws 5 -> node 2 (token 5); node 2's p = {4: 1} -> node 4 (leaf); the bonus is 0.
    # Row 2: u 0.7 draws 6, no child of the root: nothing accepted, the bonus is 6.
    np.testing.assert_array_equal(np.asarray(acc.accept_len), [2, 2, 0])
    np.testing.assert_array_equal(np.asarray(acc.tokens), [[3, 1, 2, 0], [5, 4, 0, 0], [6, 0, 0, 0]])


def _uniforms(coins, second=0.5):
    """``sample_accept``'s draws f32[B, S+1, 2] from one coin per level (the last level's: 0.5): [:, d, 0] the coin
    of depth d, [:, d, 1] ``second`` (a relaxed bonus's draw)."""
    coins = np.asarray(coins, np.float32)
    first = np.concatenate([coins, np.full((coins.shape[0], 1), 0.5, np.float32)], axis=1)
    return jnp.asarray(np.stack([first, np.full_like(first, second)], axis=-1))


def _literal_sampling_case(b):
    """The literal tree with the distributions of ``test_sampling_acceptance_literal``."""
    probs = np.zeros((b, 6, V), np.float32)
    probs[:, 0, [3, 5, 6]] = [0.2, 0.3, 0.5]
    probs[:, 1, 1] = probs[:, 3, 2] = probs[:, 2, 4] = probs[:, 4, 0] = 1.0
    return literal_tree(b), jnp.asarray(probs)


@pytest.mark.parametrize("single, acc, want_len, want_tokens", [
    (1.0, 1.0, 0, [6, 0, 0, 0]),  # lossless: u 0.7 draws 6, no child of the root: the bonus is 6
    (0.25, 1.0, 2, [5, 4, 0, 0]),  # p(5) = 0.3 >= 0.25: node 2, then its only token 4 (p 1), bonus 0
    (1.0, 0.5, 2, [5, 4, 0, 0]),  # 0.7 >= 0.2 / 0.5 for token 3, 0.7 < 0.5 / 0.5 for token 5
    (1.0, 0.0, 2, [3, 1, 2, 0]),  # acc 0 (SGLang floors it at 1e-9): the first child with any probability, not 7
])
def test_relaxed_sampling_acceptance_literal(single, acc, want_len, want_tokens):
    t, probs = _literal_sampling_case(1)
    got = verify.sample_accept(t, probs, _uniforms([[0.7, 0.5, 0.5]]), 3, verify.Thresholds(single, acc))
    assert int(got.accept_len[0]) == want_len
    np.testing.assert_array_equal(np.asarray(got.tokens[0]), want_tokens)


def _sibling_walk(parent, tokens, probs, coins, num_steps, single, acc):
    """SGLang's relaxed tree acceptance as its kernel states it, one row at a time: at each level try the children of
    the current node in index order, adding each one's target probability to a running sum; the first child with
    coin < sum / acc or p >= single is accepted (the sum restarts below it); none = stop. Returns the accepted node
    path and the residual the bonus is drawn from (p at the last node without the tried children)."""
    cur, path = 0, [0]
    for d in range(num_steps):
        total, nxt = np.float32(0.0), None
        for c in np.flatnonzero(parent == cur):
            p = probs[cur, tokens[c]]
            total = np.float32(total + p)
            if coins[d] < total / np.float32(max(acc, 1e-9)) or p >= single:
                nxt = c
                break
        if nxt is None:
            break
        cur = nxt
        path.append(cur)
    resid = probs[cur].copy()
    resid[tokens[parent == cur]] = 0.0
    return path, resid


def _random_trees(rng, b, m, num_steps):
    """Random trees of m nodes (each node's parent an earlier node above the depth limit), siblings' tokens apart."""
    parent = np.full((b, m), -1, np.int32)
    tokens = np.zeros((b, m), np.int32)
    depth = np.zeros((b, m), np.int32)
    for r in range(b):
        for i in range(1, m):
            parent[r, i] = rng.choice(np.flatnonzero(depth[r, :i] < num_steps))
            depth[r, i] = depth[r, parent[r, i]] + 1
            taken = tokens[r, 1:i][parent[r, 1:i] == parent[r, i]]
            tokens[r, i] = rng.choice(np.setdiff1d(np.arange(V), taken))
    j = lambda a: jnp.asarray(a)
    return tree_lib.Tree(tokens=j(tokens), parent=j(parent), depth=j(depth), positions=j(depth),
                         mask=tree_lib.ancestor_mask(j(parent), num_steps), first_child=tree_lib.first_child(j(parent)),
                         next_sibling=tree_lib.next_sibling(j(parent)), scores=j(np.ones((b, m), np.float32)),
                         candidate=j(np.tile(np.arange(m, dtype=np.int32), (b, 1))))


def _draw_walk(parent, tokens, probs, coins, num_steps):
    """The lossless rule as plain sampling draws a token, one row at a time in float64: at each level the target's
    token is the one whose cumulative interval (ids in order) holds u x the mass, u the level's coin; the child
    holding it is accepted, else it is the bonus. Returns the accepted node path and the bonus."""
    cur, path = 0, [0]
    for d in range(num_steps + 1):
        p = probs[cur].astype(np.float64)
        y = int((np.cumsum(p) <= coins[d] * p.sum()).sum())
        hit = np.flatnonzero((parent == cur) & (tokens == y))
        if d == num_steps or not len(hit):
            return path, y
        cur = int(hit[0])
        path.append(cur)


@pytest.mark.parametrize("single, acc", [(1.0, 1.0), (0.3, 1.0), (1.0, 0.6), (0.5, 0.8), (0.0, 1.0), (1.0, 0.0)])
def test_relaxed_acceptance_is_sglangs_sibling_walk(single, acc):
    """``sample_accept`` with ``Thresholds(single, acc)`` accepts the nodes that SGLang's sibling walk accepts, row by
    row over 64 random (4, *, 10) trees with sparse random distributions and coins, and draws its bonus from that
    walk's residual; (1, 1), the lossless rule, takes at each level the child holding the target's own draw
    (``_draw_walk``: plain sampling's token for the coin), else that draw is the bonus."""
    rng = np.random.default_rng(7)
    b, m, s = 64, 10, 4
    tree = _random_trees(rng, b, m, s)
    probs = rng.dirichlet(np.full(V, 0.3), size=(b, m)).astype(np.float32)
    coins = rng.random((b, s + 1), dtype=np.float32)
    uniforms = jnp.asarray(np.stack([coins, rng.random((b, s + 1), dtype=np.float32)], axis=-1))
    got = jax.jit(verify.sample_accept, static_argnums=(3, 4))(tree, jnp.asarray(probs), uniforms, s,
                                                               verify.Thresholds(single, acc))
    parent, tokens = np.asarray(tree.parent), np.asarray(tree.tokens)
    lengths = []
    for r in range(b):
        if (single, acc) == (1.0, 1.0):
            path, bonus = _draw_walk(parent[r], tokens[r], probs[r], coins[r], s)
            assert int(got.bonus[r]) == bonus, r
        else:
            path, resid = _sibling_walk(parent[r], tokens[r], probs[r], coins[r], s, single, acc)
            assert resid[int(got.bonus[r])] > 0, (r, int(got.bonus[r]), resid)
        n = len(path) - 1
        lengths.append(n)
        assert int(got.accept_len[r]) == n, r
        np.testing.assert_array_equal(np.asarray(got.path[r, :n + 1]), path)
        np.testing.assert_array_equal(np.asarray(got.tokens[r, :n]), tokens[r, path[1:]])
    assert 0 < np.mean(lengths) < s or (single, acc) in ((0.0, 1.0), (1.0, 0.0))  # the cases are not all trivial
