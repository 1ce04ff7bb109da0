"""Tree attention for speculative verification: a Pallas TPU kernel, its reference, and input validation.

One verify step runs the T tree tokens of every sequence through the target. In each layer, query t of sequence b
attends to the committed prefix (positions < lengths[b], read page by page from the paged pool through the page
table) and to the tree tokens that ``mask[b, t]`` marks (its ancestors and itself). The semantics are exactly
``specjax.layers.attention`` over ``kv_cache.gather_layer``; see docs/06-tree-attention-kernel.md for the design.

Kernel layout, per grid step (one sequence b and one tile of Tq of its query tokens; one tile unless the queries
and their scores would not fit the VMEM bounds, as for long prefill chunks):
- the tile's queries are regrouped to [K, G*Tq, H] so that the G query heads sharing a kv head form one matmul
  operand; every tile sees all T new keys (its rows of the mask say which) and streams the prefix pages again;
- the T new keys/values arrive as [K, Tp, H] blocks and the tile's rows of the tree mask as bits
  (i32[Tq, ceil(Tp/32)]);
- cache pages are DMA'd from HBM ``pages_per_block`` at a time into a double buffer (the next block streams in
  while the current one is used), each page whole ([K, Z, H]: head-major, so each head's rows land contiguous in a
  [K, block, H] buffer) and only if it holds committed tokens; lane-packed pools ([K, Z/f, f*H], f slots per
  128-lane row for small head dims: ``kv_cache.pack_factor``) are read as they are, each lane group j of the rows
  being the keys of slots f*r + j;
- flash-style online softmax in fp32 across the tree block and the page blocks, state kept in VMEM scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.kv_cache import gather_layer, page_size_of, sublane_rows

MASK_VALUE = -1e30  # finite (like layers.NEG_INF): a row that sees nothing yet stays finite, never NaN
_LANES = 128  # running max / sum are stored lane-broadcast, one full vreg row per query row
_TARGET_BLOCK_TOKENS = 256  # default pages_per_block aims at this many cached tokens per DMA block
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # the 16-bit unpacking below is exact for bf16 only


def _cdiv(a, b):
    return (a + b - 1) // b if isinstance(a, int) else lax.div(a + b - 1, b)  # operands are >= 0: truncation


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def validate_inputs(q, k, v, mask, k_pages, v_pages, page_table, lengths, *, sm_scale=1.0, pages_per_block=None,
                    layer=None):
    """Raise ValueError unless the arguments fit the tree-attention contract (static checks: shapes, dtypes)."""
    if layer is None and getattr(k_pages, "ndim", 4) == 5:
        raise ValueError(f"stacked pools [L, P, K, Z, H] {k_pages.shape} need the layer to read (layer=...)")
    if layer is not None:
        if k_pages.ndim != 5:
            raise ValueError(f"with layer=..., pools must be stacked [L, P, K, Z, H], got shape {k_pages.shape}")
        if isinstance(layer, int) and not 0 <= layer < k_pages.shape[0]:
            raise ValueError(f"layer {layer} is outside the pool's {k_pages.shape[0]} layers")
        k_pages, v_pages = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (k_pages, v_pages))  # one layer
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H], got shape {q.shape}")
    b, t, n, h = q.shape
    if t < 1:
        raise ValueError("q must hold at least one tree token (T >= 1)")
    if k.ndim != 4 or k.shape[:2] != (b, t) or k.shape[3] != h:
        raise ValueError(f"k must be [B, T, K, H] = [{b}, {t}, K, {h}], got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
    kh = k.shape[2]
    if kh < 1 or n % kh:
        raise ValueError(f"GQA needs N % K == 0: {n} query heads, {kh} kv heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v must share one dtype, float32 or bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask.shape != (b, t, t):
        raise ValueError(f"mask must be [B, T, T] = [{b}, {t}, {t}] (T = q.shape[1]), got {mask.shape}")
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise ValueError(f"mask must be bool (or integer 0/1), got {mask.dtype}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [P, K, Z, H] (or lane-packed [P, K, Z/f, f*H]), got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype} must match k_pages {k_pages.shape} {k_pages.dtype}")
    if k_pages.shape[1] != kh or k_pages.shape[3] % h:
        raise ValueError(f"pages must be [P, K={kh}, Z, H={h}] (or [P, K, Z/f, f*H]), got {k_pages.shape}")
    if k_pages.dtype not in _DTYPES:
        raise ValueError(f"cache pages must be float32 or bfloat16, got {k_pages.dtype}")
    if k_pages.shape[0] < 1 or k_pages.shape[2] < 1:
        raise ValueError(f"the pool needs at least one page of at least one slot, got {k_pages.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B={b}, pages_per_seq >= 1], got {page_table.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B={b}], got {lengths.shape}")
    if page_table.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError(f"page_table and lengths must be int32, got {page_table.dtype}, {lengths.dtype}")
    if not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python number, got {sm_scale!r}")
    if pages_per_block is not None and (not isinstance(pages_per_block, int) or pages_per_block < 1):
        raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")


def ref_tree_attention(q,  # [B, T, N, H]
                       k,  # [B, T, K, H]
                       v,  # [B, T, K, H]
                       mask,  # bool[B, T, T]
                       k_pages,  # [P, K, Z, H]
                       v_pages,  # [P, K, Z, H]
                       page_table,  # i32[B, pps]
                       lengths,  # i32[B]
                       *, sm_scale: float, layer=None):
    """Plain-jnp reference: gather the prefix, repeat kv heads, one masked softmax over [prefix | tree] keys.

    Slots at positions >= lengths[b] (and pages the table does not reach) may hold anything, NaN included.
    With ``layer``, the pools are stacked [L, P, K, Z, H] and layer ``layer`` is read.
    """
    validate_inputs(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=sm_scale, layer=layer)
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    b, t, n, _ = q.shape
    g = n // k.shape[2]
    k_cache, v_cache = gather_layer(k_pages, v_pages, page_table, q.shape[-1])  # [B, S, K, H]
    s = k_cache.shape[1]
    seen = jnp.arange(s)[None, :] < lengths[:, None]  # bool[B, S]
    keys = jnp.concatenate([k_cache.astype(q.dtype), k], axis=1)  # [B, S+T, K, H]
    values = jnp.concatenate([jnp.where(seen[:, :, None, None], v_cache, 0).astype(v.dtype), v], axis=1)
    keys, values = jnp.repeat(keys, g, axis=2), jnp.repeat(values, g, axis=2)  # [B, S+T, N, H]
    visible = jnp.concatenate([jnp.broadcast_to(seen[:, None, :], (b, t, s)), mask.astype(bool)], axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, keys, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(visible[:, None], logits, MASK_VALUE)  # [B, N, T, S+T]; where() drops NaN logits
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def pack_tree_mask(mask, padded_t: int):  # bool[B, T, T] -> i32[B, Tp, ceil(Tp / 32)]
    """Bit j % 32 of word j // 32 in row i says query i sees tree key j; padded rows and columns are 0."""
    b, t, _ = mask.shape
    words = _cdiv(padded_t, 32)
    bits = jnp.zeros((b, padded_t, words * 32), jnp.uint32).at[:, :t, :t].set((mask != 0).astype(jnp.uint32))
    bits = bits.reshape(b, padded_t, words, 32) << jnp.arange(32, dtype=jnp.uint32)
    return lax.bitcast_convert_type(bits.sum(-1, dtype=jnp.uint32), jnp.int32)


def _precision(dtype):
    """bf16 operands multiply at the MXU's native precision; a global "highest" (jax_default_matmul_precision)
    asks Mosaic for an fp32 contraction of bf16 vectors, which it rejects on v4. fp32 keeps the global setting."""
    return lax.Precision.DEFAULT if jnp.dtype(dtype).itemsize == 2 else None


def _unpack_tree_mask(words, padded_t: int):  # i32[R, W] -> bool[R, Tp]
    col = lax.broadcasted_iota(jnp.int32, (words.shape[0], padded_t), 1)
    word = words[:, 0:1]
    for w in range(1, words.shape[1]):
        word = jnp.where(col >= 32 * w, words[:, w:w + 1], word)
    return (lax.shift_right_logical(word, col & 31) & 1) == 1


class _PageStream:
    """The double-buffered DMA of one sequence's cache pages, ``pages_per_block`` pages per block: block blk lands in
    buffer slot ``slot`` ([2, K, pages_per_block * R, W], head-major). Pages past the sequence's end are not read."""

    def __init__(self, k_hbm, v_hbm, k_buf, v_buf, sems, table_ref, layer, used_pages, pages_per_block, pages_per_seq):
        self.k_hbm, self.v_hbm, self.k_buf, self.v_buf, self.sems = k_hbm, v_hbm, k_buf, v_buf, sems
        self.table_ref, self.layer, self.used_pages = table_ref, layer, used_pages
        self.pages_per_block, self.pages_per_seq = pages_per_block, pages_per_seq

    def _copies(self, blk, slot):
        """(needed, [k copy, v copy]) for every page of block blk."""
        num_pages, page_rows = self.k_hbm.shape[1], self.k_hbm.shape[3]
        out = []
        for j in range(self.pages_per_block):
            idx = blk * self.pages_per_block + j
            page = jnp.clip(self.table_ref[jnp.minimum(idx, self.pages_per_seq - 1)], 0, num_pages - 1)
            rows = pl.ds(j * page_rows, page_rows)  # the page [K, R, W] lands in rows j*R.. of every head
            out.append((idx < self.used_pages, [
                pltpu.make_async_copy(self.k_hbm.at[self.layer, page], self.k_buf.at[slot, :, rows],
                                      self.sems.at[0, slot]),
                pltpu.make_async_copy(self.v_hbm.at[self.layer, page], self.v_buf.at[slot, :, rows],
                                      self.sems.at[1, slot])]))
        return out

    def _each(self, blk, slot, op):
        for needed, copies in self._copies(blk, slot):
            @pl.when(needed)
            def _():
                for c in copies:
                    op(c)

    def start(self, blk, slot):
        self._each(blk, slot, lambda c: c.start())

    def wait(self, blk, slot):
        self._each(blk, slot, lambda c: c.wait())


class _OnlineSoftmax:
    """Flash-style running (max, sum, numerator) per kv head in fp32 VMEM scratch: m/l lane-broadcast
    [K, rows, 128], the numerator [K, rows, H]."""

    def __init__(self, m_ref, l_ref, acc_ref):
        self.m_ref, self.l_ref, self.acc_ref = m_ref, l_ref, acc_ref

    def fold(self, h, s, values, first: bool):
        """Fold head h's scores s f32[rows, n] (already masked) and their values [n, H] into its running state."""
        rows = s.shape[0]
        m_next = jnp.max(s, axis=1, keepdims=True)  # [rows, 1]
        if not first:
            m_prev = self.m_ref[h][:, :1]
            m_next = jnp.maximum(m_prev, m_next)
        p = jnp.exp(s - m_next)
        pv = jnp.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32,
                     precision=_precision(values.dtype))  # [rows, H]
        l_next = jnp.sum(p, axis=1, keepdims=True)
        if first:
            acc = pv
        else:
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * self.l_ref[h][:, :1] + l_next
            acc = alpha * self.acc_ref[h] + pv
        self.m_ref[h] = jnp.broadcast_to(m_next, (rows, _LANES))
        self.l_ref[h] = jnp.broadcast_to(l_next, (rows, _LANES))
        self.acc_ref[h] = acc

    def write(self, o_ref):
        for h in range(o_ref.shape[0]):
            o_ref[h] = (self.acc_ref[h] / self.l_ref[h][:, :1]).astype(o_ref.dtype)


def _head_scores(q_ref, h, keys, sm_scale: float):  # keys [n, H] -> f32[G*Tq, n]
    qh = q_ref[h]
    s = lax.dot_general(qh, keys.astype(qh.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=_precision(qh.dtype))
    return s * sm_scale


def _tree_attention_kernel(
        layer_ref,  # i32[1]  the layer of the stacked pools to read (SMEM, scalar prefetch)
        lengths_ref,  # i32[B]  (SMEM, scalar prefetch)
        q_ref,  # [K, G*Tq, H]  one tile of this sequence's queries (Tq of its Tp tokens), grouped by kv head
        k_new_ref,  # [K, Tp, H]  every new token's key: a tile's queries see any of them
        v_new_ref,  # [K, Tp, H]
        mask_ref,  # i32[Tq, W]  the tile's rows of the bit-packed tree mask
        k_hbm,  # [L, P, K, R, W]  key pool of every layer (HBM, read in place): R = Z / f rows of W = f * H lanes
        v_hbm,  # [L, P, K, R, W]  value pool
        page_table_hbm,  # i32[B, pps]  (HBM: the whole table can exceed SMEM at long contexts)
        o_ref,  # [K, G*Tq, H]
        k_buf,  # [2, K, pages_per_block * R, W] VMEM double buffer, head-major
        v_buf,
        sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
        table_ref,  # i32[pps]  this sequence's row of the page table (SMEM)
        table_sem,  # its DMA semaphore
        m_ref,  # f32[K, G*Tq, 128]  running max (lane-broadcast)
        l_ref,  # f32[K, G*Tq, 128]  running sum
        acc_ref,  # f32[K, G*Tq, H]  running numerator
        *, sm_scale: float, pages_per_block: int, pages_per_seq: int):
    b = pl.program_id(0)
    num_kv, page_rows, lanes = k_hbm.shape[2:]
    head_dim = q_ref.shape[2]
    pack = lanes // head_dim  # slots per pool row (1: unpacked)
    page_size = page_rows * pack
    block_rows = pages_per_block * page_rows
    block_tokens = pages_per_block * page_size
    padded_t = k_new_ref.shape[1]
    groups = q_ref.shape[1] // mask_ref.shape[0]
    # Clamp what the tables say so that a bad entry can never move a DMA out of the pool.
    length = jnp.clip(lengths_ref[b], 0, pages_per_seq * page_size)
    table_copy = pltpu.make_async_copy(page_table_hbm.at[b], table_ref, table_sem)
    table_copy.start()  # one row per sequence: SMEM holds 32 slots x 8k pages of a 128k context only row by row
    table_copy.wait()
    num_blocks = _cdiv(length, block_tokens)
    stream = _PageStream(k_hbm, v_hbm, k_buf, v_buf, sems, table_ref, jnp.clip(layer_ref[0], 0, k_hbm.shape[0] - 1),
                         _cdiv(length, page_size), pages_per_block, pages_per_seq)
    state = _OnlineSoftmax(m_ref, l_ref, acc_ref)

    @pl.when(num_blocks > 0)
    def _():
        stream.start(0, 0)

    # The tree block first (it initialises the state) while the first page block streams in.
    words = mask_ref[...]  # i32[Tq, W]; query row g*Tq + t of a head group uses the tile's tree row t
    tree_visible = _unpack_tree_mask(jnp.concatenate([words] * groups, axis=0) if groups > 1 else words, padded_t)
    for h in range(num_kv):
        s = jnp.where(tree_visible, _head_scores(q_ref, h, k_new_ref[h], sm_scale), MASK_VALUE)
        state.fold(h, s, v_new_ref[h], first=True)

    def page_block(blk, carry):
        slot = lax.rem(blk, 2)

        @pl.when(blk + 1 < num_blocks)
        def _():
            stream.start(blk + 1, 1 - slot)

        stream.wait(blk, slot)
        # Slots past the committed length may hold anything (NaN): mask their scores and zero their values. Row r of
        # the block holds slots pack*r .. pack*r + pack-1, lane group j the slot pack*r + j.
        key_pos = blk * block_tokens + pack * lax.broadcasted_iota(jnp.int32, (1, block_rows), 1)
        value_pos = blk * block_tokens + pack * lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        for h in range(num_kv):
            for j in range(pack):
                lanes_j = pl.ds(j * head_dim, head_dim)
                s = jnp.where(key_pos + j < length, _head_scores(q_ref, h, k_buf[slot, h, :, lanes_j], sm_scale),
                              MASK_VALUE)
                values = jnp.where(value_pos + j < length, v_buf[slot, h, :, lanes_j].astype(jnp.float32), 0.0)
                state.fold(h, s, values.astype(v_new_ref.dtype), first=False)
        return carry

    lax.fori_loop(0, num_blocks, page_block, 0)
    state.write(o_ref)


# A grid step keeps one tile of a sequence's queries ([N, Tq, H]) in VMEM, with the scores and accumulators they
# need: measured with `python -m specjax.preflight` on v5e and v4 (2026-11-23), blocks of 512 KiB (Llama-8B heads per
# chip at T=256) and 576 KiB (SmolLM2, fp32, T=256) compile, blocks of 1 MiB and more (the same at T=512) exceed the
# scoped VMEM. Longer spans (prefill chunks) are cut into tiles of at most this many bytes of queries.
MAX_QUERY_BLOCK_BYTES = 640 * 1024
# The tile's fp32 scores against the new tokens, [Tq, Tp] per query head, also bound it, whatever the dtype:
# measured with tests/test_preflight_serve.py's shapes (2026-12-02), SmolLM2's heads in bf16 (9 x 64) compile at
# T=384 untiled (5.1 MiB of such scores) and exceed the scoped VMEM at T=448 on v4 (6.9 MiB) and at T=512 on v5e
# (9 MiB); 4 heads at T=512 (4 MiB) compile on both.
MAX_TREE_SCORE_BYTES = 6 * 2**20
# Every tile of a sequence sees all its new tokens' keys and values, [K, Tp, H] each, double-buffered: counted so
# (4 blocks), 9 MiB of them compile on v4 (16 MiB of VMEM, the least of the generations; 512 fp32 tokens of 9 kv
# heads x 128 beside 16-page blocks) and 10 MiB do not (2026-12-05, tests/test_preflight_serve.py).
MAX_NEW_KV_BYTES = 9 * 2**20


def query_tile(num_heads: int, head_dim: int, dtype, tree_tokens: int) -> int | None:
    """Query rows per grid step for ``tree_tokens`` query tokens of ``num_heads`` heads: all of them (rounded up to
    the dtype's sublane tile) when their queries and scores fit the VMEM bounds above, else an even split into the
    fewest tiles that fit (each a multiple of the sublane tile; the queries are padded to whole tiles); None if not
    even one sublane tile of queries fits."""
    dt = jnp.dtype(dtype)
    sub = sublane_rows(dt)
    fits = lambda tile: (num_heads * tile * head_dim * dt.itemsize <= MAX_QUERY_BLOCK_BYTES
                         and num_heads * tile * _round_up(tree_tokens, tile) * 4 <= MAX_TREE_SCORE_BYTES)
    tiles = 1
    while True:
        tile = _round_up(_cdiv(tree_tokens, tiles), sub)
        if fits(tile):
            return tile
        if tile == sub:
            return None
        tiles += 1


def tpu_unsupported_reason(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
                           tree_tokens: int = 1) -> str | None:
    """Why the kernel cannot be compiled for a TPU at these shapes (Mosaic's tiling rules, scoped VMEM), or None if
    it can. ``tree_tokens``: the query tokens per sequence (a tree, or a prefill chunk), cut into query tiles that
    fit the VMEM bounds (``query_tile``).
    The matrix of tests/test_preflight.py compiles every supported kind of shape for v4, v5e, v5p and v6e."""
    dt = jnp.dtype(dtype)
    if dt not in _DTYPES:
        return f"dtype {dt.name} (the kernel takes float32 or bfloat16)"
    if head_dim % 64:
        return f"head_dim {head_dim} (the kernel needs a multiple of 64 lanes)"
    sublanes = sublane_rows(dt)
    if page_size % sublanes:
        return f"page size {page_size} with {dt.name} pages (needs a multiple of {sublanes})"
    tile = query_tile(num_heads, head_dim, dt, tree_tokens)
    if tile is None:
        return (f"{tree_tokens} query tokens x {num_heads} heads x {head_dim}: not even {sublanes} query rows fit "
                f"the VMEM bounds ({MAX_QUERY_BLOCK_BYTES >> 10} KiB of queries, {MAX_TREE_SCORE_BYTES >> 20} MiB "
                f"of fp32 scores against the new tokens)")
    new_kv = 4 * num_kv_heads * _round_up(tree_tokens, tile) * head_dim * dt.itemsize
    if new_kv > MAX_NEW_KV_BYTES:
        return (f"{tree_tokens} new tokens x {num_kv_heads} kv heads x {head_dim} ({new_kv >> 10} KiB of new keys "
                f"and values per sequence in VMEM, double-buffered; at most {MAX_NEW_KV_BYTES >> 10} KiB)")
    return None


def _pages_per_block(requested: int | None, page_size: int, pages_per_seq: int) -> int:
    return min(requested or max(1, _TARGET_BLOCK_TOKENS // page_size), pages_per_seq)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "pages_per_block", "query_tile_rows"))
def tree_attention(q,  # [B, T, N, H]  queries of the tree tokens (RoPE applied)
                   k,  # [B, T, K, H]  keys of the tree tokens
                   v,  # [B, T, K, H]  values of the tree tokens
                   mask,  # bool[B, T, T]  query i sees tree key j (ancestors and itself)
                   k_pages,  # [P, K, Z, H] one layer's key pool, or [L, P, K, Z, H] every layer's (with layer)
                   v_pages,  # the value pool, shaped as k_pages
                   page_table,  # i32[B, pps]  pool page of each logical page
                   lengths,  # i32[B]  committed prefix length: positions < lengths[b] are visible
                   *, sm_scale: float, interpret: bool = False, pages_per_block: int | None = None, layer=None,
                   query_tile_rows: int | None = None):
    """Attention of the T tree tokens over (paged committed prefix) + (tree tokens under mask). Returns [B, T, N, H].

    ``layer`` (an int or a traced i32 scalar) with stacked pools: the kernel reads that layer's pages straight from
    the stacked pool, which a model's layer loop passes whole. (Passing ``pool[layer]`` instead makes XLA
    materialise a copy of the layer's pool for the custom call on every step: the whole pool's bytes, per step.)

    Same math as ``ref_tree_attention`` (and ``layers.attention`` over ``gather_layer``). ``interpret=True`` runs the
    kernel in Pallas' interpreter (any backend; the CPU tests). ``pages_per_block`` pages are fetched per DMA block
    (default: about 256 tokens). ``query_tile_rows``: query tokens per grid step, a multiple of the dtype's sublane
    tile (default: ``query_tile``, all of them when they fit the VMEM bounds); each tile streams the prefix pages
    again. Entries of ``lengths`` are clamped to the table's capacity and page indices to the pool, so a bad table
    gives wrong numbers, never an out-of-bounds DMA.
    """
    validate_inputs(q, k, v, mask, k_pages, v_pages, page_table, lengths, sm_scale=sm_scale,
                    pages_per_block=pages_per_block, layer=layer)
    if layer is None:  # one layer's pool: a leading axis of 1 is a free reshape
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    z = page_size_of(k_pages, h)  # slots per page (lane-packed pools: rows x slots per row)
    page_rows, lanes = k_pages.shape[3:]
    pps = page_table.shape[1]
    pb = _pages_per_block(pages_per_block, z, pps)
    tq = _tile_rows(query_tile_rows, n, h, q.dtype, t)
    # Pad T to whole query tiles (each a multiple of the sublane tiling of q's dtype: 8 rows for 32-bit, 16 for 16-bit)
    # so every block is tile aligned; the queries of tile j are [K, G*Tq, H] (row g*Tq + t: head g of the group).
    tp = _round_up(t, tq)
    nt = tp // tq
    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    qg = jnp.pad(q, pad).reshape(b, nt, tq, kh, g, h).transpose(0, 1, 3, 4, 2, 5).reshape(b, nt, kh, g * tq, h)
    k_new = jnp.pad(k, pad).transpose(0, 2, 1, 3)  # [B, K, Tp, H]
    v_new = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    mask_bits = pack_tree_mask(mask, tp)  # i32[B, Tp, W]
    words = mask_bits.shape[2]

    vmem_limit = _vmem_limit(pb * z, kh, g, tq, tp, h, k_pages.dtype, q.dtype)
    buf_shape = (2, kh, pb * page_rows, lanes)
    kernel = functools.partial(_tree_attention_kernel, sm_scale=float(sm_scale), pages_per_block=pb,
                               pages_per_seq=pps)
    tile_spec = pl.BlockSpec((None, None, kh, g * tq, h), lambda i, j, *_: (i, j, 0, 0, 0))
    seq_spec = pl.BlockSpec((None, kh, tp, h), lambda i, j, *_: (i, 0, 0, 0))  # the same block for every tile
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, nt),
            in_specs=[tile_spec, seq_spec, seq_spec, pl.BlockSpec((None, tq, words), lambda i, j, *_: (i, j, 0)),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM(buf_shape, k_pages.dtype),
                pltpu.VMEM(buf_shape, v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SMEM((pps,), jnp.int32),
                pltpu.SemaphoreType.DMA(()),
                pltpu.VMEM((kh, g * tq, _LANES), jnp.float32),
                pltpu.VMEM((kh, g * tq, _LANES), jnp.float32),
                pltpu.VMEM((kh, g * tq, h), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct((b, nt, kh, g * tq, h), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="tree_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths, qg, k_new, v_new, mask_bits, k_pages, v_pages,
      page_table)
    out = out.reshape(b, nt, kh, g, tq, h).transpose(0, 1, 4, 2, 3, 5)  # [B, nT, Tq, K, G, H]
    return out.reshape(b, tp, n, h)[:, :t]


def _vmem_limit(block_tokens: int, kh: int, g: int, tq: int, tp: int, h: int, page_dtype, q_dtype) -> int | None:
    """The scoped VMEM to ask for (None: the default) for the page double buffers, the pipelined q/out tiles and new
    k/v blocks (2 buffers each), and the fp32 state."""
    vmem = (4 * block_tokens * kh * h * jnp.dtype(page_dtype).itemsize
            + 4 * kh * (g * tq + tp) * h * jnp.dtype(q_dtype).itemsize + kh * g * tq * (2 * _LANES + h) * 4)
    return int(vmem * 1.25) + 2**20 if vmem > 12 * 2**20 else None  # above the smallest default scoped limit


def _tile_rows(requested: int | None, num_heads: int, head_dim: int, dtype, t: int) -> int:
    sub = sublane_rows(dtype)
    if requested is not None:
        if not isinstance(requested, int) or requested < 1 or requested % sub:
            raise ValueError(f"query_tile_rows must be a positive multiple of {sub} for {jnp.dtype(dtype).name} "
                             f"queries, got {requested!r}")
        return requested
    # Shapes no tile fits (tpu_unsupported_reason) take the XLA path on a TPU; interpreted, one tile serves.
    return query_tile(num_heads, head_dim, dtype, t) or _round_up(t, sub)
