"""Tree attention for speculative verification: Pallas TPU kernel, XLA reference, and the forward hook."""

from __future__ import annotations

import functools

import jax

from specjax.kernels.tree_attention.kernel import ref_tree_attention, tree_attention

__all__ = ["tree_attention", "ref_tree_attention", "make_cache_attention"]

_IMPLS = ("auto", "pallas", "xla")


@functools.lru_cache(maxsize=None)
def make_cache_attention(impl: str = "auto", sliding_window: int | None = None):
    """The ``cache_attention`` hook of ``models.target.forward`` for an attention implementation, or None for XLA.

    "auto": the Pallas kernel on TPU, None (the XLA reference path) elsewhere, and always None for sliding-window
    models (the kernel has no window). "pallas": the kernel everywhere (interpreted off TPU: slow, for tests).
    "xla": None. Cached, so one impl gives one (hashable) hook and jitted callers are not recompiled.
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {_IMPLS}")
    if sliding_window is not None:
        if impl == "pallas":
            raise ValueError("sliding-window models use the XLA attention path; use attention impl 'xla' or 'auto'")
        return None
    on_tpu = jax.default_backend() == "tpu"
    if impl == "xla" or (impl == "auto" and not on_tpu):
        return None

    def cache_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale):
        return tree_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=float(sm_scale),
                              interpret=not on_tpu)

    return cache_attention
