"""EAGLE3 heads in the HF ``LlamaForCausalLMEagle3`` format (docs/08-eagle-reference.md section 1), both ways.

    python -m specjax.convert export-head CKPT OUT_DIR [--target MODEL] [--dtype bfloat16|float16|float32]
    python -m specjax.convert import-head SRC OUT --target MODEL [--format checkpoint|hf]

OUT_DIR (and OUT of ``--format hf``) must be new, empty, or hold only an earlier export (config.json and
model.safetensors of an EAGLE3 head), which is replaced; a checkpoint is imported into a new or empty folder only.
A head keeps the dtype its weights are stored in (config.json's ``torch_dtype`` / ``dtype`` label is only a hint,
and must be float32, bfloat16 or float16): ``import-head`` records it (``source_dtype``) and ``export-head``
writes it by default, so that an fp16 or fp32 head goes through import -> export bit for bit; a trained
checkpoint exports in bfloat16 unless ``--dtype`` says otherwise.

Library (core, ``specjax.head_weights``, with the key table both use; re-exported here): ``export_head(head_params,
head_cfg, vocab_map, out_dir, target_cfg)`` and ``load_eagle3_head(path, target_cfg, dtype=None) -> (head_cfg,
head_params, vocab_map)``; export -> load is exact.

The folder holds ``config.json`` and one ``model.safetensors`` with the keys of docs/08 section 1, stored ``[out, in]``:
``fc.weight``, ``midlayer.*`` (the first layer), ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets)
and ``t2d`` (bool), and no ``embed_tokens`` (engines copy the target's). Aux layer ids: the default
{1, L//2-1, L-4} writes no ``eagle_aux_hidden_state_layer_ids``; other ids are written as
``eagle_config.eagle_aux_hidden_state_layer_ids`` in the TRAINING convention (output of layer id, 0-based), and
read back the same way.

Heads with more than one layer (``num_hidden_layers`` > 1; SGLang names extra layers otherwise and would drop
these): the first layer stays
``midlayer.*`` and extra layer i (i >= 1) is ``layers.{i}.*``, a plain Llama decoder layer over H, the names vLLM's
multi-layer EAGLE3 uses (it reads ``midlayer.`` as ``layers.0.``). The importer accepts ``layers.0.*`` for the
first layer too, strips a ``model.`` prefix, and accepts an ``embed_tokens.weight`` whose shape matches the
target's embedding (its values are ignored: engines, and specjax, use the target's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from specjax.cli import OutputFolderError, check_output_folder, error_text, option, parse_options
from specjax.config import ModelConfig, config_architectures
from specjax.head_weights import (HF_HEAD_ARCHITECTURE, HF_HEAD_FILES, HeadFormatError, eagle1_refusal, export_head,
                                  is_hf_eagle3_head, load_eagle3_head)
from specjax.models import eagle3
from specjax.weights import is_hub_id, resolve_model_path

# ---- command line ----------------------------------------------------------------------------------------------
def _refuse_eagle1(path: str) -> None:
    """An EAGLE-1/2 head folder is refused saying what to do with it (these commands convert EAGLE3 heads); one
    whose config names no EAGLE-1/2 architecture is refused by its tensors as it loads (``head_weights``)."""
    archs = config_architectures(path)
    eagle1 = [a for a in archs if a in eagle3.EAGLE_ARCHITECTURES]
    if eagle1:
        raise eagle1_refusal(path, eagle1[0])


def _target_config(path: str | None, what: str) -> ModelConfig:
    if not path:
        raise HeadFormatError(f"{what}: pass --target (the target model folder or its config.json)")
    if os.path.isdir(path) or path.endswith(".json"):
        return ModelConfig.from_pretrained(path)
    return ModelConfig.from_pretrained(resolve_model_path(path, allow_patterns=("config.json",)))


def _recorded_target(ckpt: str, recorded: str) -> ModelConfig:
    """The target a checkpoint recorded (``target_model_path``), or a message that says where that path came from
    and that ``--target`` replaces it (the folder moved, another machine, a hub id not in reach)."""
    fix = "pass --target MODEL (the target's folder or config.json where it is now)"
    if not recorded:
        raise HeadFormatError(f"checkpoint {ckpt} names no target model: {fix}")
    if not is_hub_id(recorded) and "://" not in recorded and not os.path.exists(os.path.expanduser(recorded)):
        raise HeadFormatError(f"checkpoint {ckpt} recorded its target model as {recorded}, which does not exist "
                              f"(moved or deleted?): {fix}")
    try:
        return _target_config(recorded, "")
    except (ValueError, OSError) as e:
        raise HeadFormatError(f"checkpoint {ckpt} recorded its target model as {recorded}, which cannot be read "
                              f"({error_text(e)}): {fix}") from None


OUT_RULE = "new, empty, or holding only an earlier export (config.json + model.safetensors), which is replaced"


@dataclasses.dataclass
class ExportOptions:
    ckpt: str = option(positional=True, help="training checkpoint dir (or one step folder in it), or an HF EAGLE3 "
                                             "head folder (config.json + model.safetensors or pytorch_model.bin)")
    out_dir: str = option(positional=True, help=f"output folder: {OUT_RULE}")
    target: str | None = option(None, help="target model folder / config.json (default: the one a training "
                                           "checkpoint recorded; required for an HF head folder, which records none)")
    dtype: str | None = option(None, choices=("bfloat16", "float16", "float32"),
                               help="dtype of the exported weights (default: the head's own, so that import-head -> "
                                    "export-head is exact: an HF head folder's stored dtype, an imported "
                                    "checkpoint's source dtype; bfloat16, as published heads, for a trained one)")


@dataclasses.dataclass
class ImportOptions:
    src: str = option(positional=True, help="HF EAGLE3 head folder (config.json + model.safetensors or "
                                            "pytorch_model.bin)")
    out: str = option(positional=True, help="output folder: new or empty; with --format hf also one holding only an "
                                            "earlier export (config.json + model.safetensors), which is replaced")
    target: str = option("", required=True, help="target model folder / config.json the head belongs to")
    format: str = option("checkpoint", choices=("checkpoint", "hf"),
                         help="checkpoint: a training checkpoint (step 0, fp32 params) usable as head.init_from and "
                              "by export-head; hf: a normalised HF folder (no model. prefix, no embed_tokens), "
                              "weights in the dtype they are stored in")


def _export_main(argv) -> int:
    a = parse_options(ExportOptions, argv, "python -m specjax.convert export-head",
                      "training checkpoint (or HF head folder) -> HF LlamaForCausalLMEagle3",
                      formatter_class=argparse.HelpFormatter)
    check_output_folder(a.out_dir, "export", HF_HEAD_FILES, HF_HEAD_ARCHITECTURE)  # said before anything loads
    if os.path.isfile(a.ckpt):
        raise HeadFormatError(f"{a.ckpt} is a file: pass a training checkpoint folder (or one step folder in it) or "
                              f"an HF EAGLE3 head folder")
    _refuse_eagle1(a.ckpt)
    if is_hf_eagle3_head(a.ckpt):
        target_cfg = _target_config(a.target, "exporting an HF head folder")
        head_cfg, params, vmap = load_eagle3_head(a.ckpt, target_cfg)
        dtype = a.dtype or head_cfg.dtype  # the dtype it is stored in
    else:
        from specjax.train.checkpoint import CheckpointError, load_head_checkpoint
        try:
            head_cfg, params, vmap, meta = load_head_checkpoint(a.ckpt)
        except (CheckpointError, OSError) as e:
            raise HeadFormatError(error_text(e)) from None
        target_cfg = (_target_config(a.target, "") if a.target else
                      _recorded_target(a.ckpt, meta.get("target_model_path", "")))
        dtype = a.dtype or meta.get("source_dtype") or "bfloat16"
    hf = export_head(params, head_cfg, vmap, a.out_dir, target_cfg, dtype=dtype)
    print(f"exported {head_cfg.num_layers}-layer EAGLE3 head (hidden {head_cfg.hidden_size}, draft vocab "
          f"{head_cfg.draft_vocab_size}/{head_cfg.vocab_size}, aux layers {list(head_cfg.aux_layer_ids)}"
          f"{' written as eagle_config' if 'eagle_config' in hf else ' = default, not written'}, {dtype}) "
          f"to {a.out_dir}")
    return 0


def _import_main(argv) -> int:
    a = parse_options(ImportOptions, argv, "python -m specjax.convert import-head",
                      "published EAGLE3 head folder -> specjax head checkpoint", formatter_class=argparse.HelpFormatter)
    # a checkpoint folder is never written over (orbax would resume in it); an HF folder as export-head's
    check_output_folder(a.out, "import", HF_HEAD_FILES if a.format == "hf" else (), HF_HEAD_ARCHITECTURE)
    _refuse_eagle1(a.src)
    target_cfg = _target_config(a.target, "import-head")
    head_cfg, params, vmap = load_eagle3_head(a.src, target_cfg)
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
          f"aux layers {list(head_cfg.aux_layer_ids)}, stored in {head_cfg.dtype}) -> {a.out} ({a.format})")
    return 0


def main(command: str, argv) -> int:
    try:
        if command == "export-head":
            return _export_main(argv)
        if command == "import-head":
            return _import_main(argv)
    except (HeadFormatError, OutputFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    raise SystemExit(f"unknown command {command!r}")


__all__ = ["export_head", "head_to_hf", "HeadFormatError", "main"]
