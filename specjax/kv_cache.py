"""Paged KV cache: a pool of fixed-size pages shared by all sequences, and a page table per sequence.

Plain generation uses a contiguous page table (sequence b owns pages [b*pps, (b+1)*pps)); the server hands pages
out from a free list. Pages are head-major, ``[L, P, K, Z, H]``: one kv head of one page is a contiguous ``[Z, H]``
block, the shape a TPU tiles without padding for any number of kv heads (the tile covers the page's rows and the
head dim; with kv heads minor to the slots, 1 or 3 heads would pad to 8 or 16 rows). Either way, a sequence's logical position p lives at page ``page_table[b, p // Z]``, slot
``p % Z``. Entries past ``lengths[b]`` are garbage (rejected tree tokens, padding) and are never read: attention
masks keys by ``position < lengths[b]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, K, Z, H]  key pages of every layer
    v: jax.Array  # [L, P, K, Z, H]  value pages of every layer
    page_table: jax.Array  # i32[B, pages_per_seq]  page index of each logical page of each sequence
    lengths: jax.Array  # i32[B]  committed tokens per sequence (positions [0, lengths) are valid)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.page_size


def pool_shape(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int) -> tuple:
    """The shape of one K (or V) page pool: [L, P, K, Z, H], head-major pages."""
    return (num_layers, num_pages, num_kv_heads, page_size, head_dim)


def init_cache(num_layers: int, num_kv_heads: int, head_dim: int, batch: int, max_len: int, *,
               page_size: int = 16, dtype=jnp.bfloat16, num_pages: int | None = None) -> KVCache:
    """A cache with a contiguous page table; ``num_pages`` defaults to exactly enough pages for the batch."""
    pps = -(-max_len // page_size)
    if num_pages is None:
        num_pages = batch * pps
    if num_pages < batch * pps:
        page_table = jnp.zeros((batch, pps), jnp.int32)  # the caller (server) assigns pages
    else:
        page_table = jnp.arange(batch * pps, dtype=jnp.int32).reshape(batch, pps)
    shape = pool_shape(num_layers, num_pages, num_kv_heads, page_size, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_table=page_table,
                   lengths=jnp.zeros((batch,), jnp.int32))


def slot_indices(page_table, positions, page_size: int, valid=None):
    """Pool coordinates of logical positions. positions: i32[B, T] -> (page i32[B, T], slot i32[B, T]).

    Invalid entries (and positions past the page table) get an out-of-range page index so that scatters with
    mode="drop" skip them.
    """
    pps = page_table.shape[1]
    logical = positions // page_size
    in_range = (positions >= 0) & (logical < pps)
    if valid is not None:
        in_range = in_range & valid
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, pps - 1), axis=1)
    page = jnp.where(in_range, page, jnp.iinfo(jnp.int32).max)
    return page, positions % page_size


def write(cache: KVCache, k_new, v_new, positions, valid=None) -> KVCache:
    """Scatter new entries into the pool. k_new, v_new: [L, B, T, K, H]; positions: i32[B, T]; valid: bool[B, T]."""
    page, slot = slot_indices(cache.page_table, positions, cache.page_size, valid)
    nl, _, _, kh, _ = k_new.shape
    # One row of H per (layer, page, kv head, slot): a scatter whose window is the minor (head_dim) axis, which a
    # TPU performs in the pool's own layout (a window over several axes made XLA scatter into a transposed copy of
    # the whole pool at one kv head per chip).
    at = (jnp.arange(nl)[:, None, None, None], page[None, :, :, None], jnp.arange(kh)[None, None, None, :],
          slot[None, :, :, None])  # each broadcasts to [L, B, T, K]
    k = cache.k.at[at].set(k_new.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[at].set(v_new.astype(cache.v.dtype), mode="drop")
    return dataclasses.replace(cache, k=k, v=v)


def gather_layer(k_pages, v_pages, page_table):
    """Contiguous view of one layer's cache. k_pages: [P, K, Z, H]; page_table: i32[B, pps] -> [B, pps*Z, K, H] x2."""
    b, pps = page_table.shape
    _, kh, z, h = k_pages.shape
    k = jnp.swapaxes(k_pages[page_table], 2, 3).reshape(b, pps * z, kh, h)
    v = jnp.swapaxes(v_pages[page_table], 2, 3).reshape(b, pps * z, kh, h)
    return k, v
