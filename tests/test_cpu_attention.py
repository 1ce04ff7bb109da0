"""specjax's CPU paged-attention kernel (``kernels.cpu_dense.paged_attention``): agreement with the XLA
``layers.paged_attention`` (new keys from the pool or from k, v; fewer or more new keys than queries; packed pools;
bf16), bits of a chain row and of a tree node equal to the decode step at its position whatever the tokens or
threads, and that ``layers.attend`` routes cache attention to it on a CPU."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache, layers
from specjax.kernels import cpu_dense

pytestmark = [pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernels cannot be built (layers keep XLA's attention)"),
              pytest.mark.usefixtures("cpu_kernels")]

L, K, G, H, Z = 3, 2, 3, 64, 16


def _case(b=3, t=4, tk=4, pps=8, dtype=jnp.float32, lengths=(37, 0, 90), seed=0, packed=False, kv_heads=K, g=G, h=H):
    ks = jax.random.split(jax.random.key(seed), 6)
    pages = b * pps + 2
    shape = (L, pages, kv_heads, Z, h)
    kp = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    vp = jax.random.normal(ks[1], shape, jnp.float32).astype(dtype)
    if packed:  # the lane-packed layout: the same bytes as [L, P, K, Z/2, 2H]
        kp, vp = (p.reshape(L, pages, kv_heads, Z // 2, 2 * h) for p in (kp, vp))
    q = jax.random.normal(ks[2], (b, t, kv_heads * g, h), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[3], (b, tk, kv_heads, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[4], (b, tk, kv_heads, h), jnp.float32).astype(dtype)
    mask = jax.random.bernoulli(ks[5], 0.6, (b, t, tk))
    table = jnp.asarray(np.random.default_rng(seed).permutation(pages)[:b * pps].reshape(b, pps), jnp.int32)
    return q, k, v, mask, kp, vp, table, jnp.asarray(lengths[:b], jnp.int32)


def _xla(q, k, v, mask, kp, vp, table, lengths, layer, keys_in_pool):
    return layers.paged_attention(q, k, v, mask, kp, vp, table, lengths, None, H ** -0.5, layer=layer,
                                  keys_in_pool=keys_in_pool)


# New keys in the pool are the queries' own tokens (tk == t == 4); from k, v there may be more (a draft tree buffer).
CASES = [(in_pool, dtype, packed, 4) for in_pool in (False, True)
         for dtype, packed in ((jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, False))]
CASES.append((False, jnp.float32, False, 7))


@pytest.mark.parametrize("keys_in_pool,dtype,packed,tk", CASES)
def test_matches_xla_paged_attention(keys_in_pool, dtype, packed, tk):
    q, k, v, mask, kp, vp, table, lengths = _case(tk=tk, dtype=dtype, packed=packed)
    for layer in (0, 2):
        want = _xla(q, k, v, mask, kp, vp, table, lengths, layer, keys_in_pool)
        got = cpu_dense.paged_attention(q, k, v, mask, kp, vp, table, lengths, layer, H ** -0.5, keys_in_pool)
        tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5  # XLA rounds the softmax weights to bf16 for a bf16 pool
        np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_kv_head_shared_among_threads(dtype):
    """With fewer (row, kv head) pairs than threads (one kv head at batch 1) a pair's queries are cut into runs, one
    per thread: XLA's result, and the same bits as on one thread and as each token's one-token step."""
    q, k, v, _, kp, vp, table, lengths = _case(b=1, t=4, tk=4, lengths=(70,), dtype=dtype, kv_heads=1)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), (1, 4, 4))
    runs = []
    for threads in (2, 1):
        cpu_dense.set_threads(threads)
        runs.append(np.asarray(cpu_dense.paged_attention(q, k, v, causal, kp, vp, table, lengths, 1, H ** -0.5,
                                                         True)))
    np.testing.assert_array_equal(runs[0], runs[1])
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    want = _xla(q, k, v, causal, kp, vp, table, lengths, 1, True)
    np.testing.assert_allclose(runs[0], np.asarray(want, np.float32), rtol=tol, atol=tol)
    cpu_dense.set_threads(2)
    for t in range(4):
        one = cpu_dense.paged_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], jnp.ones((1, 1, 1), bool),
                                        kp, vp, table, lengths + t, 1, H ** -0.5, True)
        np.testing.assert_array_equal(np.asarray(one)[:, 0], runs[0][:, t])


def test_a_query_that_sees_nothing_gives_zero():
    q, k, v, mask, kp, vp, table, _ = _case()
    got = cpu_dense.paged_attention(q, k, v, jnp.zeros_like(mask), kp, vp, table, jnp.zeros((3,), jnp.int32), 1,
                                    H ** -0.5, False)
    assert not np.asarray(got).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lengths", [(37, 0, 90), (44, 12, 94)])
def test_chain_rows_are_the_decode_steps_bits(dtype, lengths):
    """Row t of a causal chain over keys in the pool == a one-token step at lengths + t, bit for bit, 1 or 2 threads.
    The second lengths cross a multiple of 16 within the chain: a key that the chain scores alone (a new key) the
    later one-token steps score in a block of sixteen prefix keys (``Dot16``), which must give ``Dot``'s bits."""
    q, k, v, _, kp, vp, table, lengths = _case(t=5, tk=5, dtype=dtype, lengths=lengths)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (3, 5, 5))
    for threads in (1, 2):
        cpu_dense.set_threads(threads)
        chain = np.asarray(cpu_dense.paged_attention(q, k, v, causal, kp, vp, table, lengths, 1, H ** -0.5, True))
        for t in range(5):
            one = cpu_dense.paged_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], jnp.ones((3, 1, 1), bool),
                                            kp, vp, table, lengths + t, 1, H ** -0.5, True)
            np.testing.assert_array_equal(np.asarray(one)[:, 0], chain[:, t])


def _write_pool(pool, table, lengths_at, row_vectors, layer):
    """pool with row_vectors[b] ([H] for each kv head: [K, H]) written at position lengths_at[b] of row b."""
    pool = np.array(pool)
    for b, p in enumerate(lengths_at):
        pool[layer, table[b, p // Z], :, p % Z] = row_vectors[b]
    return jnp.asarray(pool)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tree_nodes_are_the_decode_steps_bits(dtype):
    """A tree node reading its ancestors from k, v under the ancestor mask (not in the pool) == the one-token decode
    step at its depth once its path is in the pool, bit for bit, 1 or 2 threads: its ancestors are summed where the
    decode step finds them (right after the prefix), not at their indices in the tree."""
    parent = [-1, 0, 0, 1, 2, 2, 3, 5, 4]
    m = len(parent)
    q, k, v, _, kp, vp, table, lengths = _case(t=m, tk=m, dtype=dtype, lengths=(44, 12, 94))
    anc = np.eye(m, dtype=bool)
    for i in range(1, m):
        anc[i] |= anc[parent[i]]
    mask = jnp.broadcast_to(jnp.asarray(anc), (3, m, m))
    table_np, lens = np.asarray(table), np.asarray(lengths)
    for threads in (1, 2):
        cpu_dense.set_threads(threads)
        tree = np.asarray(cpu_dense.paged_attention(q, k, v, mask, kp, vp, table, lengths, 1, H ** -0.5, False))
        for node in range(m):
            path = [j for j in range(m) if anc[node, j]]  # root first: a parent has a smaller index
            kw, vw = kp, vp
            for d, j in enumerate(path):
                kw = _write_pool(kw, table_np, lens + d, np.asarray(k[:, j]), 1)
                vw = _write_pool(vw, table_np, lens + d, np.asarray(v[:, j]), 1)
            one = cpu_dense.paged_attention(q[:, node:node + 1], k[:, node:node + 1], v[:, node:node + 1],
                                            jnp.ones((3, 1, 1), bool), kw, vw, table, lengths + len(path) - 1, 1,
                                            H ** -0.5, True)
            np.testing.assert_array_equal(np.asarray(one)[:, 0], tree[:, node], err_msg=f"node {node}")


def test_positions_past_the_page_table_are_not_seen():
    """A released slot keeps a stale length (up to the table's capacity, the new tokens past it): as on the XLA path,
    only the positions the page table holds are read."""
    q, k, v, mask, kp, vp, table, _ = _case(t=1, tk=1)
    full = jnp.asarray([8 * Z, 8 * Z - 1, 8 * Z + 5], jnp.int32)  # 8 pages per row
    for in_pool in (True, False):
        want = _xla(q, k, v, mask, kp, vp, table, full, 1, in_pool)
        got = cpu_dense.paged_attention(q, k, v, mask, kp, vp, table, full, 1, H ** -0.5, in_pool)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_bad_operands_are_refused():
    q, k, v, mask, kp, vp, table, lengths = _case()
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(cpu_dense.paged_attention(q, k, v, mask, kp, vp, table, lengths, L, 0.1, True))
    with pytest.raises(Exception, match="shapes do not match"):
        jax.block_until_ready(cpu_dense.paged_attention(q, k, v, mask[:, :, :2], kp, vp, table, lengths, 0, 0.1,
                                                        False))


def test_attend_routes_cache_attention_to_the_kernel():
    q, k, v, mask, kp, vp, table, lengths = _case()
    args = (q, k, v, mask, kp, vp, table, lengths)
    run = jax.jit(lambda q, k, v, mask, *cache: layers.attend(q, k, v, mask, H ** -0.5, *cache, layer=1))
    assert "specjax_paged_attention" in run.lower(*args).as_text()
    with cpu_dense.disabled():
        run_xla = jax.jit(lambda q, k, v, mask, *cache: layers.attend(q, k, v, mask, H ** -0.5, *cache, layer=1))
        assert "specjax_paged_attention" not in run_xla.lower(*args).as_text()
        want = run_xla(*args)
    np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(want), rtol=2e-5, atol=2e-5)
    # one layer's pool, no layer axis
    np.testing.assert_allclose(np.asarray(layers.attend(q, k, v, mask, H ** -0.5, kp[1], vp[1], table, lengths)),
                               np.asarray(want), rtol=2e-5, atol=2e-5)
    assert kv_cache.page_size_of(kp, H) == Z


# A prompt chunk (16 new tokens and up, keys read from k, v): the blocked path, tokens in blocks of 16 and keys in
# blocks of 64 positions. Chunks that end mid-block, a prefix that ends mid-block, a kv head of 1 / 3 / 4 queries
# (SmolLM2's 3, Llama's 4: register tiles of 6 rows and their remainders), a head dim that is not whole vectors.
PROMPT_CASES = [(16, (0, 37, 90), 3, 64, jnp.float32, False), (40, (64, 5, 130), 3, 64, jnp.float32, True),
                (130, (0, 71, 20), 4, 64, jnp.bfloat16, False), (33, (16, 0, 100), 1, 48, jnp.float32, False)]


@pytest.mark.parametrize("t,lengths,g,h,dtype,packed", PROMPT_CASES)
def test_prompt_chunks_match_xla_paged_attention(t, lengths, g, h, dtype, packed):
    """A causal prompt chunk with padding rows (seeing no key of the chunk) and any mask (a chunk need not be
    causal): XLA's paged attention, on one thread and on two; with no prefix and nothing seen, 0."""
    q, k, v, rand, kp, vp, table, ln = _case(t=t, tk=t, pps=(max(lengths) + t) // Z + 2, lengths=lengths,
                                            dtype=dtype, packed=packed, g=g, h=h)
    valid = jnp.arange(t)[None] < jnp.asarray([t, t - 5, t - 9])[:, None]
    causal = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :] & valid[:, :, None]
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5  # XLA rounds the softmax weights to bf16 for a bf16 pool
    for mask in (causal, rand):
        want = layers.paged_attention(q, k, v, mask, kp, vp, table, ln, None, h ** -0.5, layer=2)
        for threads in (1, 2):
            cpu_dense.set_threads(threads)
            got = cpu_dense.paged_attention(q, k, v, mask, kp, vp, table, ln, 2, h ** -0.5, False)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=tol, atol=tol)
    nothing = cpu_dense.paged_attention(q, k, v, jnp.zeros_like(causal), kp, vp, table, jnp.zeros((3,), jnp.int32),
                                        2, h ** -0.5, False)
    assert not np.asarray(nothing).any()


def test_attend_routes_a_prompt_chunk_to_the_blocked_kernel():
    """``layers.attend`` takes the kernel for a prompt chunk (its keys from k, v); with keys in the pool (a long
    verified chain, never the kernel's few tokens) it keeps XLA's block loop."""
    q, k, v, _, kp, vp, table, lengths = _case(t=20, tk=20)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((20, 20), bool)), (3, 20, 20))
    for in_pool, routed in ((False, True), (True, False)):
        run = jax.jit(lambda q, k, v, mask, *cache: layers.attend(q, k, v, mask, H ** -0.5, *cache, layer=1,
                                                                  causal=True, keys_in_pool=in_pool))
        assert ("specjax_paged_attention" in run.lower(q, k, v, mask, kp, vp, table, lengths).as_text()) == routed
