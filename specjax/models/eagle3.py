"""EAGLE3 draft head (HF ``LlamaForCausalLMEagle3``), shared by training (TTT rollout) and serving (cached steps).

One draft step for token embeddings ``e`` and incoming hidden ``h`` ([B, T, H]):
    x = concat(input_layernorm(e), hidden_norm(h));  h = h + o_proj(attn(x));  h = h + mlp(post_norm(h))
    logits = lm_head(norm(h))           (over the draft vocab; target id = i + d2t[i])
The first step's h is fc(concat(aux1, aux2, aux3)); later steps feed back h (before ``norm``).
Extra layers (num_layers > 1, optional) are plain Llama decoder layers over H applied after the midlayer.
The embedding is the target's (never part of the head's params).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import layers
from specjax.models import random_params
from specjax.config import ModelConfig, default_aux_layer_ids, eos_ids, read_json, rope_settings


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """What both draft heads (EAGLE3 here, EAGLE in eagle.py) take from one layer of their target."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the TARGET's vocab
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def rope_scaling_dict(self):
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @staticmethod
    def of_target(tcfg) -> dict[str, Any]:
        """The shape fields (and rope scaling) of a head shaped like one layer of the target ``tcfg``."""
        return dict({f.name: getattr(tcfg, f.name) for f in dataclasses.fields(HeadShape)},
                    rope_scaling=tcfg.rope_scaling)


@dataclasses.dataclass(frozen=True)
class Eagle3Config(HeadShape):
    draft_vocab_size: int
    target_hidden_size: int
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    num_layers: int = 1
    aux_layer_ids: tuple[int, ...] = (1, 13, 24)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    # vLLM speculators' variant (RedHatAI heads): the midlayer's residual is hidden_norm(h) rather than h
    norm_before_residual: bool = False

    @classmethod
    def from_target(cls, tcfg: ModelConfig, *, draft_vocab_size: int | None = None, num_layers: int = 1,
                    aux_layer_ids: tuple[int, ...] | None = None, dtype: str | None = None,
                    **overrides) -> "Eagle3Config":
        """A head shaped like one layer of its target (SpecForge's default recipe)."""
        kw = dict(
            HeadShape.of_target(tcfg), draft_vocab_size=min(draft_vocab_size or tcfg.vocab_size, tcfg.vocab_size),
            target_hidden_size=tcfg.hidden_size, num_layers=num_layers,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(tcfg.num_layers),
            bos_token_id=tcfg.bos_token_id, eos_token_ids=tcfg.eos_token_ids, dtype=dtype or tcfg.dtype)
        kw.update(overrides)
        return cls(**kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadLayerParams:
    """One head layer. The midlayer (index 0) takes 2H inputs and has ``hidden_norm``; later layers take H.
    EAGLE heads (eagle.py) use it too: H inputs, no ``hidden_norm``, and no ``input_norm`` in layer 0."""
    input_norm: jax.Array | None  # [H]
    wq: jax.Array  # [Din, N, Hd]   Din = 2H for the midlayer, H otherwise
    wk: jax.Array  # [Din, K, Hd]
    wv: jax.Array  # [Din, K, Hd]
    wo: jax.Array  # [N, Hd, H]
    post_norm: jax.Array  # [H]
    w_gate: jax.Array  # [H, F]
    w_up: jax.Array  # [H, F]
    w_down: jax.Array  # [F, H]
    hidden_norm: jax.Array | None = None  # [H] (midlayer only)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Params:
    fc: jax.Array  # [3*Ht, H]
    layers: list  # list[HeadLayerParams], layers[0] is the midlayer
    norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, Vd]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VocabMap:
    """Draft <-> target vocab. Not trained; kept apart from the params so the optimizer never sees it."""
    d2t: jax.Array  # i32[Vd] offsets: target_id = i + d2t[i]
    t2d: jax.Array  # bool[V] target token j is in the draft vocab

    @classmethod
    def identity(cls, vocab_size: int) -> "VocabMap":
        return cls(d2t=jnp.zeros((vocab_size,), jnp.int32), t2d=jnp.ones((vocab_size,), bool))

    @classmethod
    def from_used_ids(cls, used_ids: np.ndarray, vocab_size: int) -> "VocabMap":
        used = np.sort(np.asarray(used_ids, np.int64))
        t2d = np.zeros((vocab_size,), bool)
        t2d[used] = True
        return cls(d2t=jnp.asarray(used - np.arange(len(used)), jnp.int32), t2d=jnp.asarray(t2d))

    def draft_to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


def param_shapes(cfg: Eagle3Config) -> Eagle3Params:
    dt = jnp.dtype(cfg.dtype)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    h, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lays = []
    for i in range(cfg.num_layers):
        din = 2 * h if i == 0 else h
        lays.append(HeadLayerParams(
            input_norm=s(h), wq=s(din, n, hd), wk=s(din, k, hd), wv=s(din, k, hd), wo=s(n, hd, h), post_norm=s(h),
            w_gate=s(h, f), w_up=s(h, f), w_down=s(f, h), hidden_norm=s(h) if i == 0 else None))
    return Eagle3Params(fc=s(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h), layers=lays, norm=s(h),
                        lm_head=s(h, cfg.draft_vocab_size))


def init_params(cfg: Eagle3Config, key: jax.Array, scale: float = 0.02) -> Eagle3Params:
    return random_params(param_shapes(cfg), key, scale)


def init_params_from_target(cfg: Eagle3Config, key: jax.Array, embed, lm_head, final_norm,
                            vocab_map: VocabMap) -> Eagle3Params:
    """Random head params whose output layer starts as the target's: ``lm_head`` = the target's output projection
    restricted to the draft vocab ([H, Vd]; ``embed`` [V, H] rows when ``lm_head`` is None, i.e. tied) and
    ``norm`` = the target's final norm (ones when None). A head whose hidden state matches the target's last
    hidden state then predicts what the target does, so training starts from a useful output layer."""
    if cfg.hidden_size != cfg.target_hidden_size:
        raise ValueError(f"init from the target's lm_head needs head hidden {cfg.hidden_size} == target hidden "
                         f"{cfg.target_hidden_size}")
    params = init_params(cfg, key)
    used = jnp.arange(cfg.draft_vocab_size) + jnp.asarray(vocab_map.d2t)  # i32[Vd] target ids
    head = jnp.take(embed, used, axis=0).T if lm_head is None else jnp.take(lm_head, used, axis=1)  # [H, Vd]
    norm = params.norm if final_norm is None else jnp.asarray(final_norm)
    dt = jnp.dtype(cfg.dtype)
    return dataclasses.replace(params, lm_head=head.astype(dt), norm=norm.astype(dt))


def widen_lm_head(lm_head, old_ids, new_ids, target_rows):
    """A trained head's output layer grown to a larger draft vocab.

    lm_head: [H, Vd] the head's rows of the sorted target ids ``old_ids`` (i32[Vd]); new_ids: sorted i32[Vd'] that
    contains every old id; target_rows: [V, Ht] the target's output rows (its lm_head transposed, or the tied
    embedding). Returns [H, Vd']: the old rows as they were (moved to their ids' new places) and, for each added id,
    the target's row through the linear map that takes the target's rows of the old ids closest to the head's
    (least squares). The target's final norm scales its rows' columns, which such a map absorbs, so it is not
    needed. A head trained from the target's rows (``init_lm_head: target``) keeps them close to a linear image of
    them: SmolLM2's shipped head is fitted at cosine 0.98 on ids left out of the fit."""
    old_ids, new_ids = jnp.asarray(old_ids), jnp.asarray(new_ids)
    src = jnp.take(target_rows, old_ids, axis=0).astype(jnp.float32)  # [Vd, Ht]
    fit, *_ = jnp.linalg.lstsq(src, lm_head.T.astype(jnp.float32))  # [Ht, H]
    rows = jnp.take(target_rows, new_ids, axis=0).astype(jnp.float32) @ fit  # [Vd', H]
    rows = rows.at[jnp.searchsorted(new_ids, old_ids)].set(lm_head.T.astype(jnp.float32))
    return rows.T.astype(lm_head.dtype)


def project_aux(params: Eagle3Params, aux):
    """fc over the concatenated target aux features: [B, T, 3*Ht] -> [B, T, H], in the head's activation dtype (its
    norms'; its matrices may be stored narrower, ``head_weights.stored_matrix_dtype``)."""
    return layers.dense(aux.astype(params.norm.dtype), params.fc)


def layer_input(lp: HeadLayerParams, cfg: Eagle3Config, emb, hidden):
    """Attention input of a layer: midlayer -> concat(input_norm(emb), hidden_norm(hidden)); others -> norm(hidden)."""
    if lp.hidden_norm is not None:
        return jnp.concatenate([layers.rms_norm(emb, lp.input_norm, cfg.rms_norm_eps),
                                layers.rms_norm(hidden, lp.hidden_norm, cfg.rms_norm_eps)], axis=-1)  # [B, T, 2H]
    return layers.rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps)


def qkv(lp: HeadLayerParams, cfg: Eagle3Config, x, positions, *, with_q: bool = True):
    """Rotated q [B, T, N, Hd] (None without ``with_q``), k [B, T, K, Hd] and v of a layer input x [B, T, Din]."""
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    q = layers.apply_rope(layers.dense(x, lp.wq), positions, inv_freq) if with_q else None
    k = layers.dense(x, lp.wk)
    v = layers.dense(x, lp.wv)
    return q, layers.apply_rope(k, positions, inv_freq), v


def finish_layer(lp: HeadLayerParams, cfg: Eagle3Config, hidden, attn_out):
    """Residual + o_proj, then the SwiGLU MLP. hidden: [B, T, H] (the layer's input; a midlayer of a
    ``norm_before_residual`` head takes hidden_norm(hidden) as its residual); attn_out: [B, T, N, Hd] -> [B, T, H]."""
    if lp.hidden_norm is not None and cfg.norm_before_residual:
        hidden = layers.rms_norm(hidden, lp.hidden_norm, cfg.rms_norm_eps)
    h = layers.out_proj(attn_out, lp.wo, residual=hidden)
    return layers.swiglu(layers.rms_norm(h, lp.post_norm, cfg.rms_norm_eps), lp.w_gate, lp.w_up, lp.w_down,
                         residual=h)


def draft_logits(params: Eagle3Params, cfg: Eagle3Config, hidden):
    """f32 logits over the draft vocab from the pre-norm hidden state [..., H] -> [..., Vd]."""
    return layers.dense(layers.rms_norm(hidden, params.norm, cfg.rms_norm_eps), params.lm_head,
                        preferred_element_type=jnp.float32)


def forward(params: Eagle3Params, cfg: Eagle3Config, emb, hidden, positions, attend: layers.AttendFn, *,
            kv_only: bool = False):
    """One draft step over T new tokens. emb: [B, T, H] target embeddings of the tokens; hidden: [B, T, H] incoming
    hidden (fc(aux) or fed-back h); positions: i32[B, T]; attend: the per-layer attention (``layers.CacheAttend``).
    ``kv_only``: the last layer only stores its K/V (``attend.store``) and h_out is None (a commit that no draft step
    follows needs no attention or MLP there).
    Returns (h_out [B, T, H] pre-norm, k_new [nl, B, T, K, Hd], v_new [nl, B, T, K, Hd])."""
    h = hidden.astype(params.norm.dtype)
    emb = emb.astype(h.dtype)
    return run_layers(params.layers, cfg, h, lambda lp, x: layer_input(lp, cfg, emb, x), positions, attend,
                      kv_only)


def run_layers(layer_params, cfg, h, attn_input, positions, attend: layers.AttendFn, kv_only: bool = False):
    """The decoder-layer loop of both draft heads: layer i attends from ``attn_input(lp, h)``, then o_proj and MLP.
    ``kv_only``: the last layer only stores its K/V (``attend.store``; its q is not computed) and h is None.
    Returns (h [B, T, H] or None, k_new [nl, B, T, K, Hd], v_new)."""
    ks, vs = [], []
    for i, lp in enumerate(layer_params):
        store_only = kv_only and i == len(layer_params) - 1
        q, k, v = qkv(lp, cfg, attn_input(lp, h), positions, with_q=not store_only)
        ks.append(k)
        vs.append(v)
        if store_only:
            attend.store(i, k, v)
            h = None
        else:
            h = finish_layer(lp, cfg, h, attend(i, q, k, v))
    return h, jnp.stack(ks), jnp.stack(vs)


# ---- config.json (HF format) ------------------------------------------------------------------------------------
def config_to_hf(cfg: Eagle3Config, target_num_layers: int | None = None) -> dict[str, Any]:
    """The ``LlamaForCausalLMEagle3`` config.json of docs/08-eagle-reference.md. Aux layer ids are written only when
    they differ from the default for ``target_num_layers`` (engines disagree on how to read them)."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "tie_word_embeddings": False,
        "torch_dtype": cfg.dtype, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)) or None,
        "hidden_act": "silu",
    }
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        out["head_dim"] = cfg.head_dim
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.norm_before_residual:
        out["norm_before_residual"] = True  # read by SGLang and vLLM alike
    if target_num_layers is not None and tuple(cfg.aux_layer_ids) != default_aux_layer_ids(target_num_layers):
        # SGLang reads eagle_config's ids as layer outputs (it adds 1); vLLM reads the top-level field first, as the
        # layer whose INPUT is captured: the same layers written both ways
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                               "use_aux_hidden_state": True}
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg.aux_layer_ids]
    return out


# HF architecture names of EAGLE-1/2 heads (models/eagle.py loads them; EAGLE3 readers refuse them with a hint)
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


# Architecture names of EAGLE3 heads: SpecForge / SGLang's, vLLM's, and vLLM speculators' (a nested
# ``transformer_layer_config``); a plain LlamaForCausalLM name is taken when the rest of the config is an EAGLE3 head's.
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel",
                        "LlamaForCausalLM")
# speculators' options that change the head's math in ways specjax does not implement (refused, never ignored)
_UNSUPPORTED_OPTIONS = {"norm_before_fc": "an RMSNorm over the concatenated target features before fc",
                        "fc_norm": "an RMSNorm after fc"}


def _flat_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A speculators config (the layer's fields under ``transformer_layer_config``, the head's own at the top) as
    one flat dict; other configs as they are."""
    inner = hf.get("transformer_layer_config")
    if not isinstance(inner, dict):
        return hf
    flat = {"num_hidden_layers": 1, **inner}
    flat.update({k: v for k, v in hf.items() if k != "transformer_layer_config" and v is not None})
    if "dtype" in hf and "torch_dtype" not in hf:
        flat["torch_dtype"] = hf["dtype"]
    return flat


def _aux_ids(hf: dict[str, Any], target_num_layers: int) -> tuple[int, ...]:
    """Target layers (training convention: layer outputs) from eagle_config's ids (SGLang's, the same convention)
    or else the top-level ids of vLLM / speculators configs (the layer whose input is captured: minus one)."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) - 1 for i in ids)
    return default_aux_layer_ids(target_num_layers)


def config_from_hf(hf: dict[str, Any], target_num_layers: int, dtype: str | None = None) -> Eagle3Config:
    archs = hf.get("architectures") or []
    if archs and archs[0] not in EAGLE3_ARCHITECTURES:
        hint = (" (an EAGLE-1/2 head: serve it as it is with --speculative-algorithm EAGLE)"
                if archs[0] in EAGLE_ARCHITECTURES else "")
        raise ValueError(f"not an EAGLE3 head: architectures={archs}{hint}")
    hf = _flat_config(hf)
    for name, what in _UNSUPPORTED_OPTIONS.items():
        if hf.get(name):
            raise ValueError(f"{name}=true ({what}) is not supported by specjax")
    h = int(hf["hidden_size"])
    n = int(hf["num_attention_heads"])
    rope_theta, rs = rope_settings(hf, "EAGLE3 head")
    vd = hf.get("draft_vocab_size") or hf.get("truncated_vocab_size") or hf["vocab_size"]
    return Eagle3Config(
        hidden_size=h, intermediate_size=int(hf["intermediate_size"]), num_heads=n,
        num_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=int(hf.get("head_dim") or h // n),
        vocab_size=int(hf["vocab_size"]), draft_vocab_size=int(vd),
        target_hidden_size=int(hf.get("target_hidden_size") or h), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_scaling=tuple(sorted(rs.items())) if rs else None, num_layers=int(hf.get("num_hidden_layers", 1)),
        aux_layer_ids=_aux_ids(hf, target_num_layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        dtype=dtype or hf.get("torch_dtype") or "bfloat16",
        norm_before_residual=bool(hf.get("norm_before_residual", False)))


def read_hf_config(folder: str) -> dict[str, Any]:
    return read_json(os.path.join(folder, "config.json"))
