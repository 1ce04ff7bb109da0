"""Tree attention for speculative verification: Pallas TPU kernel, XLA reference, and the forward hook."""

from __future__ import annotations

import jax

from specjax.kernels.tree_attention.kernel import ref_tree_attention, tree_attention

__all__ = ["tree_attention", "ref_tree_attention", "make_cache_attention"]

_IMPLS = ("auto", "pallas", "xla")


def make_cache_attention(impl: str = "auto"):
    """The ``cache_attention`` hook of ``models.target.forward`` for an attention implementation, or None for XLA.

    "auto": the Pallas kernel on TPU, None (the XLA reference path) elsewhere. "pallas": the kernel everywhere
    (interpreted off TPU: slow, for tests). "xla": None.
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {_IMPLS}")
    on_tpu = jax.default_backend() == "tpu"
    if impl == "xla" or (impl == "auto" and not on_tpu):
        return None

    def cache_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale):
        return tree_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=float(sm_scale),
                              interpret=not on_tpu)

    return cache_attention
