"""specjax's CPU split-and-rotate of a fused q/k/v projection (``kernels.cpu_dense.rope_qkv``): XLA's bits (the
program it replaces) and a float64 reference, every CPU ``layers.rope_qkv`` routed to it (the target model's decode
step and prompt chunks included), autodiff, and the inputs it leaves to XLA."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_models import tiny_config

from specjax import layers
from specjax.kernels import cpu_dense
from specjax.models import target

pytestmark = [pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernels cannot be built (layers keep XLA's rope)"),
              pytest.mark.usefixtures("cpu_kernels")]


def _operands(b, t, kv, g, h, dtype, max_pos=40000, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(b, t, kv, g + 2, h)) * 3, dtype)
    positions = jnp.asarray(rng.integers(0, max_pos, size=(b, t)), jnp.int32)
    return qkv, positions, layers.rope_inv_freq(h, 10000.0 if h < 100 else 500000.0, None)


def _rope(qkv, positions, inv):
    return jax.jit(lambda a, p: layers.rope_qkv(a, p, inv))(qkv, positions)


def _xla(qkv, positions, inv):
    return jax.jit(lambda a, p: layers._xla_rope_qkv(a, *layers.rope_cos_sin(p, inv)))(qkv, positions)


def _given_cos_sin(qkv, positions, inv):
    """The kernel and XLA's program on the same cos and sin (jit arguments: XLA cannot recompute them per element,
    whose bits at large angles depend on how XLA:CPU vectorises the fusion around them)."""
    b, t, kv, g2, h = qkv.shape
    cos, sin = (a.reshape(b * t, -1) for a in jax.jit(layers.rope_cos_sin)(positions, inv))
    qkv4 = qkv.reshape(b * t, kv, g2, h)
    kernel = jax.jit(lambda a, c, s: cpu_dense.rope_qkv(a, c, s, layers._xla_rope_qkv4))(qkv4, cos, sin)
    return kernel, jax.jit(layers._xla_rope_qkv4)(qkv4, cos, sin)


@pytest.mark.xla_defaults  # XLA:CPU contracts the rotation into a multiply-add only with LLVM's optimisations
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 3, 3, 64), (1, 4, 3, 3, 64), (2, 15, 8, 4, 128), (3, 2, 1, 1, 32),
                                   (1, 7, 2, 6, 256), (1, 100, 3, 3, 64)], ids=str)  # the last in runs of 32 rows
def test_bits_are_xlas_and_close_to_float64(dtype, shape):
    """q, k and v as XLA's program computes them from the same cos and sin, bit for bit (the fused multiply-add of
    its rotation included); ``layers.rope_qkv`` within float32 rounding of the rotation in float64."""
    qkv, pos, inv = _operands(*shape, dtype)
    b, t, kv, g, h = shape
    for x, y, n in zip(*_given_cos_sin(qkv, pos, inv), (kv * g, kv, kv)):
        assert x.dtype == y.dtype == dtype and x.shape == y.shape == (b * t, n, h)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    got = _rope(qkv, pos, inv)
    for x, y in zip(got, _xla(qkv, pos, inv)):  # XLA's cos and sin fused per element: equal but for their bits
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=1e-5, rtol=1e-5)
    x64 = np.asarray(qkv, np.float64)
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(inv, np.float64)  # [B, T, H/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]

    def rot(x):
        x1, x2 = x[..., :h // 2], x[..., h // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    k64 = rot(x64[..., g, :])
    # float32 angles at positions up to 40000 are off by up to ~2e-3 rad (their rounding): compare at that scale
    tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-2
    np.testing.assert_allclose(np.asarray(got[1], np.float64), k64, atol=tol * 12, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(qkv[..., g + 1, :]))


def test_small_positions_match_float64_closely():
    qkv, pos, inv = _operands(1, 4, 3, 3, 64, jnp.float32, max_pos=64)
    q = np.asarray(_rope(qkv, pos, inv)[0], np.float64).reshape(1, 4, 3, 3, 64)
    x = np.asarray(qkv, np.float64)[..., :3, :]
    ang = (np.asarray(pos, np.float64)[..., None] * np.asarray(inv, np.float64))[:, :, None, None]
    x1, x2 = x[..., :32], x[..., 32:]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(q, want, atol=1e-4, rtol=1e-5)


def test_layers_rope_qkv_runs_in_the_kernel_and_disabled_keeps_xla():
    qkv, pos, inv = _operands(1, 4, 3, 3, 64, jnp.float32)

    def hlo():
        return jax.jit(lambda a, p: layers.rope_qkv(a, p, inv)).lower(qkv, pos).as_text()

    assert "specjax_rope_qkv" in hlo()
    with cpu_dense.disabled():
        assert "specjax_rope_qkv" not in hlo()


def test_the_target_decode_step_rotates_in_the_kernel():
    """A Llama-family model's decode layer (fused q/k/v, no biases, no q/k norms) calls the kernel once per layer
    (in the compiled program: the layers share one lowered function, inlined by XLA), and so does a prompt chunk."""
    cfg = tiny_config()
    params = target.unstack_layers(target.init_params(cfg, jax.random.PRNGKey(0)))
    fwd = jax.jit(lambda p, t, pos: target.forward(p, cfg, t, pos).logits)

    def calls(t):
        tokens, pos = jnp.zeros((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]
        return fwd.lower(params, tokens, pos).compile().as_text().count('custom_call_target="specjax_rope_qkv"')

    assert calls(1) == cfg.num_layers
    assert calls(cpu_dense.MAX_TOKENS + 1) == cfg.num_layers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_the_xla_programs(dtype):
    qkv, pos, inv = _operands(1, 3, 2, 2, 64, dtype, seed=2)
    probe = [jnp.asarray(np.random.default_rng(i).normal(size=s), jnp.float32)
             for i, s in enumerate([(1, 3, 4, 64), (1, 3, 2, 64), (1, 3, 2, 64)])]

    def loss(fn):
        return lambda a: sum((o.astype(jnp.float32) * p).sum() for o, p in zip(fn(a), probe))

    got = jax.jit(jax.grad(loss(lambda a: layers.rope_qkv(a, pos, inv))))(qkv)
    want = jax.jit(jax.grad(loss(lambda a: layers._xla_rope_qkv(a, *layers.rope_cos_sin(pos, inv)))))(qkv)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if dtype == jnp.float32:  # the loss is linear in qkv, so its gradient g must give loss(e) = <g, e> for any e
        f = jax.jit(loss(lambda a: layers.rope_qkv(a, pos, inv)))
        for seed in range(3):
            e = jnp.asarray(np.random.default_rng(10 + seed).normal(size=qkv.shape), jnp.float32)
            inner = float(np.sum(np.asarray(got, np.float64) * np.asarray(e, np.float64)))
            assert float(f(e)) == pytest.approx(inner, rel=1e-4, abs=1e-3)


def test_other_inputs_keep_xla():
    """float16 and an odd or too large head dim are XLA's (a prompt chunk of any length is the kernel's)."""
    qkv, pos, inv = _operands(1, 2, 2, 2, 64, jnp.float32)
    assert cpu_dense.supports_rope(qkv)
    assert not cpu_dense.supports_rope(qkv.astype(jnp.float16))
    assert not cpu_dense.supports_rope(qkv[..., :63])
    assert not cpu_dense.supports_rope(jnp.zeros((1, 1, 1, 3, 1024)))
    assert cpu_dense.supports_rope(jnp.zeros((1, 512, 1, 3, 64)))
    q16 = qkv.astype(jnp.float16)
    for x, y in zip(_rope(q16, pos, inv), _xla(q16, pos, inv)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
