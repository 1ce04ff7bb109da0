"""Tree-attention kernel (Pallas; interpret mode off TPU) against its jnp reference and layers.attention: random trees,
lengths (0, exact page multiples, partial pages), shuffled page tables, GQA layouts, fp32 and bf16, with every unused
cache slot set to NaN so that any out-of-bounds read shows; input validation; and target.forward end to end."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache, layers, plain_step as decode
from specjax.config import ModelConfig
from specjax.kernels.tree_attention import make_cache_attention, ref_tree_attention, tree_attention
from specjax.models import target

ref_attention = jax.jit(ref_tree_attention, static_argnames="sm_scale")
INTERPRET = jax.default_backend() != "tpu"  # on a TPU the same tests run the compiled kernel


def random_tree_mask(rng, t):
    """bool[T, T] ancestor mask (self included) of a random tree in creation order (parent[i] < i)."""
    mask = np.eye(t, dtype=bool)
    for i in range(1, t):
        mask[i] |= mask[rng.integers(0, i)]
    return mask


def make_case(seed, *, t, kv_heads, groups, head_dim, page_size, pages_per_seq, lengths, dtype=jnp.float32):
    """Random inputs; every pool slot that no sequence may read (unreferenced pages, slots >= length) is NaN, and
    page-table entries past a sequence's last page point outside the pool."""
    rng = np.random.default_rng(seed)
    b, n = len(lengths), kv_heads * groups
    num_pages = b * pages_per_seq + 3
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k, v = normal(b, t, n, head_dim), normal(b, t, kv_heads, head_dim), normal(b, t, kv_heads, head_dim)
    mask = np.stack([random_tree_mask(rng, t) for _ in range(b)])
    k_pages = np.full((num_pages, kv_heads, page_size, head_dim), np.nan, np.float32)  # head-major pages
    v_pages = k_pages.copy()
    page_table = rng.permutation(num_pages)[:b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    for i, length in enumerate(lengths):
        for p in range(pages_per_seq):
            live = min(max(length - p * page_size, 0), page_size)
            if live == 0:
                page_table[i, p] = rng.choice([-1, num_pages + 5])  # never dereferenced
                continue
            k_pages[page_table[i, p], :, :live] = normal(live, kv_heads, head_dim).transpose(1, 0, 2)
            v_pages[page_table[i, p], :, :live] = normal(live, kv_heads, head_dim).transpose(1, 0, 2)
    arrays = [jnp.asarray(x, dtype) for x in (q, k, v)]
    arrays += [jnp.asarray(mask)] + [jnp.asarray(x, dtype) for x in (k_pages, v_pages)]
    return arrays + [jnp.asarray(page_table), jnp.asarray(lengths, jnp.int32)]


@functools.partial(jax.jit, static_argnames="sm_scale")
def layers_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, *, sm_scale):
    """target.forward's XLA path: layers.attention over the gathered pages."""
    s = page_table.shape[1] * k_pages.shape[2]
    cache_valid = jnp.broadcast_to(jnp.arange(s)[None, None, :] < lengths[:, None, None], (*mask.shape[:2], s))
    return layers.xla_cache_attention(q, k, v, mask, k_pages, v_pages, page_table, cache_valid, sm_scale)


CASES = {
    # name: (T, K, G, H, page size, pages per seq, lengths, pages_per_block, dtype)
    "decode-like T=1, N=K": (1, 2, 1, 64, 4, 5, [0, 8, 13], 2, jnp.float32),
    "T=5, N=4K, H=128": (5, 2, 4, 128, 4, 4, [16, 0, 6], None, jnp.float32),
    "T=16, one kv head": (16, 1, 4, 64, 8, 3, [8, 24, 17], 1, jnp.float32),
    "T=5, odd K": (5, 3, 1, 64, 4, 3, [4, 9, 0], 2, jnp.float32),
    "bf16, N=4K": (5, 2, 4, 64, 4, 4, [12, 0, 7], 2, jnp.bfloat16),
    "bf16, odd K, T=37 (two mask words)": (37, 3, 2, 64, 4, 3, [5, 12, 0], 1, jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_layers_attention(name):
    t, kh, g, h, z, pps, lengths, pb, dtype = CASES[name]
    args = make_case(list(CASES).index(name), t=t, kv_heads=kh, groups=g, head_dim=h, page_size=z,
                     pages_per_seq=pps, lengths=lengths, dtype=dtype)
    scale = h ** -0.5
    got = tree_attention(*args, sm_scale=scale, interpret=INTERPRET, pages_per_block=pb)
    assert got.shape == args[0].shape and got.dtype == dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    ref = np.asarray(ref_attention(*args, sm_scale=scale), np.float32)
    xla = np.asarray(layers_attention(*args, sm_scale=scale), np.float32)
    assert np.isfinite(ref).all() and np.isfinite(xla).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got, xla, atol=1e-5, rtol=0)
    else:  # bf16 inputs and output (1 ulp ~ 8e-3 near 1); also close to fp32 math on the same inputs
        np.testing.assert_allclose(got, ref, atol=2e-2, rtol=0)
        np.testing.assert_allclose(got, xla, atol=2e-2, rtol=0)
        f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
        np.testing.assert_allclose(got, np.asarray(ref_attention(*f32, sm_scale=scale)), atol=3e-2, rtol=0)


@pytest.mark.parametrize("name", ["T=5, odd K", "bf16, N=4K"])
def test_kernel_reads_one_layer_of_a_stacked_pool(name):
    """Model layer loops hand the kernel every layer's pool [L, P, K, Z, H] and the layer to read (a per-layer slice
    passed to a custom call is a copy of the layer's pool on every step): the other layers (NaN here) are never
    read, with the layer a Python int or a traced scalar."""
    t, kh, g, h, z, pps, lengths, pb, dtype = CASES[name]
    args = make_case(11, t=t, kv_heads=kh, groups=g, head_dim=h, page_size=z, pages_per_seq=pps, lengths=lengths,
                     dtype=dtype)
    one = tree_attention(*args, sm_scale=h ** -0.5, interpret=INTERPRET, pages_per_block=pb)
    junk = jnp.full_like(args[4], jnp.nan)
    stacked = [jnp.stack([junk, pool, junk]) for pool in args[4:6]]
    args = args[:4] + stacked + args[6:]
    got = tree_attention(*args, sm_scale=h ** -0.5, interpret=INTERPRET, pages_per_block=pb, layer=1)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(one, np.float32))
    traced = jax.jit(lambda i, *a: tree_attention(*a, sm_scale=h ** -0.5, interpret=INTERPRET, pages_per_block=pb,
                                                  layer=i))(jnp.int32(1), *args)
    np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(one, np.float32))
    ref = ref_tree_attention(*args, sm_scale=h ** -0.5, layer=1)
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(one, np.float32), atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="need the layer"):
        tree_attention(*args, sm_scale=h ** -0.5, interpret=INTERPRET)
    with pytest.raises(ValueError, match="outside the pool"):  # the kernel itself clamps a traced layer
        ref_tree_attention(*args, sm_scale=h ** -0.5, layer=3)


@pytest.mark.parametrize("name", ["decode-like T=1, N=K", "T=5, odd K", "bf16, N=4K"])
def test_lane_packed_pool_gives_the_same_attention(name):
    """A pool of head dim 64 lane-packed as the server allocates it on any backend ([P, K, Z/2, 128]:
    kv_cache.pack_factor; the same bytes, a row-major reshape): kernel, reference and the XLA path read it as the
    unpacked pool (the kernel folds even and odd slots separately: equal up to rounding), NaN slots included, one
    layer or the stacked pool at a layer."""
    t, kh, g, h, z, pps, lengths, pb, dtype = CASES[name]
    args = make_case(21, t=t, kv_heads=kh, groups=g, head_dim=h, page_size=z, pages_per_seq=pps, lengths=lengths,
                     dtype=dtype)
    scale = h ** -0.5
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    want = tree_attention(*args, sm_scale=scale, interpret=INTERPRET, pages_per_block=pb)
    packed = [p.reshape(p.shape[0], kh, z // 2, 2 * h) for p in args[4:6]]
    pargs = args[:4] + packed + args[6:]
    assert kv_cache.page_size_of(packed[0], h) == z
    got = tree_attention(*pargs, sm_scale=scale, interpret=INTERPRET, pages_per_block=pb)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)
    stacked = [jnp.stack([jnp.full_like(p, jnp.nan), p]) for p in packed]
    got = tree_attention(*args[:4], *stacked, *args[6:], sm_scale=scale, interpret=INTERPRET, pages_per_block=pb,
                         layer=1)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)
    for fn in (functools.partial(ref_attention, sm_scale=scale),
               lambda *a: layers.paged_attention(*a, None, scale, block_tokens=2 * z)):
        np.testing.assert_allclose(np.asarray(fn(*pargs), np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)


@pytest.mark.parametrize("h, z", [(64, 16), (32, 32)])
def test_write_into_a_lane_packed_pool(h, z):
    """kv_cache.write scatters rows of head_dim into the packed pool (two slots per 128-lane row at head dim 64, four
    at 32) where the unpacked pool has them (dropped entries and out-of-table positions included)."""
    rng = np.random.default_rng(3)
    nl, kh, b, f = 2, 3, 2, 128 // h
    packed = kv_cache.init_cache(nl, kh, h, b, 64, page_size=z, dtype=jnp.float32, num_pages=12)
    assert packed.k.shape == (nl, 12, kh, z // f, f * h)
    plain = dataclasses.replace(packed, k=packed.k.reshape(nl, 12, kh, z, h), v=packed.v.reshape(nl, 12, kh, z, h))
    k_new, v_new = (jnp.asarray(rng.standard_normal((nl, b, 70, kh, h)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32)[None], (b, 70))  # 64.. fall off the table
    valid = jnp.asarray(rng.random((b, 70)) < 0.7)
    got, want = (kv_cache.write(c, k_new, v_new, positions, valid) for c in (packed, plain))
    np.testing.assert_array_equal(np.asarray(got.k).reshape(want.k.shape), np.asarray(want.k))
    np.testing.assert_array_equal(np.asarray(got.v).reshape(want.v.shape), np.asarray(want.v))


def test_tpu_default_page_size_packs_small_head_dims():
    """Without --page-size a TPU pool of a small head dim gets the smallest page that packs it (an unpacked one is
    padded to 128 lanes there, and its write copied it every step); other platforms and head dim 128 keep 16."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert kv_cache.pool_shape(2, 12, 3, 16, 64, f32) == (2, 12, 3, 8, 128)
    assert kv_cache.pool_shape(2, 12, 3, 16, 64, bf16) == (2, 12, 3, 16, 64)  # 8-row bf16 tiles: unpacked
    assert kv_cache.pool_shape(2, 12, 3, 32, 64, bf16) == (2, 12, 3, 16, 128)
    assert kv_cache.pool_shape(2, 12, 3, 16, 128, f32) == (2, 12, 3, 16, 128)
    want = {(64, f32): 16, (64, bf16): 32, (32, f32): 32, (32, bf16): 64, (128, bf16): 16, (96, f32): 16}
    for (h, dtype), z in want.items():
        assert kv_cache.default_page_size(h, dtype, "tpu") == z, (h, dtype)
        assert kv_cache.pack_factor(h, z, dtype) == (128 // h if h < 128 and 128 % h == 0 else 1)
        assert kv_cache.default_page_size(h, dtype, "cpu") == kv_cache.default_page_size(h, dtype, "gpu") == 16


def test_reference_and_layers_attention_agree_on_a_full_cache():
    """Lengths at full capacity (every slot visible) through both oracles; the kernel is covered above."""
    args = make_case(7, t=5, kv_heads=2, groups=2, head_dim=64, page_size=4, pages_per_seq=2, lengths=[8, 8])
    np.testing.assert_allclose(np.asarray(ref_attention(*args, sm_scale=0.125)),
                               np.asarray(layers_attention(*args, sm_scale=0.125)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_long_spans_attended_in_query_chunks_match_the_gathered_reference(causal):
    """300 new tokens over a paged prefix: ``paged_attention`` takes them in chunks of queries (``query_chunks``),
    with a general (tree) mask over all the new keys, or a causal one whose hidden keys it skips; the result is the
    one-block reference over the gathered pages."""
    t = 2 * layers.QUERY_CHUNK_MIN + 44
    assert len(layers.query_chunks(t, t, causal)) == 3
    q, k, v, mask, k_pages, v_pages, page_table, lengths = make_case(
        11, t=t, kv_heads=2, groups=2, head_dim=64, page_size=4, pages_per_seq=5, lengths=[17, 0])
    if causal:
        mask = layers.causal_mask(jnp.asarray(np.arange(t)[None, :] < np.array([[t - 21], [t]])))
    got = jax.jit(functools.partial(layers.paged_attention, sm_scale=0.125, positions=None, causal=causal))(
        q, k, v, mask, k_pages, v_pages, page_table, lengths)
    want = layers_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=0.125)
    seen = np.asarray(mask.any(-1))  # padding rows (nothing to see) are never read
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="as many new keys as queries"):
        layers.query_chunks(t, t + 1, True)


@pytest.mark.parametrize("t, tile, dtype, causal", [(37, 8, jnp.float32, False), (37, 16, jnp.bfloat16, True),
                                                     (64, 16, jnp.float32, True)])
def test_query_tiles_give_the_same_attention(t, tile, dtype, causal):
    """Queries cut into tiles of ``query_tile_rows`` (the grid's second axis; a long prefill chunk on a TPU): each
    tile sees every new key under its rows of the mask and streams the prefix again; the result is the one-tile
    kernel's and the reference's, the last tile padded (37 tokens in 5 tiles of 8 or 3 of 16)."""
    args = make_case(5, t=t, kv_heads=3, groups=2, head_dim=64, page_size=8, pages_per_seq=3, lengths=[19, 0, 24],
                     dtype=dtype)
    if causal:  # a prefill chunk: each new token sees the earlier ones
        args[3] = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (3, t, t))
    run = functools.partial(tree_attention, sm_scale=0.125, interpret=INTERPRET, pages_per_block=2)
    whole, tiled = run(*args), run(*args, query_tile_rows=tile)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(tiled, np.float32), np.asarray(whole, np.float32), atol=tol, rtol=0)
    ref = ref_attention(*args, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(tiled, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=0)
    with pytest.raises(ValueError, match="query_tile_rows must be a positive multiple"):
        run(*args, query_tile_rows=tile + 4)


def test_query_tile_choice():
    """All the queries in one tile when they fit the VMEM bounds; else the fewest even tiles that do: SmolLM2's
    512-token prefill chunk (9 x 64) in two tiles of 256, Llama-8B's on one chip (32 x 128, bf16) in tiles of 80;
    a span whose new keys and values alone exceed VMEM is refused with the reason."""
    from specjax.kernels.tree_attention.kernel import query_tile, tpu_unsupported_reason
    assert query_tile(9, 64, jnp.float32, 8) == 8 and query_tile(9, 64, jnp.bfloat16, 5) == 16
    assert query_tile(9, 64, jnp.float32, 256) == 256
    assert query_tile(9, 64, jnp.float32, 512) == query_tile(9, 64, jnp.bfloat16, 512) == 256
    assert query_tile(8, 128, jnp.bfloat16, 512) == 256
    assert query_tile(32, 128, jnp.bfloat16, 256) == 64
    assert tpu_unsupported_reason(32, 8, 128, 16, jnp.bfloat16, tree_tokens=256) is None
    assert "new keys and values" in tpu_unsupported_reason(32, 8, 128, 16, jnp.bfloat16, tree_tokens=2048)


def _validation_args():
    b, t, n, kh, h, p, z, pps = 2, 3, 4, 2, 64, 6, 4, 2
    f = lambda *s, dtype=jnp.float32: jnp.zeros(s, dtype)
    return dict(q=f(b, t, n, h), k=f(b, t, kh, h), v=f(b, t, kh, h), mask=f(b, t, t, dtype=bool),
                k_pages=f(p, kh, z, h), v_pages=f(p, kh, z, h), page_table=f(b, pps, dtype=jnp.int32),
                lengths=f(b, dtype=jnp.int32))


BAD_INPUTS = {
    "q rank": (dict(q=jnp.zeros((2, 3, 64))), "q must be"),
    "k length": (dict(k=jnp.zeros((2, 4, 2, 64))), "k must be"),
    "v shape": (dict(v=jnp.zeros((2, 3, 1, 64))), "v must have"),
    "GQA": (dict(q=jnp.zeros((2, 3, 3, 64))), "GQA"),
    "dtypes": (dict(q=jnp.zeros((2, 3, 4, 64), jnp.bfloat16)), "share one dtype"),
    "pool dtype": (dict(k_pages=jnp.zeros((6, 2, 4, 64), jnp.float16), v_pages=jnp.zeros((6, 2, 4, 64), jnp.float16)),
                   "float32 or bfloat16"),
    "mask vs T": (dict(mask=jnp.zeros((2, 3, 4), bool)), r"mask must be \[B, T, T\]"),
    "mask dtype": (dict(mask=jnp.zeros((2, 3, 3), jnp.float32)), "mask must be bool"),
    "pool heads": (dict(k_pages=jnp.zeros((6, 1, 4, 64)), v_pages=jnp.zeros((6, 1, 4, 64))), "pages must be"),
    "pool mismatch": (dict(v_pages=jnp.zeros((6, 2, 4, 64), jnp.bfloat16)), "must match k_pages"),
    "table batch": (dict(page_table=jnp.zeros((3, 2), jnp.int32)), "page_table must be"),
    "table dtype": (dict(page_table=jnp.zeros((2, 2), jnp.float32)), "int32"),
    "lengths shape": (dict(lengths=jnp.zeros((2, 1), jnp.int32)), "lengths must be"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_validation_errors(name):
    change, message = BAD_INPUTS[name]
    args = dict(_validation_args(), **change)
    with pytest.raises(ValueError, match=message):
        tree_attention(**args, sm_scale=0.125, interpret=INTERPRET)
    with pytest.raises(ValueError, match=message):
        ref_tree_attention(**args, sm_scale=0.125)


def test_validation_of_knobs():
    args = _validation_args()
    with pytest.raises(ValueError, match="pages_per_block"):
        tree_attention(**args, sm_scale=0.125, interpret=INTERPRET, pages_per_block=0)
    with pytest.raises(ValueError, match="sm_scale"):
        tree_attention(**args, sm_scale=-1.0, interpret=INTERPRET)


def test_make_cache_attention_selection():
    assert make_cache_attention("xla") is None
    assert (make_cache_attention("auto") is None) == (jax.default_backend() != "tpu")
    assert callable(make_cache_attention("pallas"))
    with pytest.raises(ValueError, match="unknown attention impl"):
        make_cache_attention("triton")


@pytest.mark.parametrize("dtype, t, kv_heads", [(jnp.bfloat16, 16, 8), (jnp.float32, 5, 3)])
def test_kernel_lowers_for_tpu(dtype, t, kv_heads):
    """The Pallas -> Mosaic lowering runs on any host (jax.export for platform "tpu"); Mosaic's own compiler, which
    only a TPU runtime has, is not exercised here."""
    b, g, h, p, z, pps = 2, 4, 128, 64, 16, 16
    s = jax.ShapeDtypeStruct
    args = (s((b, t, kv_heads * g, h), dtype), s((b, t, kv_heads, h), dtype), s((b, t, kv_heads, h), dtype),
            s((b, t, t), bool), s((p, kv_heads, z, h), dtype), s((p, kv_heads, z, h), dtype),
            s((b, pps), jnp.int32), s((b,), jnp.int32))
    fn = jax.jit(functools.partial(tree_attention, sm_scale=h ** -0.5))
    exported = jax.export.export(fn, platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


TINY = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=64, hidden_size=64,
                   intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False, dtype="float32")


def test_forward_with_pallas_cache_attention_matches_xla_path():
    """Prefill through a shuffled, NaN-filled paged cache, then a tree-verify-like call with an ancestor mask:
    logits and written K/V from the Pallas hook equal the XLA path's."""
    cfg, rng = TINY, np.random.default_rng(0)
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 24, page_size=8,
                                dtype=jnp.float32, num_pages=8)
    cache = dataclasses.replace(cache, k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan),
                                page_table=jnp.asarray(rng.permutation(8)[:6].reshape(2, 3), jnp.int32))
    prompts = rng.integers(0, cfg.vocab_size, size=(2, 9)).astype(np.int32)
    valid = np.arange(9)[None, :] < np.array([[7], [9]])
    tree = np.stack([random_tree_mask(rng, 5) for _ in range(2)])
    tree_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 5)), jnp.int32)

    def run(cache_attention):
        c, out = decode.prefill(params, cfg, cache, jnp.asarray(prompts), jnp.asarray(valid), all_logits=True,
                                cache_attention=cache_attention)
        positions = c.lengths[:, None] + jnp.asarray(tree.sum(-1) - 1, jnp.int32)  # prefix length + depth
        verify = target.forward(params, cfg, tree_tokens, positions, cache=c, mask=jnp.asarray(tree),
                                cache_attention=cache_attention)
        return out.logits, verify.logits, c

    run = jax.jit(run, static_argnums=0)
    xla_prefill, xla_verify, xla_cache = run(None)
    pallas_prefill, pallas_verify, pallas_cache = run(make_cache_attention("pallas"))
    assert np.isfinite(np.asarray(pallas_verify)).all()
    np.testing.assert_allclose(np.asarray(pallas_prefill)[valid], np.asarray(xla_prefill)[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(pallas_verify), np.asarray(xla_verify), atol=1e-5, rtol=0)
    written = np.isfinite(np.asarray(xla_cache.k))
    np.testing.assert_allclose(np.asarray(pallas_cache.k)[written], np.asarray(xla_cache.k)[written], atol=1e-5)


@pytest.mark.parametrize("kv_heads, tp", [(2, 2), (3, 2)])
def test_pallas_hook_on_a_tp_mesh_matches_reference(kv_heads, tp):
    """Under a (dp, tp) mesh the hook runs the kernel per shard (shard_map: XLA cannot partition a Mosaic call):
    each tp shard over its own heads and its slice of the pool when the heads divide (K=2), every head on every
    device when they do not (K=3, the pool replicated); both equal the reference."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax.sharding import make_mesh, use_mesh
    mesh = make_mesh(dp=1, tp=tp, devices=jax.devices()[:tp])
    args = make_case(3, t=5, kv_heads=kv_heads, groups=2, head_dim=64, page_size=4, pages_per_seq=3,
                     lengths=[5, 12, 0])
    heads = P(None, None, "tp", None) if kv_heads % tp == 0 else P()
    pool = P(None, "tp", None, None) if kv_heads % tp == 0 else P()
    specs = (heads, heads, heads, P(), pool, pool, P(), P())
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    hook = make_cache_attention("pallas")
    with use_mesh(mesh):
        got = jax.jit(lambda *a: hook(*a, 0.125))(*args)
    want = ref_attention(*args, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
