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
from typing import Any

import jax
import jax.numpy as jnp

from specjax import layers
from specjax.config import rope_settings
from specjax.models import random_params
from specjax.models import eagle3


class EagleHeadError(ValueError):
    """A checkpoint or token map that is not a usable EAGLE head."""


@dataclasses.dataclass(frozen=True)
class EagleConfig(eagle3.HeadShape):
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    num_layers: int = 1
    dtype: str = "bfloat16"

    @classmethod
    def from_target(cls, tcfg, *, num_layers: int = 1, dtype: str | None = None, **overrides) -> "EagleConfig":
        """A head shaped like one layer of its target (what EAGLE-1/2 heads are)."""
        kw = dict(eagle3.HeadShape.of_target(tcfg), num_layers=num_layers, dtype=dtype or tcfg.dtype)
        kw.update(overrides)
        return cls(**kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleParams:
    fc: jax.Array  # [2H, H]  rows: embedding first, then the feature
    fc_bias: jax.Array  # [H]
    layers: list  # list[eagle3.HeadLayerParams]: input_norm None for layer 0 (skipped), no hidden_norm


def param_shapes(cfg: EagleConfig) -> EagleParams:
    dt = jnp.dtype(cfg.dtype)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    h, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lays = [eagle3.HeadLayerParams(input_norm=s(h) if i > 0 else None, wq=s(h, n, hd), wk=s(h, k, hd),
                                   wv=s(h, k, hd), wo=s(n, hd, h), post_norm=s(h), w_gate=s(h, f), w_up=s(h, f),
                                   w_down=s(f, h))
            for i in range(cfg.num_layers)]
    return EagleParams(fc=s(2 * h, h), fc_bias=s(h), layers=lays)


def init_params(cfg: EagleConfig, key: jax.Array, scale: float = 0.02) -> EagleParams:
    """Random params (tests, benchmarks); norms start at 1."""
    return random_params(param_shapes(cfg), key, scale)


def embed_input(params: EagleParams, emb, feature):
    """fc(concat(embedding, feature)) + bias: [B, T, H] x2 -> [B, T, H]."""
    x = jnp.concatenate([emb.astype(params.fc.dtype), feature.astype(params.fc.dtype)], axis=-1)  # [B, T, 2H]
    return layers.dense(x, params.fc) + params.fc_bias


def layer_input(lp: eagle3.HeadLayerParams, cfg: EagleConfig, hidden):
    """Attention input: layer 0 skips its input_layernorm (identity)."""
    return hidden if lp.input_norm is None else layers.rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps)


def draft_logits(lm_head, feature):
    """f32 logits of predicted features [..., H] with the target's lm_head [H, Vd] (no norm: EAGLE predicts the
    target's final-normed hidden state)."""
    return layers.dense(feature, lm_head.astype(feature.dtype), preferred_element_type=jnp.float32)


def forward(params: EagleParams, cfg: EagleConfig, emb, feature, positions, attend: layers.AttendFn, *,
            kv_only: bool = False):
    """One draft step over T new tokens (same contract as ``eagle3.forward``, ``kv_only`` included).
    Returns (predicted feature [B, T, H], k_new [nl, B, T, K, Hd], v_new)."""
    return eagle3.run_layers(params.layers, cfg, embed_input(params, emb, feature),
                             lambda lp, x: layer_input(lp, cfg, x), positions, attend, kv_only)


# ---- HF format ---------------------------------------------------------------------------------------------------
def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> EagleConfig:
    archs = hf.get("architectures") or []
    if archs and archs[0] not in (*eagle3.EAGLE_ARCHITECTURES, "LlamaForCausalLM"):
        raise EagleHeadError(f"not an EAGLE-1/2 head: architectures={archs} (EAGLE3 heads use --speculative-algorithm "
                             f"EAGLE3)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise EagleHeadError("EAGLE heads with attention/MLP bias are not supported")
    h = int(hf["hidden_size"])
    n = int(hf["num_attention_heads"])
    rope_theta, rs = rope_settings(hf, "EAGLE head")
    return EagleConfig(
        hidden_size=h, intermediate_size=int(hf["intermediate_size"]), num_heads=n,
        num_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=int(hf.get("head_dim") or h // n),
        vocab_size=int(hf["vocab_size"]), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
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


