"""Where a decode step's bytes go: weights read in place (no per-step copies in the optimized HLO), the paged KV
read in blocks of pages (same math as the whole-table reference), and unrolled == scanned outputs."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_models import random_models, tiny_config

from specjax import generate as gen, kv_cache, layers, plain_step as decode, sampling
from specjax.kernels import cpu_dense
from specjax.config import ModelConfig
from specjax.models import target
from specjax.speculative import tree as tree_lib
from specjax.serve.runners import spec as spec_runner
from specjax.serve.runners.plain import PlainRunner

# Odd sizes so that every weight matrix has a shape no activation of a batch-1 step has.
HF = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=80, intermediate_size=176,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5,
          rope_theta=10000.0, tie_word_embeddings=True)
_INST = re.compile(r"^\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\{[\d,]*\} ([\w-]+)\(")
_VIEWS = {"parameter", "get-tuple-element", "bitcast", "tuple"}  # no bytes moved
# Claims about the code XLA:CPU emits by default (dots, bits) run in a child process with XLA's default flags, those
# about its optimized HLO alone (copies, in-place writes) in one with LLVM at -O0 (conftest.py); the numeric
# comparisons with a tolerance run under the suite's fast flags.
xla_defaults = pytest.mark.xla_defaults
xla_default_hlo = pytest.mark.xla_default_hlo  # claims about the optimized HLO only: LLVM's optimisations stay off


def _weight_shapes(cfg: ModelConfig):
    d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g2 = n // k + 2  # the fused q/k/v layout: per kv head its query heads, its key and its value
    shapes = {(d, n, h), (d, n * h), (n, h, d), (n * h, d), (d, k, h), (d, k * h), (d, f), (f, d),
              (d, k, g2, h), (d, k * g2 * h)}
    # fp32 matrices held as panels [O / 32, C, 32] (``cpu_dense.PackedWeight``)
    shapes |= {(o // cpu_dense.PANEL, c, cpu_dense.PANEL) for c, o in ((d, n * h), (n * h, d), (d, k * h), (d, f),
                                                                        (f, d), (d, k * g2 * h))
               if o % cpu_dense.PANEL == 0}
    return {",".join(map(str, s)) for s in shapes}


def weight_copies(hlo: str, cfg: ModelConfig) -> list[str]:
    """Instructions of an optimized HLO module that materialise a layer-weight-shaped array (copies, slices,
    transposes, fusions); parameters, tuple elements and bitcasts are views."""
    shapes = _weight_shapes(cfg)
    out = []
    for line in hlo.splitlines():
        m = _INST.match(line)
        if m and m.group(2) in shapes and m.group(3) not in _VIEWS:
            out.append(line.strip()[:160])
    return out


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_hf_dict(HF, dtype="float32")
    return cfg, target.init_params(cfg, jax.random.PRNGKey(0), scale=0.1)


def _decode_step_hlo(cfg, params):
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96, dtype=jnp.float32)
    step = jax.jit(lambda p, c, t, a: decode.decode(p, cfg, c, t, a), donate_argnums=(1,))
    return step.lower(params, cache, jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)).compile().as_text()


@xla_default_hlo
def test_batch1_decode_step_reads_weights_in_place(model):
    cfg, params = model
    stacked = weight_copies(_decode_step_hlo(cfg, params), cfg)
    assert stacked, "the detector must see the per-step copies of the scanned (stacked) layout"
    assert weight_copies(_decode_step_hlo(cfg, target.unstack_layers(params)), cfg) == []


def _loop_state(params, cfg, cache, stop):
    """``generate``'s state after prefilling one 16-token prompt, with a budget of 8 tokens."""
    cache, logits = gen._prefill(params, cfg, cache, [[1] * 16], jax.device_put)
    return gen._start(cache, logits, jnp.asarray([8], jnp.int32), sampling.SamplingBatch.make(1), stop, capacity=16)


@xla_default_hlo
def test_generate_loop_reads_weights_in_place(model):
    cfg, params = model
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96, dtype=jnp.float32)
    stop = jnp.full((8,), -1, jnp.int32)
    state = _loop_state(params, cfg, cache, stop)
    # Stacked params as the user passes them: the loop unstacks once, outside the while loop.
    hlo = gen._decode_loop.lower(params, cfg, state, stop).compile().as_text()
    body = hlo[:hlo.index("\nENTRY ")]  # computations other than the entry (the while body among them)
    assert weight_copies(body, cfg) == []


def test_unrolled_equals_scanned(model):
    cfg, params = model
    up = target.unstack_layers(params)
    assert target.is_unstacked(up) and not target.is_unstacked(target.stack_layers(up))
    np.testing.assert_array_equal(target.stack_layers(up).layers.w_up, params.layers.w_up)
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    valid = jnp.asarray(np.arange(12)[None] < np.array([[12], [7]]))
    outs = []
    for p in (params, up):
        cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 64, dtype=jnp.float32)
        cache, o = decode.prefill(p, cfg, cache, toks, valid, aux_layers=(2, 0, 2))
        cache, logits = decode.decode(p, cfg, cache, jnp.asarray([3, 4]), jnp.asarray([True, True]))
        outs.append((o.logits, o.aux, logits, cache.k))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # Greedy generation agrees token for token.
    prompts = [[1, 5, 9, 4], [7, 3]]
    assert gen.generate(up, cfg, prompts, max_new_tokens=10, stop_token_ids=()) == \
        gen.generate(params, cfg, prompts, max_new_tokens=10, stop_token_ids=())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_layout_packs_matrices_on_cpu(dtype):
    """On a CPU with the kernels, the decode layout holds each fp32 or bf16 matrix whose output columns fill
    32-column panels as a ``PackedWeight`` (the others as they are); the stacked layout comes back exactly. Greedy
    output is that of [C, O] (fp32: XLA's dots; bf16: the kernel over [C, O], the same bits, or on a CPU with AMX
    the tiles' sums, ``cpu_dense.amx``: other bits, the same tokens), and a bf16 prompt
    longer than the kernels' rows (``cpu_dense.dense_prompt``) gives the logits of YNNPACK's products over [C, O]."""
    if not cpu_dense.available():
        pytest.skip("the CPU kernels are not built here")
    cfg = ModelConfig.from_hf_dict(HF, dtype=dtype)
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    lp = target.unstack_layers(params).layers[0]
    assert isinstance(lp.w_qkv, cpu_dense.PackedWeight) and lp.w_qkv.dtype == jnp.dtype(dtype)  # O = 2x4x24
    assert lp.w_qkv.shape == (cfg.hidden_size, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads + 2, cfg.head_dim)
    assert lp.w_gate is None and lp.w_up is None  # gate/up fused into one matrix of O = 2 x 176
    assert isinstance(lp.w_gate_up, cpu_dense.PackedWeight) and lp.w_gate_up.shape == (80, 2, 176)
    assert not isinstance(lp.w_down, cpu_dense.PackedWeight)  # O = 80
    assert target.unstack_layers(params).embed_panels is None  # V = 300
    wide = dataclasses.replace(cfg, intermediate_size=192, vocab_size=320)
    wp = target.init_params(wide, jax.random.PRNGKey(1), scale=0.1)
    up = target.unstack_layers(wp)
    assert isinstance(up.layers[1].w_gate_up, cpu_dense.PackedWeight)
    # the tied lm_head's panels beside the table: the logits of ``layers.unembed`` to rounding
    assert isinstance(up.embed_panels, cpu_dense.PackedWeight) and up.embed_panels.shape == (80, 320)
    np.testing.assert_array_equal(np.asarray(up.embed_panels.unpack()), np.asarray(wp.embed).T)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((3, 80)), dtype)
    np.testing.assert_allclose(np.asarray(target.compute_logits(up, h)), np.asarray(layers.unembed(h, wp.embed)),
                               rtol=1e-5, atol=1e-5)
    assert target.stack_layers(up).embed_panels is None
    for a, b in zip(jax.tree.leaves(target.stack_layers(up)), jax.tree.leaves(wp)):
        np.testing.assert_array_equal(a, b)
    plain = dataclasses.replace(up, layers=tuple(target.unpack_layer(lp) for lp in up.layers))
    prompts = [[1, 5, 9, 4], [7, 3]]
    if dtype == "float32":
        with cpu_dense.disabled():  # XLA's dots over [C, O]
            plain = target.unstack_layers(wp)
    want = gen.generate(plain, wide, prompts, max_new_tokens=8, stop_token_ids=())
    assert gen.generate(up, wide, prompts, max_new_tokens=8, stop_token_ids=()) == want
    toks = jnp.asarray(np.random.default_rng(0).integers(0, wide.vocab_size, (1, 40)), jnp.int32)
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    logits = [np.asarray(target.forward(p, wide, toks, pos).logits, np.float32) for p in (up, plain)]
    np.testing.assert_allclose(*logits, rtol=2e-2, atol=2e-2)
    hlo = jax.jit(lambda p: target.forward(p, wide, toks, pos).logits).lower(up).compile().as_text()
    assert ("specjax_dense_prompt" in hlo) == (dtype == "bfloat16")


@xla_defaults  # logits within 1e-6: XLA:CPU's fast-compile code rounds further apart
def test_fused_projections_equal_separate_ones(model):
    """The decode layout fuses q/k/v on one device: the same logits as the separate projections (one row
    and a few rows), the stacked layout restored exactly, and params sharded over several devices kept unfused."""
    cfg, params = model
    fused, separate = target.unstack_layers(params), target.unstack_layers(params, fuse=False)
    assert fused.layers[0].w_qkv.shape == (cfg.hidden_size, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads + 2,
                                           cfg.head_dim)
    assert separate.layers[0].w_qkv is None and separate.layers[0].wq is not None
    for a, b in zip(jax.tree.leaves(target.stack_layers(fused)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(2)
    for rows in (1, 3):
        toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, rows)), jnp.int32)
        pos = jnp.arange(rows, dtype=jnp.int32)[None]
        out = [target.forward(p, cfg, toks, pos, aux_layers=()) for p in (fused, separate)]
        np.testing.assert_allclose(out[0].logits, out[1].logits, rtol=1e-6, atol=1e-6)
        # the fused layout rotates q and k from cos and sin computed once (``layers.rope_qkv``), the separate one from
        # XLA's per-element cos and sin, whose last bits differ at some angles
        np.testing.assert_allclose(out[0].aux, out[1].aux, rtol=1e-6, atol=1e-5)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    on_two = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert target.unstack_layers(on_two).layers[0].w_qkv is None


@pytest.mark.parametrize("window, block_tokens", [(None, 4), (None, 1024), (9, 16)])
def test_paged_attention_matches_whole_table_reference(window, block_tokens):
    b, t, n, k, h, z, pps, pool = 3, 4, 4, 2, 16, 4, 20, 64
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, kn, vn = f(b, t, n, h), f(b, t, k, h), f(b, t, k, h)
    k_pages, v_pages = f(pool, k, z, h), f(pool, k, z, h)
    page_table = jnp.asarray(rng.permutation(pool)[:b * pps].reshape(b, pps), jnp.int32)
    lengths = jnp.asarray([0, 7, 61], jnp.int32)
    # Garbage (NaN) in pages no row may read: past row 0's length 0 and in row 1's unused tail.
    k_pages = k_pages.at[page_table[0, 0]].set(jnp.nan).at[page_table[1, 5]].set(jnp.nan)
    v_pages = v_pages.at[page_table[0, 0]].set(jnp.nan).at[page_table[1, 5]].set(jnp.nan)
    valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    positions = lengths[:, None] + jnp.arange(t)[None]
    mask = layers.causal_mask(valid)
    s = pps * z
    key_pos = jnp.arange(s)
    cache_valid = key_pos[None, None, :] < lengths[:, None, None]
    if window is not None:
        mask = mask & ((positions[:, :, None] - positions[:, None, :]) < window)
        cache_valid = cache_valid & ((positions[:, :, None] - key_pos[None, None, :]) < window)
    cache_valid = jnp.broadcast_to(cache_valid, (b, t, s))
    ref = layers.xla_cache_attention(q, kn, vn, mask, k_pages, v_pages, page_table, cache_valid, h ** -0.5)
    out = layers.paged_attention(q, kn, vn, mask, k_pages, v_pages, page_table, lengths, positions, h ** -0.5,
                                 sliding_window=window, block_tokens=block_tokens)
    rows = valid[:, :, None, None]  # padded queries are never read
    np.testing.assert_allclose(jnp.where(rows, out, 0), jnp.where(rows, ref, 0), rtol=2e-5, atol=2e-5)
    assert bool(jnp.isfinite(out).all())


def _unfused_lines(hlo: str) -> list[str]:
    """The instructions of an optimized HLO module outside fused computations (those write buffers)."""
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.-]+)", hlo))
    out, skip = [], False
    for line in hlo.splitlines():
        if head := re.match(r"^(?:ENTRY )?%([\w.-]+) ", line):
            skip = head.group(1) in fused
        elif not skip:
            out.append(line)
    return out


_IN_PLACE = re.compile(r"calls=%[\w.-]*(scatter|dynamic-update-slice)")  # fusions that update their operand


def pool_copies(hlo: str, *pools) -> list[str]:
    """Instructions of an optimized HLO module that write a whole KV pool (of one of the ``pools``' shapes) anywhere
    but in place: copies, and fusions other than a scatter or dynamic-update-slice into it (a dtype or bits view of
    the pool is such a fusion); custom calls (the CPU kernels' write, aliased to its pools) and views are not."""
    shapes = {",".join(map(str, p.shape)) for p in pools}
    out = []
    for line in _unfused_lines(hlo):
        m = _INST.match(line)
        if (m and m.group(2) in shapes and m.group(3) not in _VIEWS | {"custom-call"}
                and not (m.group(3) == "fusion" and _IN_PLACE.search(line))):
            out.append(line.strip()[:160])
    return out


def _write_after_forward(params, cfg, cache, tokens):
    """The layout the runners had: the forward reads the pool, then every layer's K/V is scattered in after it."""
    positions = cache.lengths[:, None]
    out = target.forward(params, cfg, tokens[:, None], positions, cache=cache, return_kv=True,
                         logits_at=jnp.zeros((1, 1), jnp.int32))
    return kv_cache.write(cache, out.k_new, out.v_new, positions), out.logits


@xla_default_hlo
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_server_steps_write_the_kv_pool_in_place(dtype):
    """The runners' programs update the donated pools in place: no copy of a whole pool per step, in fp32 and bf16
    (XLA:CPU copied the pool twice per step when the K/V were written after the forward, and converted a bf16 pool
    to its bits and back around the scatter on bits, so a step's cost grew with the pool)."""
    cfg = ModelConfig.from_hf_dict(HF, dtype=dtype)
    params = target.init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    active = np.zeros((2,), bool)
    active[0] = True
    # 40 pages per sequence: the XLA attention path of a prompt chunk reads the pool in a loop of 3 blocks
    plain = PlainRunner(cfg, params, max_batch=2, pages_per_seq=40, page_size=16, num_pages=97, attention_impl="xla")
    st = plain.init_state()
    view = kv_cache.KVCache(k=st.cache.k, v=st.cache.v, page_table=st.cache.page_table[:1],
                            lengths=st.cache.lengths[:1])
    old = jax.jit(_write_after_forward, static_argnums=(1,), donate_argnums=(2,))
    assert pool_copies(old.lower(plain.params, cfg, view, jnp.zeros((1,), jnp.int32)).compile().as_text(),
                       st.cache.k), "the detector must see the copies of a write after the forward"
    if dtype == "bfloat16":
        with cpu_dense.disabled():  # XLA's scatter on the pool's bits: the bits views are copies
            xla_step = jax.jit(lambda p, s, a: plain._step(p, s, a, nb=1, npages=4), donate_argnums=(1,))  # traced anew
            hlo = xla_step.lower(plain.params, st, active).compile().as_text()
        assert pool_copies(hlo, st.cache.k), "the detector must see a bits view of the pool"
    hlo = plain._step_jit.lower(plain.params, st, active, nb=1, npages=4).compile().as_text()
    assert pool_copies(hlo, st.cache.k) == []
    row = sampling.SamplingBatch.make(1, vocab=cfg.vocab_size)
    hlo = plain._prefill_jit.lower(plain.params, st, np.int32(0), np.zeros((16,), np.int32), np.int32(3), np.int32(0),
                                   np.zeros((40,), np.int32), row, npages=40).compile().as_text()
    assert pool_copies(hlo, st.cache.k) == []

    # head dim 64: a lane-packed fp32 pool; 40 pages per sequence: the target's and the draft's prompt chunks read
    # three blocks of pages
    tcfg = tiny_config(vocab=96, hidden=256, layers=2, dtype=dtype)
    tp, e3 = random_models(tcfg)[:2]
    spec = spec_runner.SpecRunner(tcfg, tp, "EAGLE3", *e3, num_steps=2, topk=1, num_draft_tokens=3, max_batch=2,
                                  pages_per_seq=40, page_size=16, num_pages=97, attention_impl="xla", prefill_chunk=16)
    st = spec.init_state()
    if dtype == "float32":
        assert st.cache.k.shape[-1] == 128 and st.draft_k.shape[-1] == 128
    for draft_tokens in (True, False):  # a speculative step and a target-only step
        hlo = spec_runner._step_rows.lower(spec.target_params, tcfg, spec.draft, spec.scfg, st, active, nb=1,
                                           npages=4, draft_tokens=draft_tokens).compile().as_text()
        assert pool_copies(hlo, st.cache.k, st.draft_k) == []
    chunk = (np.int32(0), np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32), np.ones((1, 16), bool),
             np.ones((1,), bool), np.zeros((1,), np.int32))
    hlo = spec_runner._prefill_slot.lower(spec.target_params, tcfg, spec.draft, spec.scfg, st,
                                          *chunk).compile().as_text()
    assert pool_copies(hlo, st.cache.k, st.draft_k) == []


def _dots(hlo: str) -> list[str]:
    """Output shapes of the dot instructions of an optimized HLO module (fused or not)."""
    return re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} dot\(", hlo)


@xla_defaults
@cpu_dense.disabled()
def test_small_row_products_run_rowwise_on_cpu(model):
    """Without specjax's CPU kernels (no compiler): a dense layer over 2-4 rows (a verified tree, a small batch) is
    one matrix-vector product per row on a CPU (XLA:CPU's GEMM over a few rows read the weights at a third of its
    one-row bandwidth), reading the weights in place, with each row's numbers equal to a one-row product's; more
    rows, or a weight past the cache bound, stay one dot."""
    cfg, params = model
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((80, 4, 24)), jnp.float32)
    many = layers.ROWWISE_MAX_ROWS + 1
    for rows, expect in ((1, ["1,96"]), (3, ["1,96"] * 3), (many, [f"{many},96"])):
        x = jnp.asarray(rng.standard_normal((1, rows, 80)), jnp.float32)
        f = jax.jit(layers.dense)
        dots = _dots(f.lower(x, w).compile().as_text())
        assert dots == expect, (rows, dots)
        y = f(x, w)
        assert y.shape == (1, rows, 4, 24)
        for i in range(rows):  # each row equals the one-row product exactly
            np.testing.assert_array_equal(y[:, i], f(x[:, i:i + 1], w)[:, 0])
        np.testing.assert_allclose(y, jnp.einsum("btd,dnh->btnh", x, w), rtol=1e-5, atol=1e-5)
    big = jax.ShapeDtypeStruct((1024, layers.ROWWISE_MAX_WEIGHT_BYTES // 4096 + 1), jnp.float32)
    assert len(_dots(jax.jit(layers.dense).lower(jax.ShapeDtypeStruct((2, 1024), jnp.float32),
                                                 big).compile().as_text())) == 1

    # A 4-token tree verify over the unrolled (q/k/v- and gate/up-fused) layers: every layer weight read in place,
    # no 4-row layer GEMM.
    up = target.unstack_layers(params)
    assert up.layers[0].w_qkv is not None and up.layers[0].wq is None
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96, dtype=jnp.float32)
    toks, pos = jnp.zeros((1, 4), jnp.int32), jnp.arange(4, dtype=jnp.int32)[None]
    fwd = jax.jit(lambda p, c: target.forward(p, cfg, toks, pos, cache=c, return_kv=True).logits)
    hlo = fwd.lower(up, cache).compile().as_text()
    assert weight_copies(hlo, cfg) == []
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layer_outs = {f"1,{qkv}", f"1,{2 * cfg.intermediate_size}", f"1,{cfg.hidden_size}"}
    assert sum(d in layer_outs for d in _dots(hlo)) == 4 * 4 * cfg.num_layers  # qkv, o, gate/up, down per row


@xla_defaults
@cpu_dense.disabled()
def test_few_row_tied_logits_take_one_pass_over_the_table_on_cpu():
    """Without specjax's CPU kernels: tied logits over 2..8 rows (a verified tree, a small batch) are one
    multiply-and-sum pass over the embedding table on a CPU: no few-row GEMM, no [V, rows, D] product in memory, the
    same argmax and values within fp32 rounding of the one dot; one row keeps its one dot."""
    rng = np.random.default_rng(1)
    v, d = 1000, 72
    table = jnp.asarray(rng.standard_normal((v, d)) * 0.1, jnp.float32)
    f = jax.jit(layers.unembed)
    for rows in (1, 2, layers.ROWWISE_MAX_ROWS, layers.ROWWISE_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((1, rows, d)), jnp.float32)
        compiled = f.lower(x, table).compile()
        one_dot = rows == 1 or rows > layers.ROWWISE_MAX_ROWS
        assert (_dots(compiled.as_text()) == [f"{rows},{v}"]) == one_dot, rows
        assert compiled.memory_analysis().temp_size_in_bytes < v * d * 4 // 4, rows
        y, ref = f(x, table), jnp.einsum("btd,vd->btv", x, table)
        assert y.shape == (1, rows, v) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(y.argmax(-1), ref.argmax(-1))
    bf = jnp.asarray(rng.standard_normal((1, 4, d)), jnp.bfloat16)  # bf16 weights: f32 products and sums
    np.testing.assert_allclose(f(bf, table.astype(jnp.bfloat16)),
                               jnp.einsum("btd,vd->btv", bf, table.astype(jnp.bfloat16),
                                          preferred_element_type=jnp.float32), rtol=1e-4, atol=1e-4)


def _materialised(hlo: str, *shapes: str) -> list[str]:
    """Instructions that write an array of one of ``shapes`` (anything but a view)."""
    return [line.strip()[:160] for line in hlo.splitlines()
            if (m := _INST.match(line)) and m.group(2) in shapes and m.group(3) not in _VIEWS]


@xla_defaults
@pytest.mark.parametrize("kernels", [True, False])
def test_half_precision_products_on_cpu(kernels):
    """bf16 weights on a CPU: every product accumulates in f32 (XLA:CPU's half-precision one-row dot is a naive
    loop several times slower than fp32; its f32-result dots over 2+ rows go to YNNPACK), and each row's numbers
    are the one-row product's whatever the row count, so a verified tree row equals a decode step's row: in
    specjax's CPU kernels and in the fallback without them."""
    if kernels:
        assert cpu_dense.available()
        _half_precision_products()
    else:
        with cpu_dense.disabled():
            _half_precision_products()


def _half_precision_products():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((80, 4, 24)) * 0.1, jnp.bfloat16)
    table = jnp.asarray(rng.standard_normal((300, 80)) * 0.1, jnp.bfloat16)
    f, u = jax.jit(layers.dense), jax.jit(layers.unembed)
    for rows in (1, 2, 3, layers.ROWWISE_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((1, rows, 80)), jnp.bfloat16)
        for fn, arg in ((f, w), (u, table)):
            hlo = fn.lower(x, arg).compile().as_text()
            assert not re.search(r"= bf16\[[\d,]*\]\{[\d,]*\} dot\(", hlo), (rows, "a bf16-result dot")
            y = fn(x, arg)
            for i in range(rows):
                np.testing.assert_array_equal(y[:, i], fn(x[:, i:i + 1], arg)[:, 0])
        y, ref = f(x, w), jnp.einsum("btd,dnh->btnh", x, w, preferred_element_type=jnp.float32)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2)  # bf16 output rounding
        logits = u(x, table)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(logits, jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32),
                                   rtol=1e-5, atol=1e-5)


@xla_default_hlo
def test_half_precision_decode_reads_table_and_pool_in_place():
    """A bf16 decode step and generation loop on a CPU never copy the embedding table or a K/V pool: XLA:CPU ran a
    half-precision gather or scatter on an f32 copy of the whole operand (the table for one row, each pool for
    every layer's write), and an in-program bitcast of the table to integers was still copied on every iteration of
    a loop; the decode layout gathers from the table's bytes held as uint16 (``embed_bits``, the same memory)."""
    cfg = ModelConfig.from_hf_dict(HF, dtype="bfloat16")
    params = target.unstack_layers(target.init_params(cfg, jax.random.PRNGKey(0), scale=0.1))
    assert params.embed_bits is not None and params.embed_bits.dtype == jnp.uint16
    assert params.embed_bits.unsafe_buffer_pointer() == params.embed.unsafe_buffer_pointer()  # no second table
    toks = jnp.asarray([[3, 299, 0]], jnp.int32)
    np.testing.assert_array_equal(target.embed_tokens(params, toks), jnp.take(params.embed, toks, axis=0))
    assert target.stack_layers(params).embed_bits is None
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96, dtype=jnp.bfloat16)
    table, pool = f"{cfg.vocab_size},{cfg.hidden_size}", ",".join(map(str, cache.k.shape))
    step = jax.jit(lambda p, c, t, a: decode.decode(p, cfg, c, t, a), donate_argnums=(1,))
    hlo = step.lower(params, cache, jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)).compile().as_text()
    assert _materialised(hlo, table) == []
    assert pool_copies(hlo, cache.k) == [] and not re.search(r"= f32\[" + pool + r"\]", hlo)  # no f32 pool
    stop = jnp.full((8,), -1, jnp.int32)
    state = _loop_state(params, cfg, cache, stop)
    for p, copies in ((dataclasses.replace(params, embed_bits=None), True), (params, False)):
        hlo = gen._decode_loop.lower(p, cfg, state, stop).compile().as_text()
        body = hlo[:hlo.index("\nENTRY ")]
        assert bool(_materialised(body, table)) == copies, copies  # the detector sees the in-loop bitcast's copy
        assert not re.search(r"= f32\[" + pool + r"\]", body)
    # bf16 logits follow the fp32 model's
    cfg32 = ModelConfig.from_hf_dict(HF, dtype="float32")
    p32 = target.unstack_layers(target.init_params(cfg32, jax.random.PRNGKey(0), scale=0.1))
    c32 = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96, dtype=jnp.float32)
    l16 = decode.decode(params, cfg, kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 96,
                                                         dtype=jnp.bfloat16), toks[:, 0], jnp.ones((1,), bool))[1]
    l32 = decode.decode(p32, cfg32, c32, toks[:, 0], jnp.ones((1,), bool))[1]
    np.testing.assert_allclose(l16, l32, atol=0.05 * float(jnp.abs(l32).max()))


@xla_defaults
def test_row_sum_of_a_row_does_not_depend_on_the_rows_beside_it():
    """``layers.row_sum`` (softmax denominators, RMSNorm) adds in a fixed order per row: XLA:CPU's reduction of the
    same row came out with different last bits when 2-8 rows were reduced together."""
    rng = np.random.default_rng(3)
    f = jax.jit(layers.row_sum)
    for width in (256, 576, 1):  # a block of keys, SmolLM2's hidden size
        x = jnp.asarray(rng.random((1, 3, 3, 8, width)), jnp.float32)  # [B, K, G, T, S] as in the attention
        full = f(x)
        np.testing.assert_allclose(full, x.sum(-1), rtol=1e-6)
        for rows in (1, 2, 4):
            for i in range(rows):
                np.testing.assert_array_equal(f(x[:, :, :, i:rows])[..., 0], full[..., i])


def _smol_prefilled(dtype: str, seed: int):
    """SmolLM2's layer shapes (XLA:CPU's reductions differ by row count at these sizes; with the kernels, the tied
    logits over panels, ``target.pack_logits``) with random weights, two rows prefilled to 13 and 30 tokens:
    (cfg, params, cache, rng)."""
    smol = dict(HF, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                head_dim=64, vocab_size=320)
    cfg = ModelConfig.from_hf_dict(smol, dtype=dtype)
    params = target.unstack_layers(target.init_params(cfg, jax.random.PRNGKey(1), scale=0.1))
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 256, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 30)), jnp.int32)
    valid = jnp.arange(30)[None, :] < jnp.asarray([[13], [30]])
    cache, _ = decode.prefill(params, cfg, cache, prompt, valid)
    return cfg, params, cache, rng


@xla_defaults
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verified_chain_rows_are_decode_step_bits(dtype):
    """The promise behind speculative greedy == plain greedy, bit for bit: a chain of new tokens verified in one
    forward (its K/V written first and read back from the pool, ``keys_in_pool``) gives every row of a bf16 model
    exactly the hidden state and logits a one-token decode step computes at that position (its products are
    row-count independent), for rows of different lengths in one batch. fp32 agrees to rounding: above
    ``layers.ROWWISE_MAX_ROWS`` rows its products are one dot, and its few-row tied logits another pass. With
    specjax's CPU kernels (every product of up to ``cpu_dense.MAX_TOKENS`` rows per sequence) fp32 is exact too."""
    cfg, params, cache, rng = _smol_prefilled(dtype, 4)
    chain = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    step = jax.jit(lambda c, t: decode.prefill(params, cfg, c, t[:, None], jnp.ones((2, 1), bool),
                                               keys_in_pool=True, return_hidden=True))
    c, steps = cache, []
    for i in range(chain.shape[1]):
        c, out = step(c, chain[:, i])
        steps.append(out)
    positions = cache.lengths[:, None] + jnp.arange(chain.shape[1])[None, :]
    verify = jax.jit(lambda c, t: target.forward(params, cfg, t, positions, cache=c,
                                                 mask=layers.causal_mask(jnp.ones(t.shape, bool)),
                                                 write_valid=jnp.ones(t.shape, bool), keys_in_pool=True,
                                                 return_hidden=True))
    out = verify(cache, chain)
    for i, s in enumerate(steps):
        if dtype == "bfloat16" or cpu_dense.available():
            np.testing.assert_array_equal(out.hidden[:, i], s.hidden[:, 0])
            np.testing.assert_array_equal(out.logits[:, i], s.logits)
        else:  # 10 rows: one fp32 dot, not ``dense``'s per-row products
            np.testing.assert_allclose(out.hidden[:, i], s.hidden[:, 0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(out.logits[:, i], s.logits, rtol=1e-4, atol=1e-4)


@xla_defaults
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verified_tree_rows_are_decode_step_bits(dtype):
    """A draft tree verified as ``verify_phase`` does (its nodes' K/V read from the step's new keys under the
    ancestor mask, only the root written to the pool first) gives every node the hidden state and logits of the
    decode steps down its path: a node's ancestors are summed in the softmax where a decode step finds them, right
    after the prefix, whatever their indices in the tree. Without that, bf16 trees gave other greedy answers than
    plain bf16 decoding (4-7 of 16 MT-bench answers, fifty-fifth session) while chains gave the same."""
    if not cpu_dense.available():
        pytest.skip("the bitwise promise is the CPU kernels'")
    cfg, params, cache, rng = _smol_prefilled(dtype, 5)
    parent = np.array([-1, 0, 0, 1, 1, 2, 3, 5, 4, 6, 2, 9, 11, 12, 13])  # depths 0-8; cpu_dense.MAX_TOKENS nodes
    depth = np.zeros(len(parent), np.int32)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, len(parent))), jnp.int32)
    mask = tree_lib.ancestor_mask(jnp.broadcast_to(jnp.asarray(parent, jnp.int32), (2, len(parent))),
                                  int(depth.max()))
    positions = cache.lengths[:, None] + jnp.asarray(depth)[None, :]
    root_only = jnp.broadcast_to(jnp.arange(len(parent))[None, :] == 0, (2, len(parent)))
    verify = jax.jit(lambda c, t: target.forward(params, cfg, t, positions, cache=c, mask=mask, write_valid=root_only,
                                                 return_hidden=True))
    out = verify(cache, tokens)
    step = jax.jit(lambda c, t: decode.prefill(params, cfg, c, t[:, None], jnp.ones((2, 1), bool),
                                               keys_in_pool=True, return_hidden=True))
    for node in range(len(parent)):
        path = [node]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        c = cache
        for i in reversed(path):
            c, s = step(c, tokens[:, i])
        np.testing.assert_array_equal(out.hidden[:, node], s.hidden[:, 0], err_msg=f"node {node}")
        np.testing.assert_array_equal(out.logits[:, node], s.logits, err_msg=f"node {node}")


def test_stacked_bits_forward_is_the_same():
    """``target.stacked_bits`` (a bf16 stack held as uint16 bits for the training forward on a CPU) gives the bf16
    stack's outputs bit for bit, on one device and sharded over tp; other dtypes are left as they are."""
    from specjax import weights
    from specjax.sharding import make_mesh
    cfg = ModelConfig.from_hf_dict(HF, dtype="bfloat16")
    params = target.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(2)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32)[None], (2, 10))
    fwd = jax.jit(lambda p: target.forward(p, cfg, toks, pos, aux_layers=(0, 2)))
    mesh = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    for p in (params, weights.shard_params(params, cfg, mesh)):
        ref = fwd(p)
        bits = target.stacked_bits(p, cfg)
        assert {str(w.dtype) for w in jax.tree.leaves(bits.layers)} == {"uint16"}
        assert jax.tree.map(lambda w: w.sharding, bits.layers) == jax.tree.map(lambda w: w.sharding, p.layers)
        out = fwd(bits)
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(ref.logits))
        np.testing.assert_array_equal(np.asarray(out.aux, np.float32), np.asarray(ref.aux, np.float32))
    f32 = ModelConfig.from_hf_dict(HF, dtype="float32")
    p32 = target.init_params(f32, jax.random.PRNGKey(0))
    assert target.stacked_bits(p32, f32) is p32
