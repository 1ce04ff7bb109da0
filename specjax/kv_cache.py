"""Paged KV cache: a pool of fixed-size pages shared by all sequences, and a page table per sequence.

Plain generation uses a contiguous page table (sequence b owns pages [b*pps, (b+1)*pps)); the server hands pages
out from a free list. Pages are head-major, ``[L, P, K, Z, H]``: one kv head of one page is a contiguous ``[Z, H]``
block, the shape a TPU tiles without padding for any number of kv heads (the tile covers the page's rows and the
head dim; with kv heads minor to the slots, 1 or 3 heads would pad to 8 or 16 rows). A head dim under the TPU's
128 lanes (64: SmolLM2) would still pad each row to 128 lanes, and the TPU compiler then stores the pool with the
page axis minor, which the K/V scatter and the kernel cannot use in place (each step copied the pool twice). Such
pools are lane-packed: ``[L, P, K, Z / f, f * H]`` with ``f = 128 // H`` slots side by side in one 128-lane row
(``pack_factor``), the same bytes in the same order as ``[L, P, K, Z, H]`` (a row-major reshape), so only the
readers change. A sequence's logical position p lives at page ``page_table[b, p // Z]``, slot ``p % Z`` (row
``slot // f``, lanes ``(slot % f) * H`` onward). Entries past ``lengths[b]`` are garbage (rejected tree tokens,
padding) and are never read: attention masks keys by ``position < lengths[b]``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax import platforms
from specjax.kernels import cpu_dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, K, Z, H]  key pages of every layer
    v: jax.Array  # [L, P, K, Z, H]  value pages of every layer
    page_table: jax.Array  # i32[B, pages_per_seq]  page index of each logical page of each sequence
    lengths: jax.Array  # i32[B]  committed tokens per sequence (positions [0, lengths) are valid)


_LANES = 128
HALF_DTYPES = (jnp.bfloat16, jnp.float16)  # indexed as uint16 bits on a CPU (``on_bits``)


def on_bits(fn, *arrays):
    """``fn(*arrays)`` (a gather or scatter) with every bf16/f16 array passed as its uint16 bits, a free bitcast, on
    a CPU; uint16 results come back in that half dtype. XLA:CPU runs a half-precision gather or scatter on an f32
    copy of the whole operand: a bf16 SmolLM2 decode step converted the 113 MB embedding table for one row and each
    K/V pool for every layer's write, twice the step's weight bytes (docs/benchmarks.md, fifteenth session). On
    integers it indexes in place. Other platforms and dtypes run ``fn`` as it is."""
    half = [a.dtype for a in arrays if a.dtype in HALF_DTYPES]
    if not half:
        return fn(*arrays)

    def bits(*xs):
        out = fn(*(jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in HALF_DTYPES else x for x in xs))
        return jax.tree.map(lambda y: jax.lax.bitcast_convert_type(y, half[0]) if y.dtype == jnp.uint16 else y, out)

    return platforms.select(*arrays, cpu=bits, default=fn)


DEFAULT_PAGE_SIZE = 16


def sublane_rows(dtype) -> int:
    """Rows of a TPU tile of ``dtype`` (a (rows, 128) block): 8 for 32-bit, 16 for 16-bit values."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _packing(head_dim: int, dtype) -> tuple[int, int]:
    """(slots per 128-lane row, the smallest page size whose packed rows fill whole sublane tiles) for a head dim
    under 128 that divides it; (1, 1) for the others (never packed)."""
    if head_dim >= _LANES or _LANES % head_dim:
        return 1, 1
    f = _LANES // head_dim
    return f, f * sublane_rows(dtype)


def pack_factor(head_dim: int, page_size: int, dtype=jnp.float32) -> int:
    """Slots per 128-lane row of a pool page: ``128 // head_dim`` for head dims under 128 that divide it, when the
    page's packed rows stay a multiple of the dtype's sublane tile (8 rows fp32, 16 bf16); else 1 (unpacked)."""
    f, min_page = _packing(head_dim, dtype)
    return f if page_size % min_page == 0 else 1


def default_page_size(head_dim: int, dtype, platform: str) -> int:
    """Slots per page when none is asked for: 16, or on a TPU the smallest page size (>= 16) whose pool packs
    (``pack_factor``), e.g. 32 for bf16 at head dim 64. An unpacked small-head-dim pool is padded to 128 lanes on a
    TPU, and its K/V write copied it on every step (docs/07-preflight.md)."""
    if platform != "tpu":
        return DEFAULT_PAGE_SIZE
    return max(DEFAULT_PAGE_SIZE, _packing(head_dim, dtype)[1])


def pool_shape(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
               dtype=jnp.float32) -> tuple:
    """The shape of one K (or V) page pool: [L, P, K, Z, H], head-major pages, lane-packed to
    [L, P, K, Z / f, f * H] for small head dims (``pack_factor``)."""
    f = pack_factor(head_dim, page_size, dtype)
    return (num_layers, num_pages, num_kv_heads, page_size // f, f * head_dim)


def page_size_of(pages, head_dim: int) -> int:
    """The page size (slots per page) of a pool [..., R, W] holding head_dim-wide rows (packed or not)."""
    return pages.shape[-2] * pages.shape[-1] // head_dim


def unpack_pages(pages, head_dim: int):
    """[..., R, W] pages (lane-packed or not) as [..., Z, H]: a row-major reshape. For gathered blocks only (on a
    TPU it relayouts what it is given: never hand it the whole pool)."""
    if pages.shape[-1] == head_dim:
        return pages
    return pages.reshape(*pages.shape[:-2], page_size_of(pages, head_dim), head_dim)


def init_cache(num_layers: int, num_kv_heads: int, head_dim: int, batch: int, max_len: int, *,
               page_size: int = DEFAULT_PAGE_SIZE, dtype=jnp.bfloat16, num_pages: int | None = None) -> KVCache:
    """A cache with a contiguous page table; ``num_pages`` defaults to exactly enough pages for the batch."""
    pps = -(-max_len // page_size)
    if num_pages is None:
        num_pages = batch * pps
    if num_pages < batch * pps:
        page_table = jnp.zeros((batch, pps), jnp.int32)  # the caller (server) assigns pages
    else:
        page_table = jnp.arange(batch * pps, dtype=jnp.int32).reshape(batch, pps)
    shape = pool_shape(num_layers, num_pages, num_kv_heads, page_size, head_dim, dtype)
    try:
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    except jax.errors.JaxRuntimeError as e:  # eager only: a traced cache is allocated when its program runs
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        gib = 2 * math.prod(shape) * jnp.dtype(dtype).itemsize / 2 ** 30
        raise ValueError(f"a KV cache for {batch} sequence(s) of {max_len} positions ({gib:,.1f} GiB of keys and "
                         f"values) does not fit in this device's memory: ask for fewer new tokens or shorter "
                         f"prompts") from None
    return KVCache(k=k, v=v, page_table=page_table, lengths=jnp.zeros((batch,), jnp.int32))


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


def write(cache: KVCache, k_new, v_new, positions, valid=None, *, layer=None) -> KVCache:
    """Scatter new entries into the pool. k_new, v_new: [L, B, T, K, H], or one layer's [B, T, K, H] with ``layer``
    (an int or traced scalar); positions: i32[B, T]; valid: bool[B, T].

    A donated pool is updated in place only where every read of it comes before the scatter in the data flow.
    Model layers therefore write their own K/V before their attention reads the pool (``layer``; see
    ``target.forward(write_valid=...)``): a write of every layer after the forward does not follow the last layer's
    reads, and XLA:CPU then copied the whole pool twice per step. On a CPU with specjax's kernels the write is one
    custom call aliased to the pools (``cpu_dense.kv_write``): XLA's scatter into a bf16 pool ran on its uint16 bits
    (``on_bits``), and the bits views of the donated pools were two copies of each per step.
    """
    if layer is not None:
        k_new, v_new = k_new[None], v_new[None]
        layer_ids = jnp.reshape(jnp.asarray(layer, jnp.int32), (1, 1, 1, 1))
    else:
        layer_ids = jnp.arange(k_new.shape[0])[:, None, None, None]
    kh, h = k_new.shape[3:]
    f = cache.k.shape[-1] // h  # slots per row (lane-packed pools)
    page, slot = slot_indices(cache.page_table, positions, cache.k.shape[-2] * f, valid)
    xla = (lambda c: _write_packed(c, k_new, v_new, layer_ids, page, slot, f)) if f > 1 else (
        lambda c: _write_rows(c, k_new, v_new, layer_ids, page, slot))
    if not cpu_dense.supports_pages(cache.k) or k_new.size == 0:
        return xla(cache)

    def kernel(c):  # the pools written where they lie (a CPU program)
        k, v = cpu_dense.kv_write(c.k, c.v, k_new, v_new, page, slot, 0 if layer is None else layer)
        return dataclasses.replace(c, k=k, v=v)

    return platforms.select(cache, cpu=kernel, default=xla)


def _write_rows(cache: KVCache, k_new, v_new, layer_ids, page, slot) -> KVCache:
    """``write`` into an unpacked pool [L, P, K, Z, H] by XLA."""
    kh = k_new.shape[3]
    # One row of H per (layer, page, kv head, slot): a scatter whose window is the minor (head_dim) axis, which a
    # TPU performs in the pool's own layout (a window over several axes made XLA scatter into a transposed copy of
    # the whole pool at one kv head per chip).
    at = (layer_ids, page[None, :, :, None], jnp.arange(kh)[None, None, None, :],
          slot[None, :, :, None])  # each broadcasts to [L, B, T, K]
    scatter = lambda pool, new: pool.at[at].set(new, mode="drop")
    k = on_bits(scatter, cache.k, k_new.astype(cache.k.dtype))
    v = on_bits(scatter, cache.v, v_new.astype(cache.v.dtype))
    return dataclasses.replace(cache, k=k, v=v)


def _write_packed(cache: KVCache, k_new, v_new, layer_ids, page, slot, f: int) -> KVCache:
    """``write`` into a lane-packed pool [L, P, K, Z/f, f*H]: the row of H of (layer, page, kv head, slot) is lanes
    ``(slot % f) * H`` onward of row ``slot // f``.

    On a TPU, a scatter of half-rows (a window at a dynamic lane offset) is no native scatter: XLA expands it into a
    serial loop over every (layer, token, head), and reshaping the pool to [.., Z, H] would copy it. So each lane
    group j is written as whole 128-lane rows (a native in-place scatter, as for unpacked pools): the rows of the
    tokens whose slot is j mod f are gathered, their group j replaced, and scattered back; the next group reads the
    result, so two tokens sharing a row both land. Elsewhere (CPU, GPU: row-major buffers) the reshape is free and
    one scatter per pool does it: the TPU way costs 4f kernels per layer, and XLA:CPU maps memory per kernel (with
    the K/V written layer by layer, a SmolLM2 step program then held twice the memory maps, and a process
    compiling many programs ran out of them). ``platforms.select`` picks the way for the lowering platform, so a
    TPU program compiled on a CPU host (``specjax.preflight``) gets the TPU way."""
    kh, h = k_new.shape[3:]

    def tpu(pool, new):
        heads = jnp.arange(kh)[None, None, None, :]
        row = (slot // f)[None, :, :, None]
        for j in range(f):
            page_j = jnp.where(slot % f == j, page, jnp.iinfo(jnp.int32).max)  # other groups' tokens are dropped
            at = (layer_ids, page_j[None, :, :, None], heads, row)  # each broadcasts to [L, B, T, K]
            rows = pool.at[at].get(mode="clip")  # [L, B, T, K, f*H]; dropped tokens read any row
            rows = rows.at[..., j * h:(j + 1) * h].set(new)
            pool = pool.at[at].set(rows, mode="drop")
        return pool

    def row_major(pool, new):
        flat = pool.reshape(*pool.shape[:3], pool.shape[3] * f, h)  # [L, P, K, Z, H]: the same bytes
        at = (layer_ids, page[None, :, :, None], jnp.arange(kh)[None, None, None, :], slot[None, :, :, None])
        return flat.at[at].set(new, mode="drop").reshape(pool.shape)

    out = [platforms.select(pool, new.astype(pool.dtype), tpu=tpu,
                                      default=lambda pool, new: on_bits(row_major, pool, new))
           for pool, new in ((cache.k, k_new), (cache.v, v_new))]
    return dataclasses.replace(cache, k=out[0], v=out[1])


def gather_layer(k_pages, v_pages, page_table, head_dim: int | None = None):
    """Contiguous view of one layer's cache. k_pages: [P, K, Z, H] (or lane-packed [P, K, Z/f, f*H], with
    ``head_dim``); page_table: i32[B, pps] -> [B, pps*Z, K, H] x2."""
    b, pps = page_table.shape
    h = head_dim or k_pages.shape[-1]
    kh, z = k_pages.shape[1], page_size_of(k_pages, h)
    k, v = (jnp.swapaxes(take_pages(pages, page_table, h), 2, 3).reshape(b, pps * z, kh, h)
            for pages in (k_pages, v_pages))
    return k, v


def take_pages(pages, at, head_dim: int):
    """The pages ``pages[at]`` of a pool ([P, K, Z, H], lane-packed [P, K, Z/f, f*H], or stacked over layers with
    ``at = (layer, cols)``; cols i32[B, n]), unpacked to [..., K, Z, H]. On a CPU, specjax's kernel copies the pages
    out of the pool in place (``cpu_dense.take_pages``: a bits view of a bf16 pool entering the attention loop was a
    copy of the whole pool per layer); without it, half-precision pools are indexed on their bits (``on_bits``)."""
    def xla(pages):
        return on_bits(lambda pool: pool[at], pages)

    layer, cols = at if isinstance(at, tuple) else (0, at)
    as_stacked = (lambda p: p) if isinstance(at, tuple) else (lambda p: p[None])  # [L, P, K, R, W]

    def kernel(pages):  # in place, any dtype (a CPU program)
        return cpu_dense.take_pages(as_stacked(pages), cols, layer)

    if not cpu_dense.supports_pages(as_stacked(pages)) or cols.ndim != 2:
        return unpack_pages(xla(pages), head_dim)
    return unpack_pages(platforms.select(pages, cpu=kernel, default=xla), head_dim)
