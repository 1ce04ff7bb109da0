"""The target model, one forward for every family (Llama, Mistral, Qwen2/2.5, Qwen3): pure functions over params.

``forward`` serves every use:
- training (frozen target): no cache, full sequence, logits at every position and the EAGLE3 aux features;
- prefill / decode: attends over the paged cache prefix plus the new tokens under a causal mask, returns the new
  tokens' K/V for the caller to write (``kv_cache.write``);
- tree verification: the same call with the tree's ancestor mask instead of the causal one; the caller writes only
  the accepted path's K/V.
Two layouts of the layer weights, one math:
- stacked (``TargetParams.layers`` is one LayerParams with a leading L axis): layers run under one ``lax.scan``
  (training, checkpoints, sharding specs; a trainer on a CPU holds half-precision stacks as bits, ``stacked_bits``).
  XLA copies each layer's matrices out of the stack on every scan step (a dynamic-slice fusion feeds each dot), which
  is free next to a long sequence but doubles the bytes a bandwidth-bound decode step moves;
- unstacked (a tuple of per-layer LayerParams, ``unstack_layers``): the layers are unrolled and every dot reads its
  weight buffer in place. Decode paths (generation, the server, the speculative engine) use this layout; on a CPU
  its fp32 matrices are held packed for specjax's kernels (``cpu_dense.PackedWeight``: read as one stream).
Attention is ``layers.attend``: over the paged cache it reads the cache in blocks of pages, only as many blocks as the
longest sequence holds (``layers.paged_attention``), so a step's KV read follows the tokens in use, not the page
table's capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache, layers
from specjax.kernels import cpu_dense
from specjax.models import random_params
from specjax.config import ModelConfig, default_aux_layer_ids
from specjax.kv_cache import KVCache
from specjax.sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """One decoder layer; in TargetParams every field carries a leading L (layers) axis."""
    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    wo: jax.Array  # [N, H, D]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]
    bq: jax.Array | None = None  # [N, H]  Qwen2
    bk: jax.Array | None = None  # [K, H]
    bv: jax.Array | None = None  # [K, H]
    q_norm: jax.Array | None = None  # [H]  Qwen3
    k_norm: jax.Array | None = None  # [H]
    # The fused decode layout (``unstack_layers`` on one device): q/k/v in one matrix, wq/wk/wv then None.
    w_qkv: jax.Array | None = None  # [D, K, G + 2, H]: per kv head its G query heads, its key, its value
    # ... and gate/up in one matrix: w_gate/w_up then None.
    w_gate_up: jax.Array | None = None  # [D, 2, F]: gate, then up


# A layer's matrices and how many of their leading axes a product contracts (``pack_layer``; a draft head's too,
# ``draft.pack_head``).
LAYER_MATRICES = {"wq": 1, "wk": 1, "wv": 1, "w_qkv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_gate_up": 1, "w_down": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetParams:
    embed: jax.Array  # [V, D]
    layers: LayerParams | tuple[LayerParams, ...]  # stacked [L, ...], or one LayerParams per layer (unstack_layers)
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to embed
    # The decode layout of a bf16/f16 table on a CPU: its bytes as uint16 (``embed_bits``), gathered by
    # ``embed_tokens``; None elsewhere.
    embed_bits: jax.Array | None = None
    # The decode layout's tied lm_head on a CPU: the table as the panels of [D, V] (``pack_logits``), a copy beside the
    # table (which the embedding's row lookups read); None elsewhere.
    embed_panels: cpu_dense.PackedWeight | None = None


# Logical axes of every parameter (without the leading "layers" axis of stacked layer params).
LAYER_AXES = {
    "attn_norm": ("embed",), "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"), "mlp_norm": ("embed",),
    "w_gate": ("embed", "ffw"), "w_up": ("embed", "ffw"), "w_down": ("ffw", "embed"),
    "bq": ("heads", "head_dim"), "bk": ("kv_heads", "head_dim"), "bv": ("kv_heads", "head_dim"),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_qkv": ("embed", "kv_heads", None, "head_dim"), "w_gate_up": ("embed", None, "ffw"),
}
TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab")}


def param_shapes(cfg: ModelConfig) -> TargetParams:
    """Shape/dtype skeleton of the params (``jax.ShapeDtypeStruct`` leaves), without allocating."""
    dt = jnp.dtype(cfg.dtype)
    d, f, v, n, k, h, nl = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    lp = LayerParams(
        attn_norm=s(nl, d), wq=s(nl, d, n, h), wk=s(nl, d, k, h), wv=s(nl, d, k, h), wo=s(nl, n, h, d),
        mlp_norm=s(nl, d), w_gate=s(nl, d, f), w_up=s(nl, d, f), w_down=s(nl, f, d),
        bq=s(nl, n, h) if cfg.qkv_bias else None, bk=s(nl, k, h) if cfg.qkv_bias else None,
        bv=s(nl, k, h) if cfg.qkv_bias else None,
        q_norm=s(nl, h) if cfg.qk_norm else None, k_norm=s(nl, h) if cfg.qk_norm else None)
    return TargetParams(embed=s(v, d), layers=lp, final_norm=s(d),
                        lm_head=None if cfg.tie_word_embeddings else s(d, v))


def param_logical_axes(cfg: ModelConfig) -> TargetParams:
    """Same tree as ``param_shapes`` with tuples of logical axis names as leaves."""
    shapes = param_shapes(cfg)
    lp = LayerParams(**{f.name: (("layers",) + LAYER_AXES[f.name]) if getattr(shapes.layers, f.name) is not None
                        else None for f in dataclasses.fields(LayerParams)})
    return TargetParams(embed=TOP_AXES["embed"], layers=lp, final_norm=TOP_AXES["final_norm"],
                        lm_head=TOP_AXES["lm_head"] if shapes.lm_head is not None else None)


def is_unstacked(params: TargetParams) -> bool:
    return isinstance(params.layers, (tuple, list))


def unstack_layers(params: TargetParams, fuse: bool | None = None) -> TargetParams:
    """The decode layout: one LayerParams per layer (each its own buffers), so an unrolled forward reads every weight
    in place instead of copying it out of the stack. Call it once where params are loaded or held (it copies every
    layer once); already-unstacked params are returned as they are. Works inside jit and on sharded arrays.

    ``fuse`` (default: when every weight lives on one device) also merges each layer's q/k/v projections into one
    matrix (``fuse_layer``), as SGLang's and vLLM's fused QKV linear: a decode step runs one product where it ran
    three, and XLA:CPU's products over small matrices (k and v are 0.4 MB each at SmolLM2's shape) stream far below
    the bandwidth of larger ones. Sharded params (tensor parallelism) keep the separate projections, whose head axes
    carry their shardings."""
    if is_unstacked(params):
        return params
    n = params.layers.wq.shape[0]
    return decode_layout(params, [jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(n)], fuse)


def decode_layout(params: TargetParams, layers: Sequence[LayerParams], fuse: bool | None = None) -> TargetParams:
    """``params`` in the decode layout with ``layers`` (one LayerParams per layer, in order) as its layers: what
    ``unstack_layers`` returns, for callers that hold the layers apart already (``weights.load_target_params``
    reads them so, without a stacked copy). ``fuse`` as ``unstack_layers``."""
    if fuse is None:
        fuse = _on_one_device(layers)
    pack = fuse and _all_on_cpu(layers)
    layers = tuple(fuse_layer(lp) if fuse else lp for lp in layers)
    out = dataclasses.replace(params, layers=tuple(pack_layer(lp) for lp in layers) if pack else layers,
                              embed_bits=embed_bits(params.embed))
    return pack_logits(out) if pack else out


def stack_layers(params: TargetParams) -> TargetParams:
    """Inverse of ``unstack_layers`` (the training / checkpoint layout)."""
    if not is_unstacked(params):
        return params
    lm_head = params.lm_head.unpack() if isinstance(params.lm_head, cpu_dense.PackedWeight) else params.lm_head
    return dataclasses.replace(params, embed_bits=None, embed_panels=None, lm_head=lm_head, layers=jax.tree.map(
        lambda *a: jnp.stack(a), *(unfuse_layer(unpack_layer(lp)) for lp in params.layers)))


def fuse_layer(lp: LayerParams) -> LayerParams:
    """One layer's fused q/k/v projection ``w_qkv`` [D, K, G + 2, H] (per kv head its G query heads, then its key
    and value: query head n = kv * G + g, as grouped-query attention pairs them) and fused gate/up projection
    ``w_gate_up`` [D, 2, F]; wq/wk/wv, w_gate and w_up become None. Same arithmetic per output as the separate
    products, one product where there were three and two. (Gate/up fused into XLA's own products measured no faster
    at batch 1 and 2% slower at batch 8, fourteenth session; against the CPU kernels' panels it saves a call per
    layer, 1.02x at batch 1 in bf16, forty-fifth session.)"""
    if lp.w_qkv is None:
        d, n, h = lp.wq.shape
        k = lp.wk.shape[1]
        w_qkv = jnp.concatenate([lp.wq.reshape(d, k, n // k, h), lp.wk[:, :, None], lp.wv[:, :, None]], axis=2)
        lp = dataclasses.replace(lp, wq=None, wk=None, wv=None, w_qkv=w_qkv)
    if lp.w_gate_up is None:
        lp = dataclasses.replace(lp, w_gate=None, w_up=None, w_gate_up=jnp.stack([lp.w_gate, lp.w_up], axis=1))
    return lp


def pack_layer(lp: LayerParams) -> LayerParams:
    """One layer's fp32 matrices as ``cpu_dense.PackedWeight`` where the CPU kernels take them
    (``cpu_dense.packable``; the others as they are): the SmolLM2 decode step's products read as one stream per
    thread (docs/benchmarks.md, forty-third session). Same bits."""
    def one(name):
        a = getattr(lp, name)
        return cpu_dense.pack(a, LAYER_MATRICES[name]) if cpu_dense.packable(a, LAYER_MATRICES[name]) else a
    return dataclasses.replace(lp, **{f: one(f) for f in LAYER_MATRICES})


def pack_logits(params: TargetParams) -> TargetParams:
    """The logits' matrix as panels where the CPU kernels take it (``cpu_dense.packable``): an untied lm_head packed
    in place, a tied table's panels held beside it (``embed_panels``). Same bits as a packed layer matrix; where the
    table was read in tiles of rows (``layers.unembed``), one stream per thread at any batch: SmolLM2's bf16 decode
    step 1.08x faster at batch 1 and 1.26x at batch 8 on two threads (docs/benchmarks.md, forty-fifth session)."""
    if params.lm_head is not None:
        packed = cpu_dense.packable(params.lm_head)
        return dataclasses.replace(params, lm_head=cpu_dense.pack(params.lm_head)) if packed else params
    return dataclasses.replace(params, embed_panels=cpu_dense.pack_table(params.embed))


def unpack_layer(lp: LayerParams) -> LayerParams:
    """Inverse of ``pack_layer``."""
    def one(name):
        a = getattr(lp, name)
        return a.unpack() if isinstance(a, cpu_dense.PackedWeight) else a
    return dataclasses.replace(lp, **{f: one(f) for f in LAYER_MATRICES})


def unfuse_layer(lp: LayerParams) -> LayerParams:
    """Inverse of ``fuse_layer``."""
    if lp.w_qkv is not None:
        d, k, g2, h = lp.w_qkv.shape
        lp = dataclasses.replace(lp, wq=lp.w_qkv[:, :, :g2 - 2].reshape(d, k * (g2 - 2), h), wk=lp.w_qkv[:, :, -2],
                                 wv=lp.w_qkv[:, :, -1], w_qkv=None)
    if lp.w_gate_up is not None:
        lp = dataclasses.replace(lp, w_gate=lp.w_gate_up[:, 0], w_up=lp.w_gate_up[:, 1], w_gate_up=None)
    return lp


def embed_bits(embed) -> jax.Array | None:
    """A bf16/f16 embedding table held by one CPU device as uint16, sharing the table's memory where jax allows (a
    numpy view of the buffer, placed without a copy). XLA:CPU gathers half-precision rows from an f32 copy of the
    whole table, and a gather from bits bitcast inside the program still copies the table on every iteration of a
    loop (the plain and speculative generation loops, the draft tree's steps: 57 MB per lookup for SmolLM2); from
    these bits it reads the rows alone. None for other dtypes, devices and tracers."""
    if embed.dtype not in kv_cache.HALF_DTYPES or not (_on_one_device(embed) and _all_on_cpu(embed)):
        return None
    # as committed as the table: a committed leaf would commit every output of the programs it enters
    return jax.device_put(np.asarray(embed).view(np.uint16), embed.sharding if embed.committed else None)


def stacked_bits(params: TargetParams, cfg: ModelConfig) -> TargetParams:
    """The stacked layout as a CPU's layer scan reads it fastest: bf16/f16 layer stacks held as their uint16 bits
    (``forward`` bitcasts each layer's slice back to ``cfg.dtype`` inside the scan). XLA:CPU converts a half-precision
    stack that a scan slices to f32 whole on every call and each layer's slice back: about 110 ms of a bf16 SmolLM2
    forward over 2 x 256 tokens, and a bitcast inside the program still copies the stack (docs/benchmarks.md,
    thirty-seventh and thirty-eighth sessions). Call it once where the frozen target is held for training. Params on
    other platforms (a TPU program has no such round trip), unstacked params and leaves of another dtype than
    ``cfg.dtype`` are returned as they are; the bits keep each leaf's sharding."""
    dtype = jnp.dtype(cfg.dtype)
    if is_unstacked(params) or dtype not in kv_cache.HALF_DTYPES or not _all_on_cpu(params.layers):
        return params
    to_bits = lambda w: jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == dtype else w
    shardings = jax.tree.map(lambda w: w.sharding, params.layers)
    bits = jax.jit(lambda t: jax.tree.map(to_bits, t), out_shardings=shardings)(params.layers)
    return dataclasses.replace(params, layers=bits)


def _from_bits(lp: LayerParams, dtype) -> LayerParams:
    """One layer's weights with ``stacked_bits``'s uint16 leaves read as ``dtype`` again (a bitcast)."""
    return jax.tree.map(lambda w: jax.lax.bitcast_convert_type(w, dtype) if w.dtype == jnp.uint16 else w, lp)


def _placed(tree, where: Callable[[set], bool]) -> bool:
    """Every leaf a concrete array whose device set satisfies ``where``."""
    return all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and where(a.sharding.device_set)
               for a in jax.tree.leaves(tree))


def on_one_cpu(tree) -> bool:
    """Every leaf a concrete array held by one CPU device (where the decode layout packs matrices)."""
    return _on_one_device(tree) and _all_on_cpu(tree)


def _all_on_cpu(tree) -> bool:
    return _placed(tree, lambda devices: all(d.platform == "cpu" for d in devices))


def _on_one_device(tree) -> bool:
    return _placed(tree, lambda devices: len(devices) == 1)


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> TargetParams:
    """Random params (benchmarks and tests); norms start at 1."""
    return random_params(param_shapes(cfg), key, scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOut:
    logits: jax.Array | None  # f32[B, M, V] at ``logits_at`` (or [B, T, V] for all positions)
    aux: jax.Array | None  # [B, T, 3*D] outputs of the aux layers, concatenated in order
    hidden: jax.Array | None  # [B, T, D] final hidden state after the final norm (input of lm_head)
    k_new: jax.Array | None  # [L, B, T, K, H] keys of the new tokens (to be written into the cache)
    v_new: jax.Array | None  # [L, B, T, K, H]
    cache: KVCache | None = None  # with ``write_valid``: the cache holding the new tokens' K/V (lengths unchanged)


AttentionFn = Callable[..., jax.Array]


def embed_tokens(params: TargetParams, tokens):
    if params.embed_bits is not None:
        return jax.lax.bitcast_convert_type(jnp.take(params.embed_bits, tokens, axis=0), params.embed.dtype)
    return kv_cache.on_bits(lambda table: jnp.take(table, tokens, axis=0), params.embed)  # [B, T, D]


def lm_head_weight(params: TargetParams):
    if isinstance(params.lm_head, cpu_dense.PackedWeight):
        return params.lm_head.unpack()
    return params.embed.T if params.lm_head is None else params.lm_head  # [D, V]


def compute_logits(params: TargetParams, hidden):
    """f32 logits of final-normed hidden states [..., D] -> [..., V]."""
    head = params.embed_panels if params.lm_head is None else params.lm_head
    if head is None:
        # Contract against embed [V, D] as stored: ``embed.T`` made XLA:CPU copy the whole table on every step.
        return layers.unembed(hidden, params.embed)
    return layers.dense(hidden, head, preferred_element_type=jnp.float32)


def forward(params: TargetParams, cfg: ModelConfig, tokens, positions, *, cache: KVCache | None = None,
            mask=None, valid=None, aux_layers: tuple[int, ...] | None = None, logits_at=None,
            return_logits: bool = True, return_hidden: bool = False, return_kv: bool | None = None,
            cache_attention: AttentionFn | None = None, write_valid=None, keys_in_pool: bool = False) -> ForwardOut:
    """Run the decoder over new tokens.

    tokens, positions: i32[B, T]. valid: bool[B, T] real tokens (default all). mask: bool[B, T, T] which new keys
    each new query sees (default causal & valid; only with the default do long prompts skip the keys a causal mask
    hides, ``layers.query_chunks``). With ``cache``, queries also see cached positions
    ``< cache.lengths[b]`` (and, for sliding-window models, within the window).
    aux_layers: layer ids whose OUTPUTS are returned concatenated as ``aux`` (None: no aux; () : default ids).
    logits_at: i32[B, M] indices into T where logits are wanted (default: every position).
    cache_attention: replaces the XLA cache attention, e.g. the Pallas tree-attention kernel on TPU. Contract:
      ``fn(q [B,T,N,H], k [B,T,K,H], v, mask bool[B,T,T], k_pages [P,Z,K,H], v_pages, page_table i32[B,pps],
      lengths i32[B], sm_scale) -> [B,T,N,H]``: queries see cached positions < lengths[b] plus new keys under mask.
    write_valid: bool[B, T] with ``cache``: each layer writes the K/V of these tokens at ``positions`` into the pool
      before its attention reads the pool (``ForwardOut.cache``; lengths are the caller's to advance). Every read
      then follows the scatter, so a donated pool is written in place (``kv_cache.write``).
    keys_in_pool: with ``write_valid``, the caller promises that new token j sits at position lengths[b] + j and is
      written wherever ``mask`` lets a query see it (a decode step, a verified chain): attention then reads every key
      from the pool, so each query's result is the same bits as a one-token decode step at its position
      (``layers.paged_attention``).
    params: stacked layers run under ``lax.scan`` (as they are or as ``stacked_bits``); unstacked ones
    (``unstack_layers``) run unrolled. Same outputs.
    """
    b, t = tokens.shape
    if valid is None:
        valid = jnp.ones((b, t), bool)
    causal = mask is None
    if causal:
        mask = layers.causal_mask(valid)
    if cfg.sliding_window is not None:
        mask = mask & ((positions[:, :, None] - positions[:, None, :]) < cfg.sliding_window)
    if return_kv is None:
        return_kv = cache is not None
    if aux_layers is not None and len(aux_layers) == 0:
        aux_layers = default_aux_layer_ids(cfg.num_layers)
    if cache_attention is not None and cfg.sliding_window is not None:
        raise ValueError("sliding-window models use the XLA attention path; do not pass cache_attention")
    requested = tuple(aux_layers or ())
    for lid in requested:
        if not 0 <= lid < cfg.num_layers:
            raise ValueError(f"aux layer id {lid} out of range for {cfg.num_layers} layers")

    if write_valid is None and keys_in_pool:
        raise ValueError("keys_in_pool needs write_valid (the new keys are written before they are read)")
    if write_valid is not None and cache is None:
        raise ValueError("write_valid needs a cache")

    unrolled = is_unstacked(params)
    run_layer = _layer_call if unrolled else _layer

    def layer(h, lp, index, cache):
        if not unrolled:
            lp = _from_bits(lp, jnp.dtype(cfg.dtype))  # ``stacked_bits``
        return run_layer(cfg, lp, h, positions, mask, cache, index, cache_attention, write_valid, causal, keys_in_pool)

    x = constrain(embed_tokens(params, tokens).astype(jnp.dtype(cfg.dtype)), ("batch", "seq", "embed"))
    run = _run_unrolled if unrolled else _run_scanned
    h, aux, kv, cache = run(layer, params.layers, x, cache, requested, cfg.num_layers, return_kv)

    hidden = layers.rms_norm(h, params.final_norm, cfg.rms_norm_eps)  # [B, T, D]
    logits = None
    if return_logits:
        hl = hidden if logits_at is None else jnp.take_along_axis(hidden, logits_at[..., None], axis=1)
        logits = compute_logits(params, hl)
        logits = constrain(logits, ("batch", "seq", "vocab"))
    aux_out = None
    if requested:
        aux_out = jnp.moveaxis(aux, 0, 2).reshape(b, t, len(requested) * cfg.hidden_size)  # [B, T, 3*D]
    return ForwardOut(logits=logits, aux=aux_out, hidden=hidden if return_hidden else None,
                      k_new=kv[0] if kv is not None else None, v_new=kv[1] if kv is not None else None,
                      cache=cache if write_valid is not None else None)


def _layer(cfg: ModelConfig, lp: LayerParams, h, positions, mask, cache, index, cache_attention, write_valid,
           causal: bool = False, keys_in_pool: bool = False):
    """Decoder layer ``index`` over h [B, T, D] -> (h, k, v, cache) with k, v [B, T, K, H] the new tokens' keys and
    values (``index`` is traced under the layer scan; the cache pools are read whole, at that layer; with
    ``write_valid`` the layer's K/V are written into them first)."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    sm_scale = cfg.head_dim ** -0.5
    y = layers.rms_norm(h, lp.attn_norm, cfg.rms_norm_eps)
    q, k, v = _qkv(cfg, y, lp, positions, inv_freq)  # [B, T, N, H], [B, T, K, H] x 2, q and k rotated
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    if write_valid is not None:
        cache = kv_cache.write(cache, k, v, positions, write_valid, layer=index)
    kv = (None,) * 4 if cache is None else (cache.k, cache.v, cache.page_table, cache.lengths)
    o = layers.attend(q, k, v, mask, sm_scale, *kv, positions=positions, sliding_window=cfg.sliding_window,
                      kernel=cache_attention, layer=None if cache is None else index, causal=causal,
                      keys_in_pool=keys_in_pool)
    h = layers.out_proj(o, lp.wo, residual=h)  # [B, T, D]
    y = layers.rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
    h = layers.swiglu(y, lp.w_gate, lp.w_up, lp.w_down, w_gate_up=lp.w_gate_up, residual=h)
    return constrain(h, ("batch", "seq", "embed")), k, v, cache


# An unrolled forward calls its layers through one jitted function with the layer index traced: jax traces and
# lowers a layer once per program (not once per layer: 30 traces of SmolLM2's layer were most of a decode program's
# start-up time), and XLA inlines the 30 calls, so the compiled program is the one an unrolled trace gives (its
# weights read in place, the pools written in place; tests/test_decode_layout.py).
_layer_call = jax.jit(_layer, static_argnums=(0, 7, 9, 10))


def _qkv(cfg: ModelConfig, y, lp: LayerParams, positions, inv_freq):
    """q [B, T, N, H], k and v [B, T, K, H] of y [B, T, D], from the separate or the fused projections, with their
    biases and q/k norms, q and k rotated. The fused projection of a model with neither (Llama, SmolLM2) is split and
    rotated by ``layers.rope_qkv`` (one kernel call on a CPU)."""
    if lp.w_qkv is not None and lp.bq is None and lp.q_norm is None:
        return layers.rope_qkv(layers.dense(y, lp.w_qkv), positions, inv_freq)  # qkv [B, T, K, G + 2, H]
    if lp.w_qkv is None:
        q, k, v = layers.dense(y, lp.wq), layers.dense(y, lp.wk), layers.dense(y, lp.wv)
    else:
        qkv = layers.dense(y, lp.w_qkv)
        g = qkv.shape[-2] - 2
        q, k, v = qkv[..., :g, :].reshape(*qkv.shape[:-3], -1, qkv.shape[-1]), qkv[..., g, :], qkv[..., g + 1, :]
    if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    if lp.q_norm is not None:
        q = layers.rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = layers.rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return layers.apply_rope(q, positions, inv_freq), layers.apply_rope(k, positions, inv_freq), v


def _run_unrolled(layer, layer_params, x, cache, requested, num_layers: int, return_kv: bool):
    """Layers one after another (per-layer weights read in place). Returns (h, aux [A, B, T, D] | None, kv, cache)."""
    if len(layer_params) != num_layers:
        raise ValueError(f"params hold {len(layer_params)} layers; the config says {num_layers}")
    h, outs, ks, vs = x, {}, [], []
    for i, lp in enumerate(layer_params):
        h, k, v, cache = layer(h, lp, np.int32(i), cache)  # the index traced: one trace serves every layer
        outs[i] = h
        ks.append(k), vs.append(v)
    aux = jnp.stack([outs[lid] for lid in requested]) if requested else None
    kv = (jnp.stack(ks), jnp.stack(vs)) if return_kv else None
    return h, aux, kv, cache


def _run_scanned(layer, layer_params, x, cache, requested, num_layers: int, return_kv: bool):
    """Layers under one ``lax.scan`` over the stacked weights; aux outputs are captured inside the scan."""
    # Capture each distinct layer once (tiny models' default ids repeat a layer), then gather in requested order.
    unique = sorted(set(requested))
    aux_slot = np.full((num_layers,), -1, np.int32)
    for i, lid in enumerate(unique):
        aux_slot[lid] = i

    def body(carry, xs):
        h, aux, cache = carry  # the cache rides in the carry: layers that write it update it in place
        lp, slot, index = xs
        h, k, v, cache = layer(h, lp, index, cache)
        if aux is not None:
            idx = jnp.maximum(slot, 0)
            upd = jnp.where(slot >= 0, h, aux[idx])
            aux = jax.lax.dynamic_update_index_in_dim(aux, upd, idx, 0)
        return (h, aux, cache), ((k, v) if return_kv else None)

    aux0 = jnp.zeros((len(unique),) + x.shape, x.dtype) if unique else None
    xs = (layer_params, jnp.asarray(aux_slot), jnp.arange(num_layers, dtype=jnp.int32))
    (h, aux, cache), kv = jax.lax.scan(body, (x, aux0, cache), xs)
    if unique and tuple(unique) != requested:
        aux = aux[np.asarray([unique.index(lid) for lid in requested])]  # [len(requested), B, T, D]
    return h, aux, kv, cache
