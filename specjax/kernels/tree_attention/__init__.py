"""Tree attention for speculative verification: Pallas TPU kernel, XLA reference, and the forward hook."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.kernels.tree_attention.kernel import ref_tree_attention, tpu_unsupported_reason, tree_attention
from specjax.kv_cache import page_size_of
from specjax.layers import paged_attention
from specjax.sharding import active_mesh

__all__ = ["tree_attention", "ref_tree_attention", "make_cache_attention", "tpu_unsupported_reason", "head_split"]

log = logging.getLogger("specjax")

_IMPLS = ("auto", "pallas", "xla")
_warned: set = set()


def _xla_fallback(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale, layer=None):
    """``target.forward``'s own XLA path (what ``cache_attention=None`` runs), for shapes the kernel cannot serve
    (the kernel's models have no sliding window, so no positions are needed)."""
    return paged_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, None, sm_scale, layer=layer)


@functools.lru_cache(maxsize=None)
def make_cache_attention(impl: str = "auto", sliding_window: int | None = None, platform: str | None = None):
    """The ``cache_attention`` hook of ``models.target.forward`` for an attention implementation, or None for XLA.

    "auto": the Pallas kernel on TPU, None (the XLA reference path) elsewhere, and always None for sliding-window
    models (the kernel has no window). "pallas": the kernel everywhere (interpreted off TPU: slow, for tests).
    "xla": None. ``platform`` overrides ``jax.default_backend()`` (preflight compiles for a TPU from a CPU host).
    On TPU, a shape the kernel cannot compile for (``tpu_unsupported_reason``) runs the XLA path instead, with
    the reason logged once per shape, so that start-up never fails on a Mosaic error.
    Cached, so one impl gives one (hashable) hook and jitted callers are not recompiled.
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {_IMPLS}")
    if sliding_window is not None:
        if impl == "pallas":
            raise ValueError("sliding-window models use the XLA attention path; use attention impl 'xla' or 'auto'")
        return None
    on_tpu = (platform or jax.default_backend()) == "tpu"
    if impl == "xla" or (impl == "auto" and not on_tpu):
        return None

    def cache_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale, layer=None):
        # k_pages, v_pages: one layer's pool [P, K, Z, H], or every layer's [L, P, K, Z, H] with ``layer`` (either
        # lane-packed [.., Z/f, f*H] for small head dims: kv_cache.pack_factor)
        mesh = active_mesh()
        split = head_split(mesh, q.shape[2], k.shape[2])
        if on_tpu:  # the kernel sees one shard's heads
            reason = tpu_unsupported_reason(q.shape[2] // split, k.shape[2] // split, q.shape[3],
                                            page_size_of(k_pages, q.shape[3]), k_pages.dtype, tree_tokens=q.shape[1])
            if reason is not None:
                if reason not in _warned:
                    _warned.add(reason)
                    log.warning("tree-attention kernel cannot serve %s on TPU; using the XLA attention path", reason)
                return _xla_fallback(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale, layer)
        kernel = functools.partial(tree_attention, sm_scale=float(sm_scale), interpret=not on_tpu)
        if layer is None:
            k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        if mesh is None or mesh.size == 1:
            return kernel(q, k, v, mask, k_pages, v_pages, page_table, lengths, layer=layer)
        return _on_shards(kernel, mesh, split, q, k, v, mask, k_pages, v_pages, page_table, lengths, layer)

    return cache_attention


def head_split(mesh, num_heads: int, num_kv_heads: int) -> int:
    """How many ways the heads are split on a mesh's tp axis (as the weights and the KV pool are): tp when the
    query and kv heads divide, else 1 (the pool is then replicated)."""
    tp = mesh.shape.get("tp", 1) if mesh is not None else 1
    return tp if num_heads % tp == 0 and num_kv_heads % tp == 0 else 1


def _on_shards(kernel, mesh, split, q, k, v, mask, k_pages, v_pages, page_table, lengths, layer):
    """The kernel per device under ``shard_map`` (XLA cannot partition a Mosaic call): each tp shard attends over
    its own heads and its own slice of the stacked KV pool [L, P, K, Z, H]; with ``split`` 1 every device computes
    all heads."""
    tp = "tp" if split > 1 else None
    heads, pool = P(None, None, tp, None), P(None, None, tp, None, None)

    def per_shard(q, k, v, mask, k_pages, v_pages, page_table, lengths, layer):
        return kernel(q, k, v, mask, k_pages, v_pages, page_table, lengths, layer=layer)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(heads, heads, heads, P(), pool, pool, P(), P(), P()),
                         out_specs=heads, check_vma=False)(q, k, v, mask, k_pages, v_pages, page_table, lengths,
                                                           jnp.asarray(layer, jnp.int32))
