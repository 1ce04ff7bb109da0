"""Model configuration built from a Hugging Face ``config.json``.

The architecture of a target model always comes from its HF config; YAML run configs never restate it.
One frozen dataclass covers every supported family; the differences are switches:

- LlamaForCausalLM (Llama-2/3/3.1/3.2, SmolLM2): optional "llama3" / "linear" rope scaling.
- MistralForCausalLM: optional sliding window.
- Qwen2ForCausalLM (Qwen2, Qwen2.5): bias on q/k/v projections.
- Qwen3ForCausalLM: RMSNorm on q and k per head, explicit head_dim.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
DTYPES = ("float32", "bfloat16", "float16")  # the parameter / compute dtypes a model or head may take

# Config fields that exist in HF configs of the supported families and that we read, or that have no effect on
# the forward pass of a causal LM at inference / frozen-target time. Anything else that changes the math is refused.
_REFUSED_IF_TRUE = {
    "use_sliding_window": "qwen2-style sliding window attention",
    "attention_bias_in_o_proj": "o_proj bias",
    "mlp_bias": "MLP bias",
}

# Integer fields of a config.json that size the model: required ones, and ones that may be absent or null (derived,
# or a default). Each must be an int >= 1 (a bool or "64" is not one).
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


class ConfigError(ValueError):
    """A config specjax cannot use as written: a model's config.json it cannot run faithfully, or a run config
    (``specjax.train.config``) with an unknown key or a bad value. The message says what to change."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3 training convention: OUTPUTS of layers {1, L//2-1, L-4} (0-based)."""
    if num_layers < 5:
        # Tiny test models: keep three distinct, in-range, increasing layers.
        ids = sorted({min(1, num_layers - 1), max(0, num_layers // 2 - 1), max(0, num_layers - 4)})
        while len(ids) < 3:
            ids.append(ids[-1])
        return tuple(ids)  # type: ignore[return-value]
    return (1, num_layers // 2 - 1, num_layers - 4)


def eos_ids(value) -> tuple[int, ...]:
    """An HF ``eos_token_id`` field (config.json, generation_config.json): one id, a list of ids, or None."""
    if value is None:
        return ()
    return tuple(int(e) for e in (value if isinstance(value, (list, tuple)) else [value]))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen, hashable copy of the HF dict
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # parameter / compute dtype

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Parameter count, derived from shapes (used by eval_shape checks and MFU)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * n * h + 2 * d * k * h + n * h * d
        if self.qkv_bias:
            attn += n * h + 2 * k * h
        if self.qk_norm:
            attn += 2 * h
        per_layer = attn + 3 * d * f + 2 * d
        total = self.num_layers * per_layer + v * d + d
        if not self.tie_word_embeddings:
            total += v * d
        return total

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None, source: str = "config.json") -> "ModelConfig":
        """The config of an HF ``config.json``'s dict; ``source`` names the file in errors (a ``ConfigError`` for a
        config that is not an object, a field of the wrong type, or one specjax cannot run faithfully)."""
        if not isinstance(hf, dict):
            raise ConfigError(f"{source} must be a JSON object")
        arch = _architecture(hf, source)
        family = SUPPORTED_ARCHITECTURES[arch]
        for field, what in _REFUSED_IF_TRUE.items():
            if hf.get(field):
                raise ConfigError(f"{arch}: config field {field}=true ({what}) is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{arch}: hidden_act={act!r} is not supported (only 'silu')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ConfigError(f"{arch}: config.json lacks required fields {missing}")
        _check_numbers(hf, source)

        num_heads = int(hf["num_attention_heads"])
        num_kv = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        if num_heads % num_kv:
            raise ConfigError(f"{arch}: num_attention_heads={num_heads} not divisible by num_key_value_heads={num_kv}")

        rope_theta, rope_scaling = rope_settings(hf, arch, source)

        sliding = None
        if family == "mistral" and hf.get("sliding_window"):
            sliding = int(hf["sliding_window"])

        if family != "qwen2" and hf.get("attention_bias"):  # Qwen2's q/k/v biases are the family's own
            raise ConfigError(f"{arch}: attention_bias=true is not supported")

        dtype = config_dtype(hf, dtype)

        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids(hf.get("eos_token_id")),
            dtype=dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | None = None) -> "ModelConfig":
        """Read ``config.json`` from a local folder, a path to the json itself, or a resolved hub id."""
        cfg_path = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ConfigError(f"no config.json at {cfg_path}")
        return cls.from_hf_dict(read_json(cfg_path), dtype=dtype, source=cfg_path)

    def check_context(self, prompt_tokens: int, max_new_tokens: int, hint: str) -> None:
        """A ValueError when a prompt of ``prompt_tokens`` plus ``max_new_tokens`` new tokens runs past the model's
        context (``max_position_embeddings``), as the server refuses a longer --context-length: positions past it
        were never trained. ``hint`` says what to change (the flags of the command)."""
        total = prompt_tokens + max_new_tokens
        if total > self.max_position_embeddings:
            raise ValueError(f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens = {total} is longer than "
                             f"the model's max_position_embeddings ({self.max_position_embeddings}): positions past "
                             f"it were never trained and give wrong outputs; {hint}")


def read_json(path: str) -> Any:
    """A JSON file (a model's or a head's config.json); a file that is not JSON is a ``ConfigError`` naming it."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None


def config_dtype(hf: dict[str, Any], dtype: str | None = None,
                 hint: str = "pass --dtype float32, bfloat16 or float16") -> str:
    """``dtype``, else the dtype label of a config.json (``torch_dtype``, or ``dtype`` as transformers >= 4.56 writes
    it; bfloat16 when it has neither); a ConfigError naming the accepted ones (``DTYPES``) and ending in ``hint``
    for any other (``bf16``, ``float8``, ``int8``, ``auto``)."""
    if dtype is None:
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} (config.json's torch_dtype / dtype; specjax takes "
                          f"{', '.join(DTYPES)}): {hint}")
    return dtype


def config_architectures(path: str) -> list:
    """The ``architectures`` of ``path``/config.json ([] when it has none or cannot be read)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return archs if isinstance(archs, list) else [archs]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_numbers(hf: dict[str, Any], source: str) -> None:
    """A ConfigError naming the field and ``source`` for a field that ``from_hf_dict`` reads as a number (or a
    switch) and that is not one: a size not an int >= 1, a token id not an int, an epsilon not a finite number."""
    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{source}: {key} must be {what}, got {hf[key]!r}")
    for key in _REQUIRED_INTS + _OPTIONAL_INTS:
        if key in hf and not (_is_int(hf[key]) and hf[key] >= 1) and not (key in _OPTIONAL_INTS and hf[key] is None):
            raise bad(key, "an integer >= 1")
    for key in ("sliding_window", "bos_token_id"):
        if hf.get(key) is not None and not _is_int(hf[key]):
            raise bad(key, "an integer or null")
    eos = hf.get("eos_token_id")
    if eos is not None and not all(_is_int(e) for e in (eos if isinstance(eos, list) else [eos])):
        raise bad("eos_token_id", "a token id, a list of token ids or null")
    if hf.get("rms_norm_eps") is not None and not (_is_number(hf["rms_norm_eps"]) and hf["rms_norm_eps"] >= 0):
        raise bad("rms_norm_eps", "a number >= 0")
    if hf.get("tie_word_embeddings") is not None and not isinstance(hf["tie_word_embeddings"], bool):
        raise bad("tie_word_embeddings", "true or false")
    if hf.get("rope_scaling") is not None and not isinstance(hf["rope_scaling"], dict):
        raise bad("rope_scaling", "an object or null")


def _architecture(hf: dict[str, Any], source: str = "config.json") -> str:
    """The supported architecture a config.json names (``architectures[0]``, else by ``model_type``)."""
    archs = hf.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"{source}: architectures must be a list of names (e.g. [\"LlamaForCausalLM\"]), "
                          f"got {archs!r}")
    arch = archs[0] if archs else None
    if arch is None:
        mt = hf.get("model_type")
        mt = mt if isinstance(mt, str) else None
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}.get(mt)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; specjax supports "
            f"{sorted(SUPPORTED_ARCHITECTURES)}")
    return arch


def rope_settings(hf: dict[str, Any], arch: str, source: str = "config.json") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None for plain RoPE) of a config.json (``source``, named in errors): a target's
    or a draft head's, from top-level ``rope_theta`` / ``rope_scaling`` or transformers' ``rope_parameters``, with
    the legacy ``type`` key read as ``rope_type``."""
    rope_scaling = hf.get("rope_scaling")
    rope_theta = hf.get("rope_theta")
    # transformers >= 4.56 may store rope settings under "rope_parameters".
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict):
        rope_theta = rope_theta or rp.get("rope_theta")
        if rope_scaling is None and rp.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    rope_theta = rope_theta if rope_theta is not None else 10000.0
    if not (_is_number(rope_theta) and rope_theta > 0):
        raise ConfigError(f"{source}: rope_theta must be a number > 0, got {rope_theta!r}")
    rope_theta = float(rope_theta)
    if rope_scaling is not None:
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"{arch}: rope_scaling type {rtype!r} is not supported ({SUPPORTED_ROPE_TYPES})")
        needed = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings")}.get(rtype, ())
        if missing := [k for k in needed if k not in rope_scaling]:
            raise ConfigError(f"{arch}: rope_scaling of type {rtype!r} lacks {', '.join(missing)}")
        numbers = [k for k in (*needed, "low_freq_factor", "high_freq_factor") if k in rope_scaling]
        if wrong := [k for k in numbers if not (_is_number(rope_scaling[k]) and rope_scaling[k] > 0)]:
            raise ConfigError(f"{source}: rope_scaling.{wrong[0]} must be a number > 0, got "
                              f"{rope_scaling[wrong[0]]!r}")
        if rtype == "default":
            rope_scaling = None
        else:
            rope_scaling = dict(rope_scaling, rope_type=rtype)
            rope_scaling.pop("type", None)
            rope_scaling.pop("rope_theta", None)
    return rope_theta, rope_scaling
