"""What a program's start-up traces: an unrolled forward traces one decoder layer, shared by every layer's call;
platform-specific code traces the lowering platform's branch only; and the trace-time switches that are not
arguments (``sharding.use_mesh``, ``cpu_dense.disabled``, ``platforms.lowering_for``) are jit cache keys, so a
shared trace is never reused under another setting."""

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params
from spec_models import tiny_config

from specjax import layers, platforms, sharding
from specjax.kernels import cpu_dense
from specjax.models import target


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _model(num_layers=4):
    cfg = tiny_config(layers=num_layers)
    params = target.unstack_layers(target.init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jnp.zeros((1, 3), jnp.int32)
    return cfg, params, tokens, jnp.arange(3, dtype=jnp.int32)[None]


def test_unrolled_layers_share_one_trace():
    cfg, params, tokens, positions = _model()
    jaxpr = jax.make_jaxpr(lambda p, t, pos: target.forward(p, cfg, t, pos).logits)(params, tokens, positions)
    calls = [e for e in jaxpr.jaxpr.eqns if e.params.get("name") == "_layer"]
    assert len(calls) == cfg.num_layers
    assert len({id(e.params["jaxpr"]) for e in calls}) == 1  # one trace, called once per layer


def test_platform_code_traces_one_branch():
    x, w = jnp.ones((2, 64), jnp.float32), jnp.ones((64,), jnp.float32)

    def prims(fn):
        return {e.primitive.name for e in _eqns(jax.make_jaxpr(fn)(x, w).jaxpr)}

    norm = lambda x, w: layers.rms_norm(x, w, 1e-6)  # noqa: E731
    on_cpu = prims(norm)
    assert not on_cpu & {"platform_index", "cond"}
    assert ("ffi_call" in on_cpu) == cpu_dense.supports_norm(x, w)
    with platforms.lowering_for("tpu"):
        on_tpu = prims(norm)  # the same function: traced anew for the other platform
    assert not on_tpu & {"platform_index", "cond", "ffi_call"}
    assert ("ffi_call" in prims(norm)) == ("ffi_call" in on_cpu)


def test_trace_switches_are_jit_cache_keys():
    """The layer's shared trace (``target._layer_call``) is keyed on the mesh and on the kernel switch: a trace
    under a mesh is not reused outside it, and one with the kernels disabled is not reused once they are back."""
    cfg, params, tokens, positions = _model(num_layers=2)
    h = jnp.zeros((1, 3, cfg.hidden_size), jnp.float32)
    mask = layers.causal_mask(jnp.ones((1, 3), bool))

    def layer_prims():  # the same inputs every time: only the context differs
        jaxpr = jax.make_jaxpr(lambda lp, h: target._layer_call(cfg, lp, h, positions, mask, None, 0, None, None, True,
                                                                False))(params.layers[0], h)
        (call,) = [e for e in jaxpr.jaxpr.eqns if e.params.get("name") == "_layer"]
        return {e.primitive.name for e in _eqns(call.params["jaxpr"].jaxpr)}

    mesh = sharding.make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    with sharding.use_mesh(mesh):
        assert "sharding_constraint" in layer_prims()
    assert "sharding_constraint" not in layer_prims()
    if cpu_dense.available():
        with cpu_dense.disabled():
            assert "ffi_call" not in layer_prims()
        assert "ffi_call" in layer_prims()
