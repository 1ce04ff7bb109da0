"""``layers.half_dot``'s gradients (bf16 training on a CPU): the hand-written VJP against autodiff of the same
product in f32, at the row counts a train step meets (one row, odd counts), in both weight layouts; and that its
backward products stay bf16 x bf16 -> f32 in XLA:CPU's optimized program (a product widened to f32 ran 3.5-5x
slower: docs/benchmarks.md, thirty-seventh session)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import layers


def _operands(rows, d, o, dims, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, d), jnp.float32).astype(jnp.bfloat16)
    shape = (d, o) if dims == "cd,do->co" else (o, d)
    w = (jax.random.normal(kw, shape, jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("dims", ["cd,do->co", "cd,od->co"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_half_dot_gradients_match_f32_autodiff(dims, rows):
    x, w = _operands(rows, 48, 80, dims)
    probe = jax.random.normal(jax.random.key(1), (rows, 80), jnp.float32)
    loss = lambda x, w: jnp.sum(probe * layers.half_dot(x, w, dims=dims))
    ref = lambda x, w: jnp.sum(probe * jnp.einsum(dims, x, w, precision="highest"))
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(ref, argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype and gw.shape == w.shape
    for got, want in ((gx, rx), (gw, rw)):  # bf16 cotangents and results: about 3 significant digits
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2,
                                   atol=3e-2 * float(jnp.abs(want).max()))


def test_half_dot_backward_keeps_bf16_products():
    x, w = _operands(37, 64, 256, "cd,do->co")
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(layers.half_dot(x, w) ** 2), argnums=(0, 1)))
    hlo = grad.lower(x, w).compile().as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))  # every instruction's element type, by name
    dots = re.findall(r"= \w+\[[\d,]*\]\{[\d,]*\} dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    assert len(dots) >= 3, hlo  # the forward product and the two of the backward
    for a, b in dots:  # every product reads bf16 operands (none widened to f32 first)
        assert (types[a], types[b]) == ("bf16", "bf16"), (a, b, types[a], types[b])
