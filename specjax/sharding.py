"""Mesh (dp, tp) and the one table that maps logical axes to mesh axes.

Params and activations name their axes logically (batch, seq, embed, heads, kv_heads, head_dim, ffw, vocab, layers);
``RULES`` maps each to a mesh axis or None. ``logical_to_spec`` turns a tuple of logical names into a
PartitionSpec and refuses a spec that uses one mesh axis twice, or a dimension that does not divide.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEFAULT_RULES: dict[str, str | None] = {
    "batch": "dp",
    "seq": None,
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "ffw": "tp",
    "vocab": "tp",
    "layers": None,
    "pages": None,
    "draft_vocab": None,
}


class ShardingError(ValueError):
    pass


def make_mesh(dp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (dp, tp) mesh over ``devices`` (default: all devices of all processes). tp is the fast (inner) axis so that
    tensor-parallel collectives stay within a host."""
    devices = list(devices if devices is not None else jax.devices())
    if dp * tp != len(devices):
        raise ShardingError(f"mesh dp={dp} x tp={tp} = {dp * tp} devices, but {len(devices)} are available")
    arr = np.array(devices, dtype=object).reshape(dp, tp)
    return Mesh(arr, ("dp", "tp"))


def logical_to_spec(axes: Sequence[str | None], rules: dict[str, str | None] | None = None) -> P:
    rules = DEFAULT_RULES if rules is None else rules
    mesh_axes = []
    for a in axes:
        if a is None:
            mesh_axes.append(None)
            continue
        if a not in rules:
            raise ShardingError(f"logical axis {a!r} has no rule")
        mesh_axes.append(rules[a])
    used = [m for m in mesh_axes if m is not None]
    if len(used) != len(set(used)):
        raise ShardingError(f"logical axes {tuple(axes)} map mesh axes {mesh_axes} more than once")
    return P(*mesh_axes)


def spec_for_shape(shape, axes, mesh: Mesh, rules=None, *, replicate_indivisible: Sequence[str] = ()) -> P:
    """PartitionSpec for an array of ``shape`` named ``axes``; a dimension that does not divide by its mesh axis
    raises, except logical axes listed in ``replicate_indivisible`` (e.g. kv_heads), which fall back to replication."""
    spec = list(logical_to_spec(axes, rules))
    for i, (dim, m) in enumerate(zip(shape, spec)):
        if m is None:
            continue
        size = mesh.shape[m]
        if dim % size:
            if axes[i] in replicate_indivisible:
                spec[i] = None
                continue
            raise ShardingError(
                f"dimension {axes[i]}={dim} does not divide by mesh axis {m}={size}; choose a tp size that divides "
                f"{dim}")
    return P(*spec)


# ---- activation constraints -------------------------------------------------------------------------------------
# The enclosing ``use_mesh``: (mesh, rules as sorted items) or None. A jit cache key (``jax.make_user_context``): a
# function traced inside one mesh's context is traced anew in another's, nested jitted functions included
# (``target._layer_call``, whose one trace serves every layer of a program).
_ACTIVE = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: dict[str, str | None] | None = None):
    """Within this context, ``constrain`` pins activations to the mesh; outside, it is a no-op."""
    with _ACTIVE(None if mesh is None else (mesh, tuple(sorted((rules or DEFAULT_RULES).items())))):
        yield


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing ``use_mesh`` (None outside one): hooks that must place their own work (the
    tree-attention kernel's shard_map) read it here."""
    active = _ACTIVE.value
    return None if active is None else active[0]


def constrain(x, axes: Sequence[str | None]):
    active = _ACTIVE.value
    if active is None:
        return x
    mesh, rules = active
    spec = list(logical_to_spec(axes, dict(rules)))
    for i, m in enumerate(spec):  # never force an indivisible activation dimension
        if m is not None and x.shape[i] % mesh.shape[m]:
            spec[i] = None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


# ---- KV page pools ------------------------------------------------------------------------------------------------
KV_POOL_AXES = ("layers", "pages", "kv_heads", None, "head_dim")  # [L, P, K, Z, H]


def kv_pool_sharding(mesh: Mesh, pool_shape) -> NamedSharding:
    """Where a KV page pool [L, P, K, Z, H] lives on the mesh: split over kv heads on tp, as the attention weights
    are; replicated when the kv heads do not divide by tp."""
    return NamedSharding(mesh, spec_for_shape(pool_shape, KV_POOL_AXES, mesh, replicate_indivisible=("kv_heads",)))


def put_kv_pool(pool, mesh: Mesh):
    """``pool`` placed by ``kv_pool_sharding``."""
    return jax.device_put(pool, kv_pool_sharding(mesh, pool.shape))


def committed_device(*trees) -> jax.Device | None:
    """The one device that the committed arrays of ``trees`` sit on, or None (nothing committed, or several devices).

    jax compiles a jitted function again when an argument changes from uncommitted to committed: the outputs of a
    call are committed as soon as one input is, so state threaded from call to call (a KV cache over prompt chunks)
    must start out committed to that device too, or the second call compiles the program a second time."""
    devices = {d for a in jax.tree.leaves(trees) if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
               and a.committed for d in a.sharding.device_set}
    return devices.pop() if len(devices) == 1 else None


def agree_on_error(error: str | None) -> str | None:
    """Every process learns whether any of them failed a local check (one allgather of flags), so that none is left
    waiting in a collective the failed ones never join: its own error, or which processes failed; None when all
    passed. One process: ``error`` as it is."""
    if jax.process_count() == 1:
        return error
    flags = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
    failed = [i for i, f in enumerate(flags) if f]
    if not failed:
        return None
    return error or f"process(es) {failed} stopped on a local check: their logs say why"
