"""Model definitions: the target decoder and the EAGLE3 / EAGLE draft heads (pure functions over param pytrees)."""

import jax
import jax.numpy as jnp


def random_params(shapes, key: jax.Array, scale: float = 0.02):
    """Random params for a tree of ``jax.ShapeDtypeStruct`` (tests, benchmarks): every leaf whose path names a norm
    starts at 1, every other leaf is N(0, scale^2)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sd), kk in zip(leaves, keys):
        if "norm" in jax.tree_util.keystr(path):
            out.append(jnp.ones(sd.shape, sd.dtype))
        else:
            out.append((jax.random.normal(kk, sd.shape, jnp.float32) * scale).astype(sd.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
