"""EAGLE-1 / EAGLE-2 draft head (HF ``LlamaForCausalLMEagle``, algorithm ``EAGLE``).

One draft step for token embeddings ``e`` and incoming feature ``f`` ([B, T, H]):
    x = fc(concat(e, f)) + fc_bias                 (embedding first)
    layer 0: r = x; x = r + o_proj(attn(x))        (input_layernorm skipped: identity)
             x = x + mlp(post_attention_layernorm(x))
    layers 1..: plain Llama decoder layers
    out = x                                        (no final norm: it predicts the target's next feature)
The feature is the target's LAST hidden state after its final norm; the draft's logits are the TARGET lm_head applied
to the predicted feature, optionally cut to an FR-Spec "hot" token list (``--speculative-token-map``).
The embedding and lm_head are the target's and never part of the head's params.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import layers
from specjax.models import random_params
from specjax.models import eagle3


class EagleHeadError(ValueError):
    """A checkpoint or token map that is not a usable EAGLE head."""


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    num_layers: int = 1
    dtype: str = "bfloat16"

    @property
    def rope_scaling_dict(self):
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def replace(self, **kw) -> "EagleConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_target(cls, tcfg, *, num_layers: int = 1, dtype: str | None = None, **overrides) -> "EagleConfig":
        """A head shaped like one layer of its target (what EAGLE-1/2 heads are)."""
        kw = dict(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_heads=tcfg.num_heads,
                  num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size,
                  rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                  max_position_embeddings=tcfg.max_position_embeddings, rope_scaling=tcfg.rope_scaling,
                  num_layers=num_layers, dtype=dtype or tcfg.dtype)
        kw.update(overrides)
        return cls(**kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleLayerParams:
    input_norm: jax.Array | None  # [H]; None for layer 0 (skipped)
    wq: jax.Array  # [H, N, Hd]
    wk: jax.Array  # [H, K, Hd]
    wv: jax.Array  # [H, K, Hd]
    wo: jax.Array  # [N, Hd, H]
    post_norm: jax.Array  # [H]
    w_gate: jax.Array  # [H, F]
    w_up: jax.Array  # [H, F]
    w_down: jax.Array  # [F, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleParams:
    fc: jax.Array  # [2H, H]  rows: embedding first, then the feature
    fc_bias: jax.Array  # [H]
    layers: list  # list[EagleLayerParams]


def param_shapes(cfg: EagleConfig) -> EagleParams:
    dt = jnp.dtype(cfg.dtype)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    h, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lays = [EagleLayerParams(input_norm=s(h) if i > 0 else None, wq=s(h, n, hd), wk=s(h, k, hd), wv=s(h, k, hd),
                             wo=s(n, hd, h), post_norm=s(h), w_gate=s(h, f), w_up=s(h, f), w_down=s(f, h))
            for i in range(cfg.num_layers)]
    return EagleParams(fc=s(2 * h, h), fc_bias=s(h), layers=lays)


def init_params(cfg: EagleConfig, key: jax.Array, scale: float = 0.02) -> EagleParams:
    """Random params (tests, benchmarks); norms start at 1."""
    return random_params(param_shapes(cfg), key, scale)


def embed_input(params: EagleParams, emb, feature):
    """fc(concat(embedding, feature)) + bias: [B, T, H] x2 -> [B, T, H]."""
    x = jnp.concatenate([emb.astype(params.fc.dtype), feature.astype(params.fc.dtype)], axis=-1)  # [B, T, 2H]
    return jnp.einsum("btc,ch->bth", x, params.fc) + params.fc_bias


def layer_input(lp: EagleLayerParams, cfg: EagleConfig, hidden):
    """Attention input: layer 0 skips its input_layernorm (identity)."""
    return hidden if lp.input_norm is None else layers.rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps)


def draft_logits(lm_head, feature):
    """f32 logits of predicted features [..., H] with the target's lm_head [H, Vd] (no norm: EAGLE predicts the
    target's final-normed hidden state)."""
    return jnp.einsum("...h,hv->...v", feature, lm_head.astype(feature.dtype), preferred_element_type=jnp.float32)


def forward_cached(params: EagleParams, cfg: EagleConfig, emb, feature, positions, mask, *, cache=None,
                   cache_attention=None):
    """Draft step over T new tokens against the head's paged cache (same contract as ``eagle3.forward_cached``).
    Returns (predicted feature [B, T, H], k_new [nl, B, T, K, Hd], v_new)."""
    from specjax.kv_cache import gather_layer
    b, t = positions.shape
    sm_scale = cfg.head_dim ** -0.5
    cache_valid = None
    if cache is not None:
        key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        cache_valid = jnp.broadcast_to(key_pos[None, None, :] < cache.lengths[:, None, None], (b, t, cache.max_len))
    h = embed_input(params, emb, feature)
    ks, vs = [], []
    for i, lp in enumerate(params.layers):
        q, k, v = eagle3.qkv(lp, cfg, layer_input(lp, cfg, h), positions)
        if cache is None:
            o = layers.attention(q, k, v, mask, sm_scale=sm_scale)
        elif cache_attention is not None:
            o = cache_attention(q, k, v, mask, cache.k[i], cache.v[i], cache.page_table, cache.lengths, sm_scale)
        else:
            kc, vc = gather_layer(cache.k[i], cache.v[i], cache.page_table)
            o = layers.attention(q, k, v, mask, k_cache=kc, v_cache=vc, cache_valid=cache_valid, sm_scale=sm_scale)
        h = eagle3.finish_layer(lp, cfg, h, o)
        ks.append(k)
        vs.append(v)
    return h, jnp.stack(ks), jnp.stack(vs)


# ---- HF format ---------------------------------------------------------------------------------------------------
def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> EagleConfig:
    archs = hf.get("architectures") or []
    if archs and archs[0] not in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "LlamaForCausalLM"):
        raise EagleHeadError(f"not an EAGLE-1/2 head: architectures={archs} (EAGLE3 heads use --speculative-algorithm "
                             f"EAGLE3)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise EagleHeadError("EAGLE heads with attention/MLP bias are not supported")
    h = int(hf["hidden_size"])
    n = int(hf["num_attention_heads"])
    rs = hf.get("rope_scaling")
    if rs is not None and rs.get("rope_type", rs.get("type")) in (None, "default"):
        rs = None
    if rs is not None:
        rs = dict(rs, rope_type=rs.get("rope_type", rs.get("type")))
        rs.pop("type", None)
    return EagleConfig(
        hidden_size=h, intermediate_size=int(hf["intermediate_size"]), num_heads=n,
        num_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=int(hf.get("head_dim") or h // n),
        vocab_size=int(hf["vocab_size"]), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_scaling=tuple(sorted(rs.items())) if rs else None, num_layers=int(hf.get("num_hidden_layers", 1)),
        dtype=dtype or hf.get("torch_dtype") or "bfloat16")


def config_to_hf(cfg: EagleConfig) -> dict[str, Any]:
    out = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": cfg.num_layers,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling_dict,
           "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
           "torch_dtype": cfg.dtype, "hidden_act": "silu", "tie_word_embeddings": False}
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        out["head_dim"] = cfg.head_dim
    return out


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TOLERATED = ("embed_tokens.weight", "lm_head.weight")  # engines use the target's embedding and lm_head


def _read_tensors(folder: str) -> dict[str, np.ndarray]:
    """All tensors of a head folder: *.safetensors, else pytorch_model*.bin read with torch weights_only=True."""
    files = sorted(os.listdir(folder))
    st = [f for f in files if f.endswith(".safetensors")]
    out: dict[str, np.ndarray] = {}
    if st:
        from specjax.safetensors_io import load_file
        for f in st:
            out.update(load_file(os.path.join(folder, f)))
        return out
    bins = [f for f in files if f.endswith(".bin") and f.startswith("pytorch_model")]
    if not bins:
        raise EagleHeadError(f"{folder} has no *.safetensors or pytorch_model*.bin")
    import torch
    for f in bins:
        sd = torch.load(os.path.join(folder, f), map_location="cpu", weights_only=True)
        out.update({k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in sd.items()})
    return out


def params_from_hf(tensors: dict[str, np.ndarray], cfg: EagleConfig) -> EagleParams:
    """HF tensors (``fc.*``, ``layers.{i}.*``; a ``model.`` prefix is stripped) -> EagleParams; shapes asserted,
    every key consumed or explicitly tolerated."""
    t = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    h, f, n, kh, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = jnp.dtype(cfg.dtype)
    used: set[str] = set()

    def need(key, shape):
        if key not in t:
            raise EagleHeadError(f"EAGLE head lacks tensor {key!r} (expected shape {shape})")
        a = np.asarray(t[key])
        if tuple(a.shape) != tuple(shape):
            raise EagleHeadError(f"EAGLE head tensor {key!r} has shape {a.shape}, expected {shape}")
        used.add(key)
        return a.astype(np.float32)

    put = lambda a: jnp.asarray(a, dt)
    fc = put(need("fc.weight", (h, 2 * h)).T)
    fc_b = put(need("fc.bias", (h,)))
    lays = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if i == 0:
            in_norm = None
            if p + "input_layernorm.weight" in t:
                used.add(p + "input_layernorm.weight")  # present in some exports; skipped by the architecture
        else:
            in_norm = put(need(p + "input_layernorm.weight", (h,)))
        lays.append(EagleLayerParams(
            input_norm=in_norm,
            wq=put(need(p + "self_attn.q_proj.weight", (n * hd, h)).T.reshape(h, n, hd)),
            wk=put(need(p + "self_attn.k_proj.weight", (kh * hd, h)).T.reshape(h, kh, hd)),
            wv=put(need(p + "self_attn.v_proj.weight", (kh * hd, h)).T.reshape(h, kh, hd)),
            wo=put(need(p + "self_attn.o_proj.weight", (h, n * hd)).T.reshape(n, hd, h)),
            post_norm=put(need(p + "post_attention_layernorm.weight", (h,))),
            w_gate=put(need(p + "mlp.gate_proj.weight", (f, h)).T), w_up=put(need(p + "mlp.up_proj.weight", (f, h)).T),
            w_down=put(need(p + "mlp.down_proj.weight", (h, f)).T)))
    left = sorted(k for k in t if k not in used and not k.endswith(_IGNORED_SUFFIXES) and k not in _TOLERATED)
    if left:
        raise EagleHeadError(f"EAGLE head has tensors the architecture does not use: {left[:8]}")
    return EagleParams(fc=fc, fc_bias=fc_b, layers=lays)


def params_to_hf(params: EagleParams, cfg: EagleConfig) -> dict[str, np.ndarray]:
    """Inverse of ``params_from_hf`` (tests, export)."""
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
    out = {"fc.weight": f32(params.fc).T.copy(), "fc.bias": f32(params.fc_bias)}
    for i, lp in enumerate(params.layers):
        p = f"layers.{i}."
        if lp.input_norm is not None:
            out[p + "input_layernorm.weight"] = f32(lp.input_norm)
        out[p + "self_attn.q_proj.weight"] = f32(lp.wq).reshape(cfg.hidden_size, -1).T.copy()
        out[p + "self_attn.k_proj.weight"] = f32(lp.wk).reshape(cfg.hidden_size, -1).T.copy()
        out[p + "self_attn.v_proj.weight"] = f32(lp.wv).reshape(cfg.hidden_size, -1).T.copy()
        out[p + "self_attn.o_proj.weight"] = f32(lp.wo).reshape(-1, cfg.hidden_size).T.copy()
        out[p + "post_attention_layernorm.weight"] = f32(lp.post_norm)
        out[p + "mlp.gate_proj.weight"] = f32(lp.w_gate).T.copy()
        out[p + "mlp.up_proj.weight"] = f32(lp.w_up).T.copy()
        out[p + "mlp.down_proj.weight"] = f32(lp.w_down).T.copy()
    return out


def load_head(folder: str, dtype: str | None = None) -> tuple[EagleConfig, EagleParams]:
    """(EagleConfig, EagleParams) from an HF folder (config.json + safetensors or pytorch_model.bin)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise EagleHeadError(f"no config.json in EAGLE head folder {folder}")
    with open(cfg_path) as fh:
        cfg = config_from_hf(json.load(fh), dtype=dtype)
    return cfg, params_from_hf(_read_tensors(folder), cfg)


def load_token_map(path: str, vocab_size: int | None = None) -> np.ndarray:
    """FR-Spec hot-token ids i32[Vd] from a .json list, a .npy array, or a torch file read with
    ``torch.load(weights_only=True)`` (never unrestricted unpickling)."""
    if not os.path.exists(path):
        raise EagleHeadError(f"speculative token map {path} does not exist")
    if path.endswith(".json"):
        with open(path) as fh:
            ids = json.load(fh)
        if isinstance(ids, dict):
            ids = ids.get("hot_token_ids", ids.get("token_ids"))
        ids = np.asarray(ids)
    elif path.endswith(".npy"):
        ids = np.load(path, allow_pickle=False)
    else:
        import pickle
        import torch
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise EagleHeadError(f"token map {path} holds more than plain tensors/lists and is refused (loaded with "
                                 f"weights_only=True): {str(e).splitlines()[0][:200]}") from None
        ids = obj.numpy() if hasattr(obj, "numpy") else np.asarray(obj)
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise EagleHeadError(f"token map {path} must be a non-empty 1-D list of integer token ids, got dtype "
                             f"{ids.dtype} shape {ids.shape}")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise EagleHeadError(f"token map {path} has ids outside [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise EagleHeadError(f"token map {path} repeats token ids")
    return ids.astype(np.int32)
