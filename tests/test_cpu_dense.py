"""specjax's CPU product kernels (``kernels.cpu_dense``): agreement with XLA's dots, bits independent of the row and
thread counts, autodiff and vmap, concurrent callers, and that ``layers.dense`` / ``layers.unembed`` route to them;
the argmax kernel against ``jnp.argmax`` (ties, NaN, infinities) and ``sampling.argmax`` routing to it; the K/V
write against XLA's scatter."""

import concurrent.futures
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache, layers, sampling
from specjax.kernels import cpu_dense

pytestmark = [pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernels cannot be built (layers keep XLA's dots)"),
              pytest.mark.usefixtures("cpu_kernels")]

# (C, O): one contraction block (C < 256), several blocks with a row tail (C % 16 != 0), a column tail (O % 16 != 0)
SHAPES = [(64, 48), (200, 37), (576, 96), (1000, 130)]


def _operands(rows, c, o, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, c), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (c, o), jnp.float32) / np.sqrt(c)).astype(dtype)
    return x, w


def _reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _tmul_reference(x, w):
    """The bits of bf16 x against bf16 panels on AMX tiles (``amx.h``), emulated: per block of the contraction axis
    (``dense.cc``'s DenseBlocks), 16-row groups from the block's start, each group's products summed from 0 in
    float32 in order and the group sums added in float32; the block sums added in block order."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    c_dim = x.shape[1]
    blocks = min(max(c_dim // 128, 1), 4)
    y = None
    for k in range(blocks):
        c0, c1 = c_dim * k // blocks, c_dim * (k + 1) // blocks
        acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
        for g in range(c0, c1, 16):
            group = np.zeros_like(acc)
            for c in range(g, min(g + 16, c1)):
                group += np.outer(x[:, c], w[c])  # a bf16 x bf16 product is exact in float32
            acc += group
        y = acc if y is None else y + acc
    return y


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("c,o", SHAPES)
@pytest.mark.parametrize("rows", [8, 23])  # fp32: passes over y up to 16 rows, register tiles from 17
def test_dense_matches_float64_reference(dtype, c, o, rows):
    x, w = _operands(rows, c, o, dtype)
    got = np.asarray(jax.jit(cpu_dense.dense)(x, w))
    assert got.dtype == np.float32 and got.shape == (rows, o)
    np.testing.assert_allclose(got, _reference(x, w), rtol=0, atol=1e-4 * np.sqrt(c))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unembed_matches_float64_reference(dtype):
    x, table_t = _operands(5, 200, 300, dtype)
    table = table_t.T
    got = np.asarray(jax.jit(cpu_dense.unembed)(x, table))
    np.testing.assert_allclose(got, _reference(x, table_t), rtol=0, atol=1e-4 * np.sqrt(200))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bits_do_not_depend_on_rows_or_threads(dtype):
    """A row's result is the same bits alone, among 2..19 rows (fp32: the passes over y up to 16 rows, the register
    tiles from 17), and on 1 or 2 threads: a verified tree row equals the one-row decode step bit for bit."""
    x, w = _operands(19, 1000, 130, dtype, seed=1)
    table = _operands(1, 130, 1000, dtype, seed=2)[1]  # [V=130, D=1000]
    dense, unembed = jax.jit(cpu_dense.dense), jax.jit(cpu_dense.unembed)
    results = []
    for n in (1, 2):
        cpu_dense.set_threads(n)
        assert cpu_dense.threads() == n
        full = np.asarray(dense(x, w)), np.asarray(unembed(x, table))
        for rows in (1, 2, 3, 5, 7, 8, 9, 16, 18):
            part = np.asarray(dense(x[:rows], w)), np.asarray(unembed(x[:rows], table))
            np.testing.assert_array_equal(part[0], full[0][:rows])
            np.testing.assert_array_equal(part[1], full[1][:rows])
        one = np.asarray(dense(x[5:6], w))
        np.testing.assert_array_equal(one, full[0][5:6])
        results.append(full)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def _isa_products(path) -> None:
    """Products of every kernel path (one row, groups, tiles, more rows than the kernels' pool takes) saved to path:
    run by this process's build and, in a child, by the scalar loops' build."""
    assert cpu_dense.available()  # built and registered
    out = {}
    for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        for rows in (1, 2, 5, 8, 15, 24, 40):
            kx, kw, kt = jax.random.split(jax.random.key(rows), 3)
            x = jax.random.normal(kx, (rows, 576), jnp.float32)
            w = (jax.random.normal(kw, (576, 200), jnp.float32) / 24).astype(dt)
            t = jax.random.normal(kt, (300, 576), jnp.float32).astype(dt)
            if rows <= cpu_dense.MAX_TOKENS or dt == jnp.float32:
                out[f"dense_{name}_{rows}"] = np.asarray(cpu_dense.dense(x, w))
            out[f"packed_{name}_{rows}"] = np.asarray(cpu_dense.dense_packed(x, cpu_dense.pack(w[:, :192]).panels))
            out[f"unembed_{name}_{rows}"] = logits = np.asarray(cpu_dense.unembed(x, t))
            out[f"argmax_{name}_{rows}"] = np.asarray(cpu_dense.argmax(jnp.asarray(logits)))
    np.savez(path, **out)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the scalar build is named for x86-64")
def test_vector_code_has_the_scalar_loops_bits(tmp_path):
    """This CPU's vector code (``common.h``'s F16: AVX-512, or AVX2 + FMA as two 256-bit halves) gives the products'
    bits of the scalar loops (a build for plain x86-64 in a child process, ``SPECJAX_CPU_MARCH``): each output the
    same fma chain over [C, O], panels and table rows, whichever vector width, so an AVX2 CPU serves the tokens an
    AVX-512 one does. (bf16 x, which AMX tiles would take, is not used here.)"""
    env = dict(os.environ, SPECJAX_CPU_MARCH="x86-64", SPECJAX_CPU_KERNELS="1", SPECJAX_CACHE=str(tmp_path))
    child = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
             f"from test_cpu_dense import _isa_products; _isa_products({str(tmp_path / 'scalar.npz')!r})")
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=600)
    _isa_products(tmp_path / "vector.npz")
    scalar, vector = np.load(tmp_path / "scalar.npz"), np.load(tmp_path / "vector.npz")
    assert sorted(scalar.files) == sorted(vector.files) and len(scalar.files) == 54
    for key in scalar.files:
        np.testing.assert_array_equal(vector[key], scalar[key], err_msg=key)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_weights_give_the_bits_of_c_o(dtype):
    """fp32 or bf16 w held as panels (``PackedWeight``: [O / 32, C, 32]) gives the bits of w as [C, O], at every
    row count (groups of four panels for 1-2 rows, of two for 3-4 (fp32 on Intel cores: 3-8), one panel with a
    register tile from 5 (there: 9); the products of more than 32 rows on XLA's thread pool) and thread count; 7
    panels leave a group's tail on one and on two threads. bf16 panels are read a line per row, even and odd columns
    widened apart, and put back in order. Where the CPU has AMX (``cpu_dense.amx``), bf16 x against bf16 panels runs
    on its tiles instead, with the TMUL's bits (``_tmul_reference``), as many rows as there are, short last groups
    of 16 rows of w included (C = 1000: blocks of 250)."""
    packed = jax.jit(cpu_dense.dense_packed)
    dense = jax.jit(cpu_dense.dense)
    for c, o in ((1000, 224), (200, 32)):
        x, w = _operands(40, c, o, dtype, seed=3)
        pw = cpu_dense.pack(w)
        assert pw.panels.shape == (o // 32, c, 32) and pw.shape == (c, o)
        np.testing.assert_array_equal(np.asarray(pw.unpack()), np.asarray(w))
        for n in (1, 2):
            cpu_dense.set_threads(n)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 33, 40):
                got = np.asarray(packed(x[:rows], pw.panels))
                if dtype == jnp.bfloat16 and cpu_dense.amx():
                    want = _tmul_reference(x[:rows], w)
                elif rows <= cpu_dense.MAX_TOKENS or dtype == jnp.float32:
                    want = np.asarray(dense(x[:rows], w))
                else:  # [C, O] bf16 is not run past MAX_TOKENS rows: the one-row products, row by row
                    want = np.concatenate([np.asarray(dense(x[r:r + 1], w)) for r in range(rows)])
                np.testing.assert_array_equal(got, want, err_msg=f"{rows} rows, {n} threads")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_products_round_and_add_a_residual_as_xla(dtype):
    """A packed product can write its sums in x's dtype (bf16: rounded as ``astype``) and add a residual in the same
    call (a decoder layer's ``h + o @ wo``): the bits of XLA's convert and add after the float32 product, at every
    row count, on one and two threads."""
    f32 = jax.jit(cpu_dense.dense_packed)
    rounded = jax.jit(cpu_dense.dense_packed, static_argnums=2)
    add = jax.jit(cpu_dense.dense_packed_add)
    xla_add = jax.jit(lambda h, y: h + y.astype(h.dtype))
    x, w = _operands(40, 576, 224, dtype, seed=6)
    h = jnp.asarray(np.random.default_rng(7).standard_normal((40, 224)) * 4, dtype)
    panels = cpu_dense.pack(w).panels
    for n in (1, 2):
        cpu_dense.set_threads(n)
        for rows in (1, 2, 3, 5, 9, 33, 40):
            y = f32(x[:rows], panels)
            got = rounded(x[:rows], panels, dtype)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(y.astype(dtype)))
            np.testing.assert_array_equal(np.asarray(add(x[:rows], panels, h[:rows])),
                                          np.asarray(xla_add(h[:rows], y)), err_msg=f"{rows} rows, {n} threads")


def test_bf16_prompt_products_on_panels():
    """``dense_prompt`` (a bf16 prompt chunk against bf16 panels: AMX tiles where the CPU has them, else AVX512-BF16's
    dot products, else the widening kernel) gives the product within fp32 rounding, for an odd C too (its last row
    of w paired with zeros), and each output the same bits whatever the rows beside it or the thread count; on AMX
    the bits of ``dense_packed``, a decode step's products."""
    prompt = jax.jit(cpu_dense.dense_prompt)
    for c, o in ((576, 96), (201, 64)):
        x, w = _operands(300, c, o, jnp.bfloat16, seed=5)
        panels = cpu_dense.pack(w).panels
        ref = _reference(x, w)
        results = []
        for n in (1, 2):
            cpu_dense.set_threads(n)
            full = np.asarray(prompt(x, panels))
            np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5)
            for rows in (1, 5, 13, 40):
                np.testing.assert_array_equal(np.asarray(prompt(x[7:7 + rows], panels)), full[7:7 + rows],
                                              err_msg=f"{rows} rows, {n} threads")
            results.append(full)
            if cpu_dense.amx():
                np.testing.assert_array_equal(full, np.asarray(jax.jit(cpu_dense.dense_packed)(x, panels)))
        np.testing.assert_array_equal(*results)


def test_packed_weight_in_layers():
    """``layers.dense`` takes a PackedWeight where it takes w (reshaped as wo [N, H, D] is), with the kernel's bits,
    at prompt lengths past the kernels' row limits too, and XLA's dot of the unpacked w when the kernels are off."""
    w = _operands(1, 8 * 24, 64, jnp.float32, seed=4)[1].reshape(8, 24, 64)
    pw = cpu_dense.pack(w, 2)
    assert cpu_dense.packable(w, 2)  # bf16 too (tests/test_decode_layout.py)
    assert not cpu_dense.packable(w.astype(jnp.float16), 2)
    assert not cpu_dense.packable(jnp.ones((64, 40)))  # O not a multiple of 32
    with pytest.raises(ValueError, match="cannot take the shape"):
        pw.reshape(8, 64, 24)
    flat = pw.reshape(8 * 24, -1)
    assert flat.shape == (192, 64) and flat.rows == 192
    for tokens in (1, 5, 40):
        x = jax.random.normal(jax.random.key(tokens), (2, tokens, 192), jnp.float32)
        want = layers.dense(x, w.reshape(192, 64))
        got = jax.jit(layers.dense)(x, flat)
        assert got.shape == (2, tokens, 64)
        if tokens <= cpu_dense.MAX_TOKENS:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:  # [C, O] takes XLA's GEMM past the row limits, the panels the kernel's register tiles
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        with cpu_dense.disabled():
            np.testing.assert_allclose(np.asarray(layers.dense(x, flat)), _reference(x.reshape(-1, 192),
                                       w.reshape(192, 64)).reshape(2, tokens, 64), rtol=1e-5, atol=1e-5)


def test_concurrent_callers_get_their_own_results():
    """Two threads calling at once (two devices of one process): one takes the pool, the other runs alone."""
    cpu_dense.set_threads(2)
    dense = jax.jit(cpu_dense.dense)
    cases = [_operands(r, 576, 384, jnp.float32, seed=r) for r in (1, 3, 8, 2)]
    want = [np.asarray(dense(x, w)) for x, w in cases]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda xw: np.asarray(dense(*xw)), cases))
            for g, e in zip(got, want):
                np.testing.assert_array_equal(g, e)


def test_gradients_and_vmap():
    x, w = _operands(3, 200, 37, jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    got = jax.grad(loss(cpu_dense.dense), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda a, b: jnp.dot(a, b, precision="highest")), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(np.asarray(jax.vmap(cpu_dense.dense, (0, None))(xs, w)),
                               np.stack([_reference(x, w), _reference(2 * x, w)]), atol=1e-3)


def _targets(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_layers_route_few_rows_to_the_kernels():
    """``layers.dense`` / ``layers.unembed`` call the kernels for fp32/bf16 x [..., T, C] with T <= MAX_TOKENS on a
    CPU, at any batch, and for longer fp32 chunks of at most MAX_PROMPT_ROWS rows in all; longer chunks, other dtypes
    and ``disabled()`` keep XLA's dot."""
    t_max, rows = cpu_dense.MAX_TOKENS, cpu_dense.MAX_PROMPT_ROWS
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.ones((64, 4, 8), dtype)
        table = jnp.ones((100, 64), dtype)
        fp32 = dtype == jnp.float32
        for shape, expect in (((1, 1, 64), True), ((16, 1, 64), True), ((3, t_max, 64), True),
                              ((1, t_max + 1, 64), fp32), ((2, rows // 2, 64), fp32), ((1, rows + 1, 64), False),
                              ((3, t_max + 1, 64), False)):
            x = jnp.ones(shape, dtype)
            assert ("specjax_dense" in _targets(layers.dense, x, w)) is expect
            assert ("specjax_unembed" in _targets(layers.unembed, x, table)) is expect
        y = layers.dense(jnp.ones((2, 64), dtype), w)
        assert y.shape == (2, 4, 8) and y.dtype == dtype
    x16, w16 = jnp.ones((2, 64), jnp.float16), jnp.ones((64, 8), jnp.float16)
    assert "specjax_dense" not in _targets(layers.dense, x16, w16)
    with cpu_dense.disabled():
        assert "specjax_dense" not in _targets(layers.dense, jnp.ones((1, 1, 64)), jnp.ones((64, 8)))


def _argmax_cases():
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((5, v)).astype(np.float32) for v in (1, 7, 16, 49, 1000)]
    tie = rng.standard_normal((4, 100)).astype(np.float32)
    tie[:, [3, 40, 99]] = 9.0  # the first of equal maxima
    tie[1, 40] = np.nextafter(np.float32(9.0), np.float32(10.0))  # one ulp above: that one
    special = np.full((6, 50), -np.inf, np.float32)  # all -inf: index 0
    special[1, 17] = np.nan  # a NaN wins, the first one
    special[1, 30] = np.nan
    special[2, 33] = np.inf
    special[3, :] = 0.0
    special[3, 20] = -0.0  # -0.0 == 0.0: the first zero
    special[4, 48] = np.nan  # a NaN in the tail after the last whole vector
    special[4, 2] = 1.0
    special[5, 5:] = rng.standard_normal(45)
    return cases + [tie, special]


def test_argmax_matches_jnp_argmax():
    f = jax.jit(cpu_dense.argmax)
    for n in (1, 2):
        cpu_dense.set_threads(n)
        for x in _argmax_cases():
            got = np.asarray(f(x))
            assert got.dtype == np.int32 and got.shape == x.shape[:-1]
            np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    logits = jax.random.normal(jax.random.key(3), (2, 4, 3000))  # [B, M, V]: a verified tree's rows
    np.testing.assert_array_equal(np.asarray(f(logits)), np.asarray(jnp.argmax(logits, -1)))
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(logits)), np.asarray(jnp.argmax(logits, -1)))


def test_sampling_argmax_routes_fp32_to_the_kernel():
    x = jnp.ones((2, 3, 64), jnp.float32)
    assert "specjax_argmax" in _targets(sampling.argmax, x)
    assert "specjax_argmax" not in _targets(sampling.argmax, x.astype(jnp.bfloat16))
    with cpu_dense.disabled():  # another shape: a traced program is cached by shape
        assert "specjax_argmax" not in _targets(sampling.argmax, jnp.ones((5, 64), jnp.float32))
    y = sampling.argmax(x.astype(jnp.bfloat16))
    assert y.dtype == jnp.int32 and y.shape == (2, 3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # fp32 at 64: a lane-packed pool [L, P, K, Z/2, 128]
def test_kv_write_matches_xla_scatter(dtype, head_dim):
    """``kv_cache.write`` through the kernel (in place) writes what XLA's scatter does: one layer (a traced index)
    or all of them, tokens past the page table or invalid dropped, into donated pools."""
    cache = kv_cache.init_cache(3, 2, head_dim, 2, 64, dtype=dtype, num_pages=9)
    cache = dataclasses.replace(cache, k=cache.k + 1, v=cache.v - 1, page_table=jnp.asarray([[3, 1, 7, 0],
                                                                                             [2, 8, 5, 4]]))
    rng = np.random.default_rng(0)
    pos = jnp.asarray([[5, 16, 40], [63, 64, 17]])  # 64: past the page table
    valid = jnp.asarray([[True, True, False], [True, True, True]])
    new = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    one = (new(2, 3, 2, head_dim), new(2, 3, 2, head_dim))
    every = (new(3, 2, 3, 2, head_dim), new(3, 2, 3, 2, head_dim))
    for args, kw in ((one, dict(layer=jnp.int32(2))), (every, {})):
        write = jax.jit(lambda c, k, v: kv_cache.write(c, k, v, pos, valid, **kw), donate_argnums=(0,))
        got = write(jax.tree.map(jnp.copy, cache), *args)
        with cpu_dense.disabled():
            want = jax.jit(lambda c, k, v: kv_cache.write(c, k, v, pos, valid, **kw))(cache, *args)
        assert got.k.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.k, np.float32), np.asarray(want.k, np.float32))
        np.testing.assert_array_equal(np.asarray(got.v, np.float32), np.asarray(want.v, np.float32))
        assert not np.array_equal(np.asarray(got.k, np.float32), np.asarray(cache.k, np.float32))
    hlo = write.lower(cache, *every).as_text()
    assert "specjax_kv_write" in hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_take_pages_matches_xla_gather(dtype):
    """``kv_cache.take_pages`` through the kernel reads the pages XLA's gather does, from a stacked pool at a traced
    layer and from one layer's pool, indices past the pool clamped."""
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.normal(size=(3, 9, 2, 8, 128)), dtype)
    cols = jnp.asarray([[3, 1, 8, 0], [2, 8, 5, 11]])  # 11: past the pool, clamped to page 8
    for pages, at in ((pool, (jnp.int32(2), cols)), (pool[1], cols)):
        take = jax.jit(lambda p, a: kv_cache.take_pages(p, a, 64))
        got = take(pages, at)
        with cpu_dense.disabled():
            want = jax.jit(lambda p, a: kv_cache.take_pages(p, a, 64))(pages, at)
        assert got.dtype == dtype and got.shape == (2, 4, 2, 16, 64)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert "specjax_take_pages" in take.lower(pages, at).as_text()


def test_processes_starting_together_build_the_library_once(tmp_path, monkeypatch):
    """Two starts at once on a fresh machine (two pytest workers, two servers) wait for one build of the library
    under its lock file instead of each compiling it (40-80 s of a 2-core machine each)."""
    calls = []

    def slow_compile(out):
        calls.append(out)
        time.sleep(0.5)
        out.write_bytes(b"built")

    monkeypatch.setattr(cpu_dense, "_compile", slow_compile)
    out = tmp_path / "kernels" / "lib.so"
    threads = [threading.Thread(target=cpu_dense._compile_once, args=(out,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert calls == [out] and out.read_bytes() == b"built"
