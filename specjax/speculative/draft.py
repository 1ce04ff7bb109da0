"""One interface over the two draft heads (EAGLE3 and EAGLE-1/2), as the speculative step sees them.

A draft step takes, per position, a token embedding ``emb`` (the target's) and an incoming ``feature``:
- for a committed pair (feature of position t, token t+1): EAGLE3 -> fc(aux_t); EAGLE -> target final hidden at t;
- for a tree node at depth d >= 1: its parent's output ``h`` (EAGLE3 pre-norm hidden / EAGLE predicted feature).
It returns ``h`` (fed to the node's children) and its K/V, and ``logits(h)`` over the draft vocab whose entry i is
target token ``ids[i]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import layers
from specjax.kernels import cpu_dense
from specjax.models import eagle, eagle3, target

ALGORITHMS = ("EAGLE3", "EAGLE")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    params: Any  # eagle3.Eagle3Params | eagle.EagleParams
    ids: jax.Array  # i32[Vd] target token id of each draft-vocab entry
    lm_head: jax.Array | None  # [H, Vd] EAGLE: the target's lm_head (cut to hot ids); None for EAGLE3 (own head)
    cfg: Any = dataclasses.field(metadata=dict(static=True))  # Eagle3Config | EagleConfig
    algorithm: str = dataclasses.field(metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers


# A head's matrices (its layers' as a target layer's, its fc and its draft-vocab lm_head) and how many of their
# leading axes a product contracts (``pack_head``).
_HEAD_MATRICES = {**target.LAYER_MATRICES, "fc": 1, "lm_head": 1}


def pack_head(params):
    """A head's matrices (EAGLE3 or EAGLE) as ``cpu_dense.PackedWeight`` panels where the CPU kernels take them
    (``cpu_dense.packable``), as the target's decode layout holds its own (``target.pack_layer``): a draft step's and
    a target-only step's head products stream one chunk of panels per thread. Same bits. Params that are not
    concrete arrays on one CPU device are returned as they are."""
    if not target.on_one_cpu(params):
        return params

    def pack(obj):
        packed = {}
        for name, c_axes in _HEAD_MATRICES.items():
            a = getattr(obj, name, None)
            if a is not None and cpu_dense.packable(a, c_axes):
                packed[name] = cpu_dense.pack(a, c_axes)
        return dataclasses.replace(obj, **packed)
    return dataclasses.replace(pack(params), layers=type(params.layers)(pack(lp) for lp in params.layers))


def make_draft(algorithm: str, cfg, params, target_params: target.TargetParams, vocab=None) -> Draft:
    """Wrap a head. ``vocab``: EAGLE3 -> eagle3.VocabMap (None: identity); EAGLE -> hot-token ids i32[Vd] (FR-Spec
    token map) or None (full target vocab)."""
    algorithm = algorithm.upper()
    params = pack_head(params)
    if algorithm == "EAGLE3":
        if vocab is None:
            vocab = eagle3.VocabMap.identity(cfg.draft_vocab_size)
        if not isinstance(vocab, eagle3.VocabMap):
            raise TypeError("EAGLE3 needs an eagle3.VocabMap (d2t/t2d); --speculative-token-map is for EAGLE heads")
        vd = cfg.draft_vocab_size
        ids = jnp.arange(vd, dtype=jnp.int32) + jnp.asarray(vocab.d2t, jnp.int32)
        return Draft(params=params, ids=ids, lm_head=None, cfg=cfg, algorithm="EAGLE3")
    if algorithm == "EAGLE":
        hot = None if vocab is None else jnp.asarray(np.asarray(vocab), jnp.int32)
        head = eagle_lm_head(target_params, hot)
        ids = jnp.arange(head.shape[1], dtype=jnp.int32) if hot is None else hot
        return Draft(params=params, ids=ids, lm_head=head, cfg=cfg, algorithm="EAGLE")
    raise ValueError(f"unknown speculative algorithm {algorithm!r}; expected one of {ALGORITHMS}")


def target_kwargs(draft: Draft) -> dict:
    """What the target forward must return for this head."""
    if draft.algorithm == "EAGLE3":
        return dict(aux_layers=tuple(draft.cfg.aux_layer_ids))
    return dict(return_hidden=True)


def raw_features(draft: Draft, out: target.ForwardOut):
    """What the head reads from a target forward: EAGLE3 aux [B, T, 3*Ht]; EAGLE final-normed hidden [B, T, H]."""
    return out.aux if draft.algorithm == "EAGLE3" else out.hidden


def project(draft: Draft, raw):
    """Raw target features -> the head's incoming feature [B, T, H] (EAGLE3: fc; EAGLE: as is)."""
    return eagle3.project_aux(draft.params, raw) if draft.algorithm == "EAGLE3" else raw


def target_features(draft: Draft, out: target.ForwardOut):
    """The per-position feature the head consumes from a target forward: [B, T, H]."""
    return project(draft, raw_features(draft, out))


def forward(draft: Draft, emb, feature, positions, attend: layers.AttendFn, *, kv_only: bool = False):
    """One draft step over T tokens. emb, feature: [B, T, H]; positions i32[B, T]. ``kv_only``: only extend the
    cache (``attend`` a ``layers.CacheAttend`` with ``write``); h is then None.
    Returns (h [B, T, H], k_new [nl, B, T, K, Hd], v_new)."""
    head = eagle3 if draft.algorithm == "EAGLE3" else eagle
    return head.forward(draft.params, draft.cfg, emb, feature, positions, attend, kv_only=kv_only)


def logits(draft: Draft, h):
    """f32 logits over the draft vocab: [..., H] -> [..., Vd]."""
    if draft.algorithm == "EAGLE3":
        return eagle3.draft_logits(draft.params, draft.cfg, h)
    return eagle.draft_logits(draft.lm_head, h)


def draft_head_dims(cfg) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the head's KV cache."""
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim


def eagle_lm_head(target_params: target.TargetParams, hot_ids=None) -> jax.Array:
    """An EAGLE head's vocabulary head: the target's lm_head [D, V] itself, or its columns at ``hot_ids`` (FR-Spec
    hot tokens) [D, Vd]."""
    head = target.lm_head_weight(target_params)
    return head if hot_ids is None else jnp.take(head, jnp.asarray(hot_ids, jnp.int32), axis=1)


def for_prefill(draft: Draft) -> Draft:
    """The head for a prompt's prefill: its matrices stored narrower than it computes
    (``head_weights.stored_matrix_dtype``: bf16 under an fp32 head) widened once, here. A prefill's many-row products
    go to XLA's dot, which widened each of them on every call (5M elements for the SmolLM2 head, ~5% of a 128-token
    prefill); decode-sized products read the narrow copies in place (``layers.dense``), so the steps keep them. The
    same values (widening bf16 to fp32 is exact). What a prefill does not read is left as it is: the draft vocab
    head, and the last layer's q, o and MLP matrices (a prefill only writes that layer's K/V, ``spec_step.prefill``).
    Returns ``draft`` itself when no matrix is narrower."""
    act = jnp.dtype(draft.cfg.dtype)
    widen = lambda a: a.astype(act) if a.ndim >= 2 and a.dtype != act and jnp.issubdtype(a.dtype, jnp.floating) \
        else a
    last = draft.params.layers[-1]
    unread = {id(m) for m in (getattr(draft.params, "lm_head", None), last.wq, last.wo, last.w_gate, last.w_up,
                              last.w_down) if m is not None}  # kept as they are, not widened and put back
    params = jax.tree.map(lambda a: a if id(a) in unread else widen(a), draft.params,
                          is_leaf=lambda a: id(a) in unread)
    if all(x is y for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(draft.params))):
        return draft
    return dataclasses.replace(draft, params=params)


def as_draft(draft, algorithm: str, target_params) -> Draft:
    """``draft`` itself when it is a ``Draft``, else ``make_draft`` over its (cfg, params, vocab map or token map)."""
    if isinstance(draft, Draft):
        return draft
    cfg, params, vocab = draft
    return make_draft(algorithm, cfg, params, target_params, vocab)
