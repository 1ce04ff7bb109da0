"""Tree attention for speculative verification: Pallas TPU kernel, XLA reference, and the forward hook."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from specjax.kernels.tree_attention.kernel import ref_tree_attention, tpu_unsupported_reason, tree_attention
from specjax.layers import xla_cache_attention

__all__ = ["tree_attention", "ref_tree_attention", "make_cache_attention", "tpu_unsupported_reason"]

log = logging.getLogger("specjax")

_IMPLS = ("auto", "pallas", "xla")
_warned: set = set()


def _xla_fallback(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale):
    """``target.forward``'s own XLA path (what ``cache_attention=None`` runs), for shapes the kernel cannot serve."""
    s = page_table.shape[1] * k_pages.shape[1]
    cache_valid = jnp.broadcast_to(jnp.arange(s)[None, None, :] < lengths[:, None, None], (*mask.shape[:2], s))
    return xla_cache_attention(q, k, v, mask, k_pages, v_pages, page_table, cache_valid, sm_scale)


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

    def cache_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale):
        if on_tpu:
            reason = tpu_unsupported_reason(q.shape[2], k.shape[2], q.shape[3], k_pages.shape[1], k_pages.dtype)
            if reason is not None:
                if reason not in _warned:
                    _warned.add(reason)
                    log.warning("tree-attention kernel cannot serve %s on TPU; using the XLA attention path", reason)
                return _xla_fallback(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale)
        return tree_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=float(sm_scale),
                              interpret=not on_tpu)

    return cache_attention
