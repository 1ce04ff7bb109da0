"""GGUF (llama.cpp) file -> Hugging Face folder that ``specjax.weights.load_model`` and transformers both load.

    python -m specjax.convert gguf SRC.gguf OUT_DIR [--dtype float32|bfloat16]

Writes config.json (LlamaForCausalLM), model.safetensors, tokenizer.json, tokenizer_config.json,
special_tokens_map.json and generation_config.json into a new or empty folder, or over a previous conversion
(``cli.check_output_folder``: the one check of the convert commands' output folders, export-head's and
import-head's too).

Weights: every tensor is dequantised with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0/1, K-quants, ...)
and stored as float32 by default. float32 is the lossless choice: a dequantised Q4_1 value ``d * q + m`` (fp16 d, m;
4-bit q) needs more mantissa than bfloat16 has, so a bf16 folder would no longer be the model in the file. Pass
``--dtype bfloat16`` for a half-size folder (rounding error ~2^-9 relative per weight).

q/k projections: llama.cpp's converter permutes the rows of every head of attn_q / attn_k so that its interleaved
(GPT-J style) RoPE pairs dims (2i, 2i+1). HF Llama and specjax use rotate-half RoPE, which pairs (i, i + H/2); we
apply the inverse permutation so that the folder is an ordinary HF checkpoint.

Tokenizer: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) rebuilt with the ``tokenizers`` library from the
vocabulary, merges and token types in the file. The pre-tokenizer follows ``tokenizer.ggml.pre``: "smollm" splits
every digit on its own before the GPT-2 regex, as HF's SmolLM2 tokenizer does (Digits(individual_digits) +
ByteLevel). Control / user-defined tokens become added (special) tokens, so chat markers encode to one id each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from specjax.cli import OutputFolderError, check_output_folder, clear_previous, option, parse_options
from specjax.safetensors_io import save_file

LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# llama.cpp token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


class GGUFConvertError(ValueError):
    """A GGUF file that this converter cannot turn into a faithful HF folder."""


# the files ``convert`` writes (config.json last: its presence marks a complete folder)
HF_MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "generation_config.json", "config.json")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows [n_heads * H, in] from interleaved-RoPE to rotate-half order.

    llama.cpp: ``w.reshape(n, 2, H//2, in).swapaxes(1, 2)`` -> row (h, i, j) holds HF row (h, j, i).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's own ``permute`` (HF rotate-half -> GGUF interleaved); used by tests to write GGUF files."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Metadata:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def require(self, key):
        v = self.get(key)
        if v is None:
            raise GGUFConvertError(f"GGUF metadata lacks {key!r}")
        return v


def hf_config(md: _Metadata, has_output: bool, dtype: str) -> dict:
    """LlamaForCausalLM config.json fields from ``general.architecture == "llama"`` metadata."""
    arch = md.require("general.architecture")
    if arch != "llama":
        raise GGUFConvertError(f"general.architecture={arch!r}: only 'llama' GGUF files are supported")
    p = "llama."
    hidden = int(md.require(p + "embedding_length"))
    heads = int(md.require(p + "attention.head_count"))
    kv_heads = int(md.get(p + "attention.head_count_kv", heads))
    head_dim = int(md.get(p + "attention.key_length", hidden // heads))
    rope_dim = md.get(p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise GGUFConvertError(f"partial rotary (rope.dimension_count={rope_dim}, head_dim={head_dim}) unsupported")
    if md.get(p + "expert_count"):
        raise GGUFConvertError("mixture-of-experts GGUF files are not supported")
    vocab = md.get(p + "vocab_size")
    if vocab is None:
        vocab = len(md.require("tokenizer.ggml.tokens"))
    rope_scaling = None
    stype = md.get(p + "rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise GGUFConvertError(f"rope scaling type {stype!r} is not supported")
        rope_scaling = {"rope_type": "linear", "factor": float(md.require(p + "rope.scaling.factor"))}
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(md.require(p + "feed_forward_length")),
        "num_hidden_layers": int(md.require(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(md.get(p + "context_length", 2048)),
        "rms_norm_eps": float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(md.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": not has_output,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    # float32 on the way out of the GGUF reader; round the eps the way it was written (1e-5, not 9.99999974e-06).
    cfg["rms_norm_eps"] = float(np.format_float_positional(np.float32(cfg["rms_norm_eps"]), unique=True))
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        v = md.get(key)
        if v is not None:
            cfg[name] = int(v)
    return cfg


def convert_weights(reader, cfg: dict, dtype: str, log=print) -> dict[str, np.ndarray]:
    """HF-named, dequantised tensors ([out, in] like torch Linear) with q/k rows in rotate-half order."""
    import ml_dtypes
    from gguf.quants import dequantize

    out_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name in TOP_NAMES:
            hf = TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in LAYER_NAMES:
                raise GGUFConvertError(f"unexpected tensor {name!r} (a llama GGUF has {sorted(LAYER_NAMES)})")
            hf = f"model.layers.{int(idx)}.{LAYER_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise GGUFConvertError("rope_freqs.weight (Llama-3.1 rope scaling factors) is not supported: the HF "
                                   "rope_scaling parameters cannot be recovered from it")
        else:
            raise GGUFConvertError(f"unexpected tensor {name!r}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # numpy order = HF order
        expect = tuple(int(s) for s in reversed(t.shape))
        if w.shape != expect:
            w = w.reshape(expect)
        if rest_is(hf, "q_proj"):
            w = unpermute_qk(w, heads)
        elif rest_is(hf, "k_proj"):
            w = unpermute_qk(w, kv_heads)
        tensors[hf] = w.astype(out_dt)
    log(f"  dequantised {len(tensors)} tensors ({sum(a.size for a in tensors.values()) / 1e6:.1f}M params)")
    return tensors


def rest_is(hf_name: str, proj: str) -> bool:
    return hf_name.endswith(f"self_attn.{proj}.weight")


def _pre_tokenizer(pre: str):
    """The pre-tokenizer that llama.cpp's ``tokenizer.ggml.pre`` name stands for."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm",):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("default", "gpt-2", "gpt2", "starcoder", "refact"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"), byte_level])
    if pre in ("qwen2",):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"), byte_level])
    raise GGUFConvertError(f"tokenizer.ggml.pre={pre!r} is not supported (smollm, gpt-2, llama-bpe, qwen2)")


def build_tokenizer(md: _Metadata):
    """(tokenizers.Tokenizer, tokenizer_config dict, special_tokens_map dict) from the ``tokenizer.ggml.*`` fields."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = md.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConvertError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') is supported")
    tokens = [str(t) for t in md.require("tokenizer.ggml.tokens")]
    merges_raw = md.get("tokenizer.ggml.merges") or []
    types = md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = []
    for m in merges_raw:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise GGUFConvertError(f"malformed merge {m!r}")
        merges.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConvertError("duplicate tokens in tokenizer.ggml.tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(md.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if int(ty) in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            added.append(AddedToken(t, special=int(ty) != TOKEN_USER_DEFINED, normalized=False))
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])

    def tok_of(key):
        v = md.get(key)
        return tokens[int(v)] if v is not None and 0 <= int(v) < len(tokens) else None

    bos, eos, pad, unk = (tok_of(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown"))
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        special = [(t, vocab[t]) for t in dict.fromkeys(([bos] if add_bos else []) + ([eos] if add_eos else []))]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special_map = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad),
                                     ("unk_token", unk)) if v is not None}
    extra = [a.content for a in added if a.special and a.content not in special_map.values()]
    if extra:
        special_map["additional_special_tokens"] = extra
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length", 2048) or 2048),
        **special_map,
        "added_tokens_decoder": {str(vocab[a.content]): {"content": a.content, "special": a.special,
                                                         "normalized": False, "lstrip": False, "rstrip": False,
                                                         "single_word": False} for a in added},
    }
    tmpl = md.get("tokenizer.chat_template")
    if tmpl:
        tok_cfg["chat_template"] = str(tmpl)
    return tok, tok_cfg, special_map


def read_gguf(path: str):
    """``gguf.GGUFReader`` over ``path``; a file it cannot parse (not a GGUF, truncated, damaged) is a
    ``GGUFConvertError`` that names it."""
    from gguf import GGUFReader  # optional dependency (the llamacpp / gguf extras)

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises whatever its parser hit (IndexError, ValueError ...)
        raise GGUFConvertError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def convert(src: str, out_dir: str, dtype: str = "float32", log=print) -> str:
    """Convert ``src`` (.gguf) into the HF folder ``out_dir``; returns ``out_dir``."""
    if dtype not in ("float32", "bfloat16"):
        raise GGUFConvertError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    if not os.path.isfile(src):
        raise GGUFConvertError(f"no GGUF file at {src}")
    previous = check_output_folder(out_dir, "convert", HF_MODEL_FILES, "LlamaForCausalLM")
    t0 = time.time()
    log(f"reading {src}")
    reader = read_gguf(src)
    md = _Metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = hf_config(md, has_output="output.weight" in names, dtype=dtype)
    log(f"  llama: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}"
        f"/{cfg['num_key_value_heads']}, vocab {cfg['vocab_size']}, tied={cfg['tie_word_embeddings']}")
    tensors = convert_weights(reader, cfg, dtype, log)
    _check_complete(tensors, cfg)
    tok, tok_cfg, special_map = build_tokenizer(md)
    if tok.get_vocab_size(with_added_tokens=True) != cfg["vocab_size"]:
        log(f"  note: tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, model vocab "
            f"{cfg['vocab_size']}")

    os.makedirs(out_dir, exist_ok=True)
    if previous:
        clear_previous(out_dir, log)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    for fn, obj in (("tokenizer_config.json", tok_cfg), ("special_tokens_map.json", special_map),
                    ("generation_config.json", gen)):
        with open(os.path.join(out_dir, fn), "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
    # config.json last: its presence marks a complete folder (fetch_smollm2 relies on this).
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    log(f"wrote {out_dir} ({dtype}) in {time.time() - t0:.1f}s")
    return out_dir


def write_dequantized(src: str, dst: str, dtype: str = "float32", log=print) -> str:
    """A GGUF of the same model with every tensor dequantised to float32 (or rounded to bfloat16), metadata copied:
    llama.cpp then runs exactly the weights ``convert`` gives specjax (the comparison of ``bench decode --vs
    llama.cpp``). Tensors keep llama.cpp's own layout (its q/k row order included). Written atomically."""
    import gguf

    qtype = {"float32": gguf.GGMLQuantizationType.F32, "bfloat16": gguf.GGMLQuantizationType.BF16}.get(dtype)
    if qtype is None:
        raise GGUFConvertError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    reader = read_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header fields; the file type changes below
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if dtype == "bfloat16" and x.ndim > 1:  # llama.cpp keeps norms in f32
            writer.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    log(f"wrote {dst} ({dtype}, {len(reader.tensors)} tensors)")
    return dst


def _check_complete(tensors: dict, cfg: dict) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{v}" for i in range(cfg["num_hidden_layers"]) for v in LAYER_NAMES.values()]
    missing = [k for k in need if k not in tensors]
    if missing:
        raise GGUFConvertError(f"GGUF file lacks tensors: {missing[:6]}{' ...' if len(missing) > 6 else ''}")


@dataclasses.dataclass
class GGUFOptions:
    src: str = option(positional=True, help="path to the .gguf file")
    out_dir: str = option(positional=True, help="output folder")
    dtype: str = option("float32", choices=("float32", "bfloat16"),
                        help="storage dtype of the dequantised weights (float32 is lossless)")


def main(command: str, argv: list[str]) -> int:
    args = parse_options(GGUFOptions, argv, f"python -m specjax.convert {command}",
                         "Convert a llama GGUF file into an HF folder (float32 by default).",
                         formatter_class=argparse.HelpFormatter)
    try:
        convert(args.src, args.out_dir, args.dtype)
    except (GGUFConvertError, OutputFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
