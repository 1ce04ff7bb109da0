"""EAGLE3 heads in the HF ``LlamaForCausalLMEagle3`` format (../shared/specs/eagle.md section 1), both ways.

    python -m specjax.convert export-head CKPT OUT_DIR [--target MODEL] [--dtype bfloat16]
    python -m specjax.convert import-head SRC OUT [--target MODEL] [--format checkpoint|hf]

Library: ``export_head(head_params, head_cfg, vocab_map, out_dir, target_cfg)`` and
``load_head(path, target_cfg, dtype=None) -> (head_cfg, head_params, vocab_map)``; export -> load is exact.

The folder holds ``config.json`` and one ``model.safetensors`` with the keys of the spec, stored ``[out, in]``:
``fc.weight``, ``midlayer.*`` (the first layer), ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets)
and ``t2d`` (bool), and no ``embed_tokens`` (engines copy the target's). Aux layer ids: the default
{1, L//2-1, L-4} writes no ``eagle_aux_hidden_state_layer_ids``; other ids are written as
``eagle_config.eagle_aux_hidden_state_layer_ids`` in the TRAINING convention (output of layer id, 0-based), and
read back the same way.

Heads with more than one layer (``num_hidden_layers`` > 1, which SGLang does not serve): the first layer stays
``midlayer.*`` and extra layer i (i >= 1) is ``layers.{i}.*``, a plain Llama decoder layer over H, the names vLLM's
multi-layer EAGLE3 uses (it reads ``midlayer.`` as ``layers.0.``). The importer accepts ``layers.0.*`` for the
first layer too, strips a ``model.`` prefix, and accepts an ``embed_tokens.weight`` whose shape matches the
target's embedding (its values are ignored: engines, and specjax, use the target's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cli import option, parse_options
from specjax.config import ModelConfig
from specjax.models import eagle3
from specjax.models.eagle3 import Eagle3Config, Eagle3Params, HeadLayerParams, VocabMap
from specjax.safetensors_io import CheckpointIndex, save_file

IGNORED = [re.compile(p) for p in (r".*rotary_emb\.inv_freq$",)]


class HeadFormatError(ValueError):
    """A head that does not match the EAGLE3 format or its target."""


# ---- key table -------------------------------------------------------------------------------------------------
def _layer_prefix(i: int) -> str:
    return "midlayer." if i == 0 else f"layers.{i}."


def _layer_table(cfg: Eagle3Config, i: int):
    """HF suffix -> (HeadLayerParams field, HF shape, to_hf(param), from_hf(tensor)) for layer i."""
    h, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    din = 2 * h if i == 0 else h
    proj = lambda heads: (lambda w: w.reshape(din, heads * hd).T, lambda a: a.T.reshape(din, heads, hd))
    t = {
        "input_layernorm.weight": ("input_norm", (h,), lambda w: w, lambda a: a),
        "self_attn.q_proj.weight": ("wq", (n * hd, din), *proj(n)),
        "self_attn.k_proj.weight": ("wk", (k * hd, din), *proj(k)),
        "self_attn.v_proj.weight": ("wv", (k * hd, din), *proj(k)),
        "self_attn.o_proj.weight": ("wo", (h, n * hd), lambda w: w.reshape(n * hd, h).T, lambda a: a.T.reshape(n, hd, h)),
        "post_attention_layernorm.weight": ("post_norm", (h,), lambda w: w, lambda a: a),
        "mlp.gate_proj.weight": ("w_gate", (f, h), lambda w: w.T, lambda a: a.T),
        "mlp.up_proj.weight": ("w_up", (f, h), lambda w: w.T, lambda a: a.T),
        "mlp.down_proj.weight": ("w_down", (h, f), lambda w: w.T, lambda a: a.T),
    }
    if i == 0:
        t["hidden_norm.weight"] = ("hidden_norm", (h,), lambda w: w, lambda a: a)
    return t


def _top_table(cfg: Eagle3Config):
    h = cfg.hidden_size
    return {
        "fc.weight": ("fc", (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size), lambda w: w.T, lambda a: a.T),
        "norm.weight": ("norm", (h,), lambda w: w, lambda a: a),
        "lm_head.weight": ("lm_head", (cfg.draft_vocab_size, h), lambda w: w.T, lambda a: a.T),
    }


# ---- checks ----------------------------------------------------------------------------------------------------
def check_head_matches_target(head_cfg: Eagle3Config, target_cfg: ModelConfig) -> None:
    """Refuse a head that cannot run on this target (vocab, feature width, aux layers)."""
    if head_cfg.vocab_size != target_cfg.vocab_size:
        raise HeadFormatError(
            f"head vocab_size={head_cfg.vocab_size} but the target's vocab is {target_cfg.vocab_size}: this head was "
            f"trained for another target (t2d must cover the target vocab)")
    if head_cfg.target_hidden_size != target_cfg.hidden_size:
        raise HeadFormatError(
            f"head expects target features of width {head_cfg.target_hidden_size} (fc takes "
            f"{len(head_cfg.aux_layer_ids)} x {head_cfg.target_hidden_size}), but the target's hidden size is "
            f"{target_cfg.hidden_size}: this head was trained for another target")
    bad = [i for i in head_cfg.aux_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        raise HeadFormatError(f"head aux layer ids {list(head_cfg.aux_layer_ids)} include {bad}, out of range for the "
                              f"target's {target_cfg.num_layers} layers")
    if head_cfg.draft_vocab_size > head_cfg.vocab_size:
        raise HeadFormatError(f"draft_vocab_size={head_cfg.draft_vocab_size} exceeds vocab_size={head_cfg.vocab_size}")


def check_vocab_map(d2t: np.ndarray, t2d: np.ndarray, head_cfg: Eagle3Config) -> None:
    vd, v = head_cfg.draft_vocab_size, head_cfg.vocab_size
    if d2t.shape != (vd,):
        raise HeadFormatError(f"d2t has shape {d2t.shape}, expected ({vd},) (draft_vocab_size)")
    if t2d.shape != (v,):
        raise HeadFormatError(f"t2d has shape {t2d.shape}, expected ({v},) (the target vocab)")
    ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= v:
        raise HeadFormatError(f"d2t maps draft ids outside the target vocab [0, {v})")
    if int(t2d.sum()) != vd or not np.array_equal(np.nonzero(t2d)[0], ids):
        raise HeadFormatError("d2t and t2d disagree: t2d must be true exactly at the target ids i + d2t[i], "
                              "which must increase with i")


def _check_params(params: Eagle3Params, head_cfg: Eagle3Config) -> None:
    want = eagle3.param_shapes(head_cfg)
    if len(params.layers) != head_cfg.num_layers:
        raise HeadFormatError(f"head has {len(params.layers)} layers, config says {head_cfg.num_layers}")
    for (path, w), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want)):
        if tuple(w.shape) != tuple(s.shape):
            raise HeadFormatError(f"head param {jax.tree_util.keystr(path)} has shape {tuple(w.shape)}, the config "
                                  f"needs {tuple(s.shape)}")


def _check_finite(tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A head with NaN/inf weights (a diverged run, a damaged checkpoint, fp16 overflow) would serve garbage."""
    bad = []
    for key, t in tensors.items():
        if np.issubdtype(t.dtype, np.floating) or t.dtype == jnp.bfloat16:
            n = int(t.size - np.count_nonzero(np.isfinite(t.astype(np.float32))))
            if n:
                bad.append(f"{key} ({n} of {t.size})")
    if bad:
        raise HeadFormatError(f"refusing to export: non-finite weights (NaN/inf) in {dtype} in "
                              f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; the checkpoint is diverged or "
                              f"damaged (export an earlier step folder)")


# ---- export ----------------------------------------------------------------------------------------------------
def head_to_hf(head_params: Eagle3Params, head_cfg: Eagle3Config, vocab_map: VocabMap,
               dtype: str | None = None) -> dict[str, np.ndarray]:
    """HF key -> numpy tensor ([out, in], in ``dtype``, default head_cfg.dtype), plus d2t (int64) and t2d (bool)."""
    dt = jnp.dtype(dtype or head_cfg.dtype)
    conv = lambda x: np.asarray(jnp.asarray(x).astype(dt))
    out: dict[str, np.ndarray] = {}
    for key, (field, shape, to_hf, _) in _top_table(head_cfg).items():
        out[key] = np.ascontiguousarray(to_hf(conv(getattr(head_params, field))))
    for i, lp in enumerate(head_params.layers):
        for suffix, (field, shape, to_hf, _) in _layer_table(head_cfg, i).items():
            out[_layer_prefix(i) + suffix] = np.ascontiguousarray(to_hf(conv(getattr(lp, field))))
    out["d2t"] = np.asarray(vocab_map.d2t).astype(np.int64)
    out["t2d"] = np.asarray(vocab_map.t2d).astype(np.bool_)
    return out


def export_head(head_params: Eagle3Params, head_cfg: Eagle3Config, vocab_map: VocabMap, out_dir: str,
                target_cfg: ModelConfig, *, dtype: str | None = None) -> dict:
    """Write ``out_dir/{config.json, model.safetensors}`` in the LlamaForCausalLMEagle3 format. Weights are stored
    in ``dtype`` (default head_cfg.dtype; the config's torch_dtype says which). Returns the config dict."""
    check_head_matches_target(head_cfg, target_cfg)
    _check_params(head_params, head_cfg)
    check_vocab_map(np.asarray(vocab_map.d2t), np.asarray(vocab_map.t2d), head_cfg)
    dtype = dtype or head_cfg.dtype
    tensors = head_to_hf(head_params, head_cfg, vocab_map, dtype)
    _check_finite(tensors, dtype)
    hf = eagle3.config_to_hf(head_cfg.replace(dtype=dtype), target_num_layers=target_cfg.num_layers)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "config.json"))
    return hf


# ---- import ----------------------------------------------------------------------------------------------------
def load_head(path: str, target_cfg: ModelConfig, dtype: str | None = None
              ) -> tuple[Eagle3Config, Eagle3Params, VocabMap]:
    """Read an HF EAGLE3 head folder (config.json + safetensors) for ``target_cfg``; params in ``dtype`` (default:
    the config's torch_dtype). Every tensor's shape is checked and every key must be used or known-ignorable."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise HeadFormatError(f"{path} is not an EAGLE3 head folder (config.json + *.safetensors)")
    hf = eagle3.read_hf_config(path)
    try:
        head_cfg = eagle3.config_from_hf(hf, target_cfg.num_layers, dtype=dtype)
    except (KeyError, ValueError) as e:
        raise HeadFormatError(f"{path}/config.json: {e}") from None
    check_head_matches_target(head_cfg, target_cfg)
    ckpt = CheckpointIndex(path)
    raw = {(k[len("model."):] if k.startswith("model.") else k): k for k in ckpt.keys()}
    if "midlayer.input_layernorm.weight" not in raw and "layers.0.input_layernorm.weight" in raw:
        raw = {(("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k): v for k, v in raw.items()}
    consumed: set[str] = set()
    dt = jnp.dtype(head_cfg.dtype)

    def need(key: str, shape: tuple, from_hf):
        if key not in raw:
            raise HeadFormatError(f"head {path} lacks tensor {key!r} (expected shape {shape})")
        got = tuple(ckpt.shape(raw[key]))
        if got != tuple(shape):
            raise HeadFormatError(f"head {path}: tensor {key!r} has shape {got}, expected {tuple(shape)} for this "
                                  f"config")
        consumed.add(key)
        return jnp.asarray(from_hf(np.asarray(ckpt.tensor(raw[key])))).astype(dt)

    top = {field: need(key, shape, from_hf) for key, (field, shape, _, from_hf) in _top_table(head_cfg).items()}
    lays = []
    for i in range(head_cfg.num_layers):
        fields = {field: need(_layer_prefix(i) + suffix, shape, from_hf)
                  for suffix, (field, shape, _, from_hf) in _layer_table(head_cfg, i).items()}
        lays.append(HeadLayerParams(**fields))

    vd, v = head_cfg.draft_vocab_size, head_cfg.vocab_size
    if "d2t" in raw and "t2d" in raw:
        d2t = np.asarray(ckpt.tensor(raw["d2t"])).astype(np.int64)
        t2d = np.asarray(ckpt.tensor(raw["t2d"])).astype(bool)
        consumed |= {"d2t", "t2d"}
    elif vd == v and "d2t" not in raw and "t2d" not in raw:
        d2t, t2d = np.zeros((vd,), np.int64), np.ones((v,), bool)
    else:
        raise HeadFormatError(f"head {path} has draft_vocab_size={vd} < vocab_size={v} but no d2t/t2d tensors")
    check_vocab_map(d2t, t2d, head_cfg)

    if "embed_tokens.weight" in raw:
        got = tuple(ckpt.shape(raw["embed_tokens.weight"]))
        if got != (target_cfg.vocab_size, target_cfg.hidden_size):
            raise HeadFormatError(f"head {path}: embed_tokens.weight has shape {got}, but the target's embedding is "
                                  f"{(target_cfg.vocab_size, target_cfg.hidden_size)}: another target's head?")
        consumed.add("embed_tokens.weight")  # the target's embedding is used instead
    leftover = sorted(k for k in set(raw) - consumed if not any(p.match(k) for p in IGNORED))
    if leftover:
        raise HeadFormatError(f"head {path} has tensors this {head_cfg.num_layers}-layer EAGLE3 head does not use: "
                              f"{leftover[:8]}{' ...' if len(leftover) > 8 else ''}")
    params = Eagle3Params(fc=top["fc"], layers=lays, norm=top["norm"], lm_head=top["lm_head"])
    return head_cfg, params, VocabMap(d2t=jnp.asarray(d2t, jnp.int32), t2d=jnp.asarray(t2d))


# ---- command line ----------------------------------------------------------------------------------------------
def _is_hf_head(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any("Eagle3" in a for a in archs)


def _target_config(path: str | None, what: str) -> ModelConfig:
    if not path:
        raise HeadFormatError(f"{what}: pass --target (the target model folder or its config.json)")
    if os.path.isdir(path) or path.endswith(".json"):
        return ModelConfig.from_pretrained(path)
    from specjax.weights import resolve_model_path
    return ModelConfig.from_pretrained(resolve_model_path(path, allow_patterns=("config.json",)))


@dataclasses.dataclass
class ExportOptions:
    ckpt: str = option(positional=True, help="training checkpoint dir (or one step folder in it), or an HF EAGLE3 "
                                             "head folder")
    out_dir: str = option(positional=True)
    target: str | None = option(None, help="target model folder / config.json (default: the one the checkpoint "
                                           "names)")
    dtype: str = option("bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the exported weights (default bfloat16, as published heads)")


@dataclasses.dataclass
class ImportOptions:
    src: str = option(positional=True, help="HF EAGLE3 head folder (config.json + safetensors)")
    out: str = option(positional=True, help="output folder")
    target: str = option("", required=True, help="target model folder / config.json the head belongs to")
    format: str = option("checkpoint", choices=("checkpoint", "hf"),
                         help="checkpoint: a training checkpoint (step 0, fp32 params) usable as head.init_from and "
                              "by export-head; hf: a normalised HF folder (no model. prefix, no embed_tokens)")


def _export_main(argv) -> int:
    a = parse_options(ExportOptions, argv, "python -m specjax.convert export-head",
                      "training checkpoint (or HF head folder) -> HF LlamaForCausalLMEagle3",
                      formatter_class=argparse.HelpFormatter)
    if _is_hf_head(a.ckpt):
        target_cfg = _target_config(a.target, "exporting an HF head folder")
        head_cfg, params, vmap = load_head(a.ckpt, target_cfg)
    else:
        from specjax.train.checkpoint import CheckpointError, load_head_for_export
        try:
            head_cfg, params, vmap, target_path = load_head_for_export(a.ckpt)
        except CheckpointError as e:
            raise HeadFormatError(str(e)) from None
        target_cfg = _target_config(a.target or target_path, f"checkpoint {a.ckpt} names no target model")
    hf = export_head(params, head_cfg, vmap, a.out_dir, target_cfg, dtype=a.dtype)
    print(f"exported {head_cfg.num_layers}-layer EAGLE3 head (hidden {head_cfg.hidden_size}, draft vocab "
          f"{head_cfg.draft_vocab_size}/{head_cfg.vocab_size}, aux layers {list(head_cfg.aux_layer_ids)}"
          f"{' written as eagle_config' if 'eagle_config' in hf else ' = default, not written'}, {a.dtype}) "
          f"to {a.out_dir}")
    return 0


def _import_main(argv) -> int:
    a = parse_options(ImportOptions, argv, "python -m specjax.convert import-head",
                      "published EAGLE3 head folder -> specjax head checkpoint", formatter_class=argparse.HelpFormatter)
    target_cfg = _target_config(a.target, "import-head")
    head_cfg, params, vmap = load_head(a.src, target_cfg)
    if a.format == "hf":
        export_head(params, head_cfg, vmap, a.out, target_cfg)
    else:
        from specjax.train import checkpoint as ck
        head32 = head_cfg.replace(dtype="float32")
        params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        target_path = os.path.abspath(a.target) if os.path.exists(a.target) else a.target
        if target_path.endswith(".json"):
            target_path = os.path.dirname(target_path)
        saver = ck.Checkpointer(a.out, keep=1, async_save=False)
        saver.save(0, params=params32, train={"step": jnp.zeros((), jnp.int32)}, vocab=vmap,
                   meta={"head_config": ck.head_config_to_dict(head32), "target_model_path": target_path,
                         "imported_from": os.path.abspath(a.src), "source_dtype": head_cfg.dtype}, wait=True)
        saver.close()
    print(f"imported {a.src} ({head_cfg.num_layers}-layer EAGLE3 head, draft vocab {head_cfg.draft_vocab_size}, "
          f"aux layers {list(head_cfg.aux_layer_ids)}) -> {a.out} ({a.format})")
    return 0


def main(command: str, argv) -> int:
    try:
        if command == "export-head":
            return _export_main(argv)
        if command == "import-head":
            return _import_main(argv)
    except HeadFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    raise SystemExit(f"unknown command {command!r}")


__all__ = ["export_head", "load_head", "head_to_hf", "check_head_matches_target", "check_vocab_map",
           "HeadFormatError", "main"]
