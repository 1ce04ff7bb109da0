"""Draft heads from HF folders: EAGLE3 (``LlamaForCausalLMEagle3``) and EAGLE-1/2 (``LlamaForCausalLMEagle``), and
``load_draft``, the one entry point the generator, the server and the benchmarks use. Export (and the convert CLI)
lives in ``specjax.convert.head``, on top of the key tables here.

EAGLE3 folder: ``config.json`` and safetensors holding these keys, stored ``[out, in]``:
``fc.weight``, ``midlayer.*`` (the first layer; extra layer i >= 1 is ``layers.{i}.*``), ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64 offsets) and ``t2d`` (bool). The importer accepts ``layers.0.*`` for the first
layer, strips a ``model.`` prefix, and accepts an ``embed_tokens.weight`` whose shape matches the target's embedding
(its values are ignored: engines, and specjax, use the target's own).
EAGLE folder: ``fc.*`` and ``layers.{i}.*`` in safetensors or ``pytorch_model*.bin`` (tensors only, ``torch_zip``).
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from specjax import torch_zip
from specjax.cli import check_output_folder, clear_previous
from specjax.config import DTYPES, ModelConfig, config_dtype, read_json
from specjax.models import eagle, eagle3
from specjax.models.eagle import EagleHeadError
from specjax.models.eagle3 import Eagle3Config, Eagle3Params, HeadLayerParams, VocabMap
from specjax.safetensors_io import CheckpointIndex, save_file
from specjax.weights import WeightsError, hub_snapshot, is_hub_id, on_device


class HeadFormatError(ValueError):
    """A head that does not match the EAGLE3 format or its target."""


def eagle1_refusal(path: str, why: str) -> HeadFormatError:
    """The one message for an EAGLE-1/2 head given where an EAGLE3 head is read (``why``: how it shows)."""
    return HeadFormatError(f"{path} is an EAGLE-1/2 head ({why}), not an EAGLE3 head (what import-head, export-head "
                           f"and --speculative-algorithm EAGLE3 take): serve an EAGLE head as it is with "
                           f"--speculative-algorithm EAGLE --speculative-draft-model-path {path}")


# ---- EAGLE3 key table ----------------------------------------------------------------------------------------------
IGNORED = [re.compile(p) for p in (r".*rotary_emb\.inv_freq$",)]


def layer_prefix(i: int) -> str:
    return "midlayer." if i == 0 else f"layers.{i}."


def layer_table(cfg: Eagle3Config, i: int):
    """HF suffix -> (HeadLayerParams field, HF shape, to_hf(param), from_hf(tensor)) for layer i."""
    h, f, n, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    din = 2 * h if i == 0 else h
    proj = lambda heads: (lambda w: w.reshape(din, heads * hd).T, lambda a: a.T.reshape(din, heads, hd))
    t = {
        "input_layernorm.weight": ("input_norm", (h,), lambda w: w, lambda a: a),
        "self_attn.q_proj.weight": ("wq", (n * hd, din), *proj(n)),
        "self_attn.k_proj.weight": ("wk", (k * hd, din), *proj(k)),
        "self_attn.v_proj.weight": ("wv", (k * hd, din), *proj(k)),
        "self_attn.o_proj.weight": ("wo", (h, n * hd), lambda w: w.reshape(n * hd, h).T,
                                    lambda a: a.T.reshape(n, hd, h)),
        "post_attention_layernorm.weight": ("post_norm", (h,), lambda w: w, lambda a: a),
        "mlp.gate_proj.weight": ("w_gate", (f, h), lambda w: w.T, lambda a: a.T),
        "mlp.up_proj.weight": ("w_up", (f, h), lambda w: w.T, lambda a: a.T),
        "mlp.down_proj.weight": ("w_down", (h, f), lambda w: w.T, lambda a: a.T),
    }
    if i == 0:
        t["hidden_norm.weight"] = ("hidden_norm", (h,), lambda w: w, lambda a: a)
    return t


def top_table(cfg: Eagle3Config):
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
    if head_cfg.hidden_size != target_cfg.hidden_size:
        raise HeadFormatError(
            f"head hidden_size={head_cfg.hidden_size} differs from the target's {target_cfg.hidden_size}: such a head "
            f"embeds tokens with an embedding of its own width, and specjax feeds every head the target's embedding; "
            f"only heads as wide as their target are supported")
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


# ---- EAGLE3 ----------------------------------------------------------------------------------------------------
def stored_matrix_dtype(a: np.ndarray, dtype) -> jnp.dtype:
    """The dtype a head tensor ``a`` (as read) is kept in when the head computes in ``dtype``: a bf16 matrix stays
    bf16 under fp32 (widening is exact, so every product is the fp32 one, from half the bytes: a draft step reads its
    matrices from memory, ``layers.dense``); everything else takes ``dtype``."""
    dtype = jnp.dtype(dtype)
    if a.ndim >= 2 and a.dtype == jnp.bfloat16 and dtype == jnp.float32:
        return jnp.dtype(jnp.bfloat16)
    return dtype


class _TorchTensors:
    """The tensors of ``pytorch_model*.bin`` files (the official EAGLE and EAGLE3 heads' format), read without
    PyTorch and without unpickling anything but tensors (``specjax.torch_zip``), behind CheckpointIndex's
    interface."""

    def __init__(self, folder: str, files: list[str], error: type[Exception]):
        self.t: dict[str, np.ndarray] = {}
        for f in files:
            try:
                self.t.update(torch_zip.load(os.path.join(folder, f)))
            except (torch_zip.TorchFileError, OSError) as e:
                raise error(str(e)) from None

    def keys(self) -> list[str]:
        return list(self.t)

    def shape(self, k: str) -> tuple[int, ...]:
        return tuple(self.t[k].shape)

    def dtype(self, k: str) -> np.dtype:
        return self.t[k].dtype

    def tensor(self, k: str) -> np.ndarray:
        return self.t[k]


def open_head_tensors(folder: str, error: type[Exception] = None):
    """The tensors of a head folder: its ``*.safetensors`` (a CheckpointIndex, read lazily), else its
    ``pytorch_model*.bin`` files; ``error`` (default HeadFormatError) when it has neither."""
    error = error or HeadFormatError
    files = sorted(os.listdir(folder))
    if any(f.endswith(".safetensors") for f in files):
        return CheckpointIndex(folder)
    bins = [f for f in files if f.startswith("pytorch_model") and f.endswith(".bin")]
    if not bins:
        raise error(f"{folder} has no *.safetensors or pytorch_model*.bin")
    return _TorchTensors(folder, bins, error)


def _vocab_tensors(ckpt, raw: dict[str, str], cfg: Eagle3Config, path: str) -> tuple[np.ndarray, np.ndarray, set]:
    """(d2t, t2d, keys used) of a head: both stored; t2d rebuilt from d2t where only d2t is (Model Optimizer's
    exports; SGLang and vLLM read d2t alone); the identity when the draft vocab is the target's and neither is."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" in raw:
        d2t = np.asarray(ckpt.tensor(raw["d2t"])).astype(np.int64)
        if "t2d" in raw:
            return d2t, np.asarray(ckpt.tensor(raw["t2d"])).astype(bool), {"d2t", "t2d"}
        ids = np.arange(d2t.shape[0]) + d2t
        if d2t.ndim != 1 or ids.min(initial=0) < 0 or ids.max(initial=0) >= v:
            raise HeadFormatError(f"head {path}: d2t maps draft ids outside the target vocab [0, {v})")
        t2d = np.zeros((v,), bool)
        t2d[ids] = True
        return d2t, t2d, {"d2t"}
    if vd == v and "t2d" not in raw:
        return np.zeros((vd,), np.int64), np.ones((v,), bool), set()
    raise HeadFormatError(f"head {path} has draft_vocab_size={vd} < vocab_size={v} but no d2t tensor")


def _head_config(path: str, target_cfg: ModelConfig, dtype: str | None) -> Eagle3Config:
    """The config of head folder ``path`` for ``target_cfg``, in ``dtype`` or else the dtype label of its
    config.json (``torch_dtype``, or ``dtype`` as transformers >= 4.56 writes it: ``config.config_dtype``, which
    refuses a label specjax does not know); a head that does not fit the target is refused."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise HeadFormatError(f"{path} is not an EAGLE3 head folder (config.json + *.safetensors or "
                              f"pytorch_model*.bin)")
    hf = eagle3.read_hf_config(path)
    if not isinstance(hf, dict):
        raise HeadFormatError(f"{path}/config.json is a JSON {type(hf).__name__}, not an object")
    try:
        label = config_dtype(hf, dtype, hint="fix the label (the head's weights keep the dtype they are stored in)")
        head_cfg = eagle3.config_from_hf(hf, target_cfg.num_layers, dtype=label)
    except KeyError as e:
        raise HeadFormatError(f"{path}/config.json lacks the field {e.args[0]!r}") from None
    except ValueError as e:
        raise HeadFormatError(f"{path}/config.json: {e}") from None
    check_head_matches_target(head_cfg, target_cfg)
    return head_cfg


def _head_tensors(path: str):
    """(the tensors of head folder ``path``, its key names with ``model.`` stripped and ``layers.0.`` read as
    ``midlayer.`` -> stored names); an EAGLE-1/2 head's tensors (fc with a bias, no hidden_norm) are refused."""
    ckpt = open_head_tensors(path)
    raw = {(k[len("model."):] if k.startswith("model.") else k): k for k in ckpt.keys()}
    if "midlayer.input_layernorm.weight" not in raw and "layers.0.input_layernorm.weight" in raw:
        raw = {(("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k): v for k, v in raw.items()}
    if "fc.bias" in raw and "midlayer.hidden_norm.weight" not in raw:
        raise eagle1_refusal(path, "its tensors: fc with a bias, a layer without hidden_norm")
    return ckpt, raw


_FLOATS = tuple(np.dtype(d) for d in (np.float16, jnp.bfloat16, np.float32, np.float64))


def _stored_dtype(ckpt, raw: dict[str, str], keys: list[str], path: str) -> str:
    """The dtype head weights ``keys`` are stored in, which import and export keep (the stored tensors are the
    truth, config.json's label only a hint): theirs when they share one of ``DTYPES``, else float32 (bf16 beside
    fp16: neither holds the other; float64: the widest specjax computes in). A weight stored as anything but a
    float (a quantized head) is refused."""
    found = set()
    for key in (k for k in keys if k in raw):
        dt = np.dtype(ckpt.dtype(raw[key]))
        if dt not in _FLOATS:
            raise HeadFormatError(f"head {path}: tensor {key!r} is stored as {dt}: specjax reads heads stored in "
                                  f"{', '.join(DTYPES)} (not quantized ones)")
        found.add(dt.name)
    return found.pop() if len(found) == 1 and found <= set(DTYPES) else "float32"


def load_eagle3_head(path: str, target_cfg: ModelConfig, dtype: str | None = None
              ) -> tuple[Eagle3Config, Eagle3Params, VocabMap]:
    """Read an HF EAGLE3 head folder (config.json + safetensors or pytorch_model*.bin; SpecForge / SGLang's layout,
    vLLM speculators', Model Optimizer's) for ``target_cfg``; params in ``dtype`` (default: the dtype its weights
    are stored in, ``_stored_dtype``, whatever config.json's label says: export -> import -> export is exact),
    except that bf16 matrices stay bf16 under fp32 (``stored_matrix_dtype``). Every tensor's shape is checked and
    every key must be used or known-ignorable."""
    head_cfg = _head_config(path, target_cfg, dtype)
    ckpt, raw = _head_tensors(path)
    tables = [("", top_table(head_cfg))] + [(layer_prefix(i), layer_table(head_cfg, i))
                                            for i in range(head_cfg.num_layers)]
    stored = _stored_dtype(ckpt, raw, [prefix + key for prefix, table in tables for key in table], path)
    if dtype is None:
        head_cfg = head_cfg.replace(dtype=stored)
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
        a = from_hf(np.asarray(ckpt.tensor(raw[key])))
        return on_device(a, stored_matrix_dtype(a, dt))

    top = {field: need(key, shape, from_hf) for key, (field, shape, _, from_hf) in top_table(head_cfg).items()}
    lays = []
    for i in range(head_cfg.num_layers):
        fields = {field: need(layer_prefix(i) + suffix, shape, from_hf)
                  for suffix, (field, shape, _, from_hf) in layer_table(head_cfg, i).items()}
        lays.append(HeadLayerParams(**fields))

    d2t, t2d, used = _vocab_tensors(ckpt, raw, head_cfg, path)
    consumed |= used
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
    return head_cfg, params, VocabMap(d2t=on_device(d2t, np.int32), t2d=on_device(t2d, bool))


# ---- EAGLE ------------------------------------------------------------------------------------------------------
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TOLERATED = ("embed_tokens.weight", "lm_head.weight")  # engines use the target's embedding and lm_head


def _read_tensors(folder: str) -> dict[str, np.ndarray]:
    """All tensors of an EAGLE head folder (``open_head_tensors``)."""
    src = open_head_tensors(folder, EagleHeadError)
    return {k: np.asarray(src.tensor(k)) for k in src.keys()}


def params_from_hf(tensors: dict[str, np.ndarray], cfg: eagle.EagleConfig) -> eagle.EagleParams:
    """HF tensors (``fc.*``, ``layers.{i}.*``; a ``model.`` prefix is stripped) -> eagle.EagleParams; shapes asserted,
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

    put = lambda a: on_device(a, dt)
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
        lays.append(HeadLayerParams(
            input_norm=in_norm,
            wq=put(need(p + "self_attn.q_proj.weight", (n * hd, h)).T.reshape(h, n, hd)),
            wk=put(need(p + "self_attn.k_proj.weight", (kh * hd, h)).T.reshape(h, kh, hd)),
            wv=put(need(p + "self_attn.v_proj.weight", (kh * hd, h)).T.reshape(h, kh, hd)),
            wo=put(need(p + "self_attn.o_proj.weight", (h, n * hd)).T.reshape(n, hd, h)),
            post_norm=put(need(p + "post_attention_layernorm.weight", (h,))),
            w_gate=put(need(p + "mlp.gate_proj.weight", (f, h)).T), w_up=put(need(p + "mlp.up_proj.weight", (f, h)).T),
            w_down=put(need(p + "mlp.down_proj.weight", (h, f)).T)))
    for key in _TOLERATED:  # unused, but a table of another vocab or width names another target's head
        if key in t and (np.ndim(t[key]) != 2 or np.shape(t[key])[0] != cfg.vocab_size or np.shape(t[key])[1] != h):
            raise EagleHeadError(f"EAGLE head tensor {key!r} has shape {np.shape(t[key])}, expected "
                                 f"{(cfg.vocab_size, h)} (vocab_size x hidden_size): another target's head?")
    left = sorted(k for k in t if k not in used and not k.endswith(_IGNORED_SUFFIXES) and k not in _TOLERATED)
    if left:
        raise EagleHeadError(f"EAGLE head has tensors the architecture does not use: {left[:8]}")
    return eagle.EagleParams(fc=fc, fc_bias=fc_b, layers=lays)


def params_to_hf(params: eagle.EagleParams, cfg: eagle.EagleConfig) -> dict[str, np.ndarray]:
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


def load_eagle_head(folder: str, dtype: str | None = None) -> tuple[eagle.EagleConfig, eagle.EagleParams]:
    """(eagle.EagleConfig, eagle.EagleParams) from an HF folder (config.json + safetensors or pytorch_model.bin)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise EagleHeadError(f"no config.json in EAGLE head folder {folder}")
    try:
        cfg = eagle.config_from_hf(read_json(cfg_path), dtype=dtype)
    except KeyError as e:
        raise EagleHeadError(f"{cfg_path} lacks the field {e.args[0]!r}") from None
    return cfg, params_from_hf(_read_tensors(folder), cfg)


def load_token_map(path: str, vocab_size: int | None = None) -> np.ndarray:
    """FR-Spec hot-token ids i32[Vd] from a .json list, a .npy array, or a torch file (``torch_zip``: tensors and
    lists only, never unrestricted unpickling)."""
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
        try:
            ids = np.asarray(torch_zip.load_object(path))
        except torch_zip.TorchFileError as e:
            raise EagleHeadError(f"token map: {e}") from None
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise EagleHeadError(f"token map {path} must be a non-empty 1-D list of integer token ids, got dtype "
                             f"{ids.dtype} shape {ids.shape}")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise EagleHeadError(f"token map {path} has ids outside [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise EagleHeadError(f"token map {path} repeats token ids")
    return ids.astype(np.int32)


# ---- either head -------------------------------------------------------------------------------------------------
def check_token_map_use(algorithm: str | None, token_map: str | None) -> str | None:
    """An FR-Spec token map (``--speculative-token-map``) belongs to an EAGLE head. With EAGLE3 it is ignored, as
    SGLang ignores it (the head carries its own vocab map): returns that one-line notice. Without a speculative
    algorithm (plain decoding has no draft) it is refused, as the tree flags are."""
    algorithm = (algorithm or "").upper()
    if token_map is None or algorithm == "EAGLE":
        return None
    if algorithm == "EAGLE3":
        return ("--speculative-token-map is ignored with EAGLE3: the head carries its own vocab map (d2t/t2d), as "
                "SGLang ignores it")
    raise ValueError("--speculative-token-map is for EAGLE heads (--speculative-algorithm EAGLE); plain decoding has "
                     "no draft")


def resolve_head_path(path: str) -> str:
    """A head's local folder: ``path`` itself, or, for a Hugging Face hub id (``owner/name``, no such local path),
    its files downloaded into the hub cache (as SGLang and vLLM take ``--speculative-draft-model-path``)."""
    if not is_hub_id(path):
        return os.path.expanduser(path)
    try:
        return hub_snapshot(path, ("*.json", "*.safetensors", "pytorch_model*.bin"))
    except WeightsError as e:
        raise HeadFormatError(f"{path!r} is no local head folder and the Hugging Face hub could not provide it "
                              f"({e}): pass the head's local folder") from None


def load_draft(path: str, algorithm: str, target_cfg: ModelConfig, token_map: str | None = None,
               dtype: str | None = None):
    """(draft_cfg, draft_params, vocab) from an HF head folder. vocab: EAGLE3 -> eagle3.VocabMap (from the head's
    d2t/t2d); EAGLE -> hot-token ids from ``token_map`` (``--speculative-token-map``) or None."""
    algorithm = algorithm.upper()
    dtype = dtype or target_cfg.dtype
    check_token_map_use(algorithm, token_map)
    path = resolve_head_path(path)
    if algorithm == "EAGLE3":
        return load_eagle3_head(path, target_cfg=target_cfg, dtype=dtype)
    if algorithm == "EAGLE":
        cfg, params = load_eagle_head(path, dtype=dtype)
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {cfg.hidden_size} != target hidden_size "
                             f"{target_cfg.hidden_size}")
        if cfg.vocab_size != target_cfg.vocab_size:  # the head reads the target's embedding and lm_head
            raise EagleHeadError(f"EAGLE head {path} has vocab_size={cfg.vocab_size} but the target's vocab is "
                                 f"{target_cfg.vocab_size}: this head was trained for another target")
        ids = load_token_map(token_map, target_cfg.vocab_size) if token_map else None
        return cfg, params, ids
    raise ValueError(f"unknown speculative algorithm {algorithm!r}; expected EAGLE3 or EAGLE")


# ---- export (the HF LlamaForCausalLMEagle3 format) ---------------------------------------------------------------
HF_HEAD_FILES = ("model.safetensors", "config.json")  # what export_head writes (config.json last)
HF_HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"  # eagle3.config_to_hf's


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


def head_to_hf(head_params: Eagle3Params, head_cfg: Eagle3Config, vocab_map: VocabMap,
               dtype: str | None = None) -> dict[str, np.ndarray]:
    """HF key -> numpy tensor ([out, in], in ``dtype``, default head_cfg.dtype), plus d2t (int64) and t2d (bool)."""
    dt = jnp.dtype(dtype or head_cfg.dtype)
    conv = lambda x: np.asarray(jnp.asarray(x).astype(dt))
    out: dict[str, np.ndarray] = {}
    for key, (field, shape, to_hf, _) in top_table(head_cfg).items():
        out[key] = np.ascontiguousarray(to_hf(conv(getattr(head_params, field))))
    for i, lp in enumerate(head_params.layers):
        for suffix, (field, shape, to_hf, _) in layer_table(head_cfg, i).items():
            out[layer_prefix(i) + suffix] = np.ascontiguousarray(to_hf(conv(getattr(lp, field))))
    out["d2t"] = np.asarray(vocab_map.d2t).astype(np.int64)
    out["t2d"] = np.asarray(vocab_map.t2d).astype(np.bool_)
    return out


def export_head(head_params: Eagle3Params, head_cfg: Eagle3Config, vocab_map: VocabMap, out_dir: str,
                target_cfg: ModelConfig, *, dtype: str | None = None, log=print) -> dict:
    """Write ``out_dir/{config.json, model.safetensors}`` in the LlamaForCausalLMEagle3 format. Weights are stored
    in ``dtype`` (default head_cfg.dtype; the config's torch_dtype says which). ``out_dir`` must be new, empty or
    hold only an earlier export (``check_output_folder``), which is replaced. Returns the config dict."""
    previous = check_output_folder(out_dir, "export", HF_HEAD_FILES, HF_HEAD_ARCHITECTURE)
    check_head_matches_target(head_cfg, target_cfg)
    _check_params(head_params, head_cfg)
    check_vocab_map(np.asarray(vocab_map.d2t), np.asarray(vocab_map.t2d), head_cfg)
    dtype = dtype or head_cfg.dtype
    tensors = head_to_hf(head_params, head_cfg, vocab_map, dtype)
    _check_finite(tensors, dtype)
    hf = eagle3.config_to_hf(head_cfg.replace(dtype=dtype), target_num_layers=target_cfg.num_layers)
    os.makedirs(out_dir, exist_ok=True)
    if previous:
        clear_previous(out_dir, log)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "config.json"))
    return hf


def is_hf_eagle3_head(path: str) -> bool:
    """An HF head folder (rather than a training checkpoint, which has no config.json): what ``load_eagle3_head``
    reads, whatever its ``architectures`` say (none, ``LlamaForCausalLM``, an EAGLE3 name), and what it then
    refuses with a message (an EAGLE-1/2 head, another architecture, a damaged config.json)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
