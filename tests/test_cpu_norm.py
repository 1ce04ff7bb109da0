"""specjax's CPU RMSNorm kernel (``kernels.cpu_dense.rms_norm``): agreement with ``layers.rms_norm``'s XLA program and
a float64 reference, bits independent of the rows beside a row, every CPU ``layers.rms_norm`` routed to it, autodiff,
and the inputs it leaves to XLA."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import layers
from specjax.kernels import cpu_dense

pytestmark = [pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernels cannot be built (layers keep XLA's norm)"),
              pytest.mark.usefixtures("cpu_kernels")]

EPS = 1e-5


def _operands(rows, d, xdt, wdt, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(rows, d)) * scale, xdt),
            jnp.asarray(1 + 0.1 * rng.normal(size=(d,)), wdt))


def _norm(x, w):
    return jax.jit(lambda x, w: layers.rms_norm(x, w, EPS))(x, w)


def _xla(x, w):
    return jax.jit(lambda x, w: layers._xla_rms_norm(x, w, EPS))(x, w)


def _f64(x, w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return w64 * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)


@pytest.mark.parametrize("xdt,wdt", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                     (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("d", [1, 64, 100, 576, 1536])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_matches_xla_program_and_float64(xdt, wdt, d, scale):
    """x's dtype out; float32 within a few ulps of XLA's program (its reciprocal square root is a refined hardware
    estimate) and of float64; bfloat16 within one bfloat16 rounding of XLA's and three (x / rms, the weight, their
    product) of float64."""
    x, w = _operands(3, d, xdt, wdt, scale)
    got, xla = _norm(x, w), _xla(x, w)
    assert got.dtype == xla.dtype == xdt and got.shape == x.shape
    got, xla = np.asarray(got, np.float32), np.asarray(xla, np.float32)
    f32 = xdt == jnp.float32
    np.testing.assert_allclose(got, xla, rtol=1e-6 if f32 else 2 ** -7, atol=1e-6)
    np.testing.assert_allclose(got, _f64(x, w), rtol=1e-6 if f32 else 3 * 2 ** -8, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bits_do_not_depend_on_the_other_rows(dtype):
    """A row's result alone, among others, and inside a [B, T, D] batch: the same bits (a verified tree row is the
    one-row decode step's norm)."""
    x, w = _operands(12, 576, dtype, dtype, seed=1)
    whole = np.asarray(_norm(x.reshape(3, 4, 576), w)).reshape(12, 576)
    for r in (0, 5, 11):
        np.testing.assert_array_equal(np.asarray(_norm(x[r:r + 1], w)), whole[r:r + 1])
        np.testing.assert_array_equal(np.asarray(_norm(x[r:r + 3], w))[:1], whole[r:r + 1])


def test_layers_rms_norm_runs_in_the_kernel_and_disabled_keeps_xla():
    x, w = _operands(2, 64, jnp.float32, jnp.float32)

    def hlo():
        return jax.jit(lambda x, w: layers.rms_norm(x, w, EPS)).lower(x, w).as_text()

    assert "specjax_rms_norm" in hlo()
    with cpu_dense.disabled():
        assert "specjax_rms_norm" not in hlo()
        np.testing.assert_array_equal(np.asarray(_norm(x[:1], w)), np.asarray(_xla(x[:1], w)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_the_xla_programs(dtype):
    """Training differentiates the draft head's norms: the kernel's tangents are the XLA program's."""
    x, w = _operands(4, 96, dtype, dtype, seed=2)
    probe = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)

    def loss(norm):
        return lambda x, w: (norm(x, w, EPS).astype(jnp.float32) * probe).sum()

    got = jax.jit(jax.grad(loss(layers.rms_norm), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(loss(layers._xla_rms_norm), argnums=(0, 1)))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    if dtype == jnp.float32:  # and both are the calculus, in float64: y = x w / sqrt(mean(x^2) + eps)
        xd, wd, pd = (np.asarray(a, np.float64) for a in (x, w, probe))
        r = ((xd ** 2).mean(-1, keepdims=True) + EPS) ** -0.5
        gx = r * wd * pd - xd * r ** 3 * (xd * wd * pd).sum(-1, keepdims=True) / xd.shape[-1]
        np.testing.assert_allclose(np.asarray(got[0]), gx, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), (xd * r * pd).sum(0), rtol=1e-4, atol=1e-6)


def test_other_inputs_keep_xla():
    """float16, a weight that is not [D], and empty inputs are not the kernel's: XLA's program runs them."""
    x16, w16 = _operands(2, 64, jnp.float16, jnp.float16)
    assert not cpu_dense.supports_norm(x16, w16)
    x, w = _operands(2, 64, jnp.float32, jnp.float32)
    assert not cpu_dense.supports_norm(x, w[:32])
    assert not cpu_dense.supports_norm(x, w[None])
    assert not cpu_dense.supports_norm(x[:0], w)
    np.testing.assert_array_equal(np.asarray(_norm(x16, w16)), np.asarray(_xla(x16, w16)))
