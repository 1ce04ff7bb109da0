"""Model definitions: the target decoder and the EAGLE3 / EAGLE draft heads (pure functions over param pytrees)."""

from typing import Callable

import jax
import jax.numpy as jnp


def _f32_normal(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_params(shapes, key: jax.Array, scale: float = 0.02, *, normal: Callable | None = None):
    """Random params for a tree of ``jax.ShapeDtypeStruct`` (tests, benchmarks): every leaf whose path names a norm
    starts at 1, every other leaf is N(0, scale^2). ``normal(key, shape, dtype, scale)`` draws a leaf (default:
    ``jax.random.normal`` in f32, cast to the leaf's dtype); the leaves get keys split from ``key`` in tree order."""
    normal = normal or _f32_normal
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sd), kk in zip(leaves, keys):
        if "norm" in jax.tree_util.keystr(path):
            out.append(jnp.ones(sd.shape, sd.dtype))
        else:
            out.append(normal(kk, sd.shape, sd.dtype, scale))
    return jax.tree_util.tree_unflatten(treedef, out)
