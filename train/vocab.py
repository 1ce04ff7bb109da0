"""Draft vocabulary: the Vd most frequent target token ids at loss-masked positions of the training set.

    python -m specjax.train.vocab --config configs/qwen2.5-7b.yaml --out vocab.npz [--dotted.overrides]

Rule (docs/08-eagle-reference.md section 3): count target ids where loss_mask == 1 over the WHOLE training split;
keep the Vd most frequent (ties: smaller id first); sort by id; ``d2t[i] = used[i] - i``; ``t2d[j] = j in used``;
if fewer than Vd distinct ids occur, fill with the smallest unused ids. Saved as .npz (default) or .safetensors
with ``d2t`` (i64[Vd]) and ``t2d`` (bool[V]), the same tensor names as published EAGLE3 heads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from specjax.cli import check_output_file, error_text, from_namespace, option, options_parser
from specjax.config import ModelConfig
from specjax.models.eagle3 import VocabMap
from specjax.train import data as data_lib
from specjax.train.config import add_override_options, config_from_command_line
from specjax.weights import resolve_model_path


def count_tokens(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """i64[V] counts of token ids at positions where loss_mask is set."""
    ids = np.asarray(tokens)[np.asarray(loss_mask).astype(bool)]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}; is the tokenizer "
                         f"the target's?")
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Sorted i64[Vd] target ids of the draft vocab."""
    counts = np.asarray(counts)
    v = len(counts)
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, vocab_size={v}]")
    seen = np.nonzero(counts > 0)[0]
    # most frequent first; stable sort on -count keeps ascending id order among ties
    order = seen[np.argsort(-counts[seen], kind="stable")]
    used = order[:draft_vocab_size]
    if len(used) < draft_vocab_size:
        unused = np.setdiff1d(np.arange(v), used, assume_unique=True)
        used = np.concatenate([used, unused[:draft_vocab_size - len(used)]])
    return np.sort(used).astype(np.int64)


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> VocabMap:
    return VocabMap.from_used_ids(select_draft_ids(counts, draft_vocab_size), len(counts))


def widen_vocab_map(vm: VocabMap, counts: np.ndarray, draft_vocab_size: int) -> VocabMap:
    """``vm``'s draft vocab grown to ``draft_vocab_size`` ids: every id it has, then the most frequent other ids of
    ``counts`` (ties: smaller id first), then the smallest unused ids if too few others occur."""
    old = np.asarray(vm.draft_to_target(np.arange(len(vm.d2t))), np.int64)
    counts = np.asarray(counts)
    if not len(old) < draft_vocab_size <= len(counts):
        raise ValueError(f"a draft vocab of {len(old)} ids can only grow to a size in ({len(old)}, "
                         f"{len(counts)}], not {draft_vocab_size}")
    rest = counts.astype(np.int64)
    rest[old] = -1  # never taken again: below every unseen id
    extra = np.argsort(-rest, kind="stable")[:draft_vocab_size - len(old)]
    return VocabMap.from_used_ids(np.concatenate([old, extra]), len(counts))


def vocab_map_to_numpy(vm: VocabMap) -> dict[str, np.ndarray]:
    return {"d2t": np.asarray(vm.d2t).astype(np.int64), "t2d": np.asarray(vm.t2d).astype(bool)}


def vocab_map_from_numpy(d2t, t2d) -> VocabMap:
    import jax.numpy as jnp
    d2t, t2d = np.asarray(d2t), np.asarray(t2d).astype(bool)
    used = d2t + np.arange(len(d2t))
    if int(t2d.sum()) != len(d2t) or not t2d[used].all():
        raise ValueError("vocab map is inconsistent: d2t and t2d name different draft vocabularies")
    return VocabMap(d2t=jnp.asarray(d2t, jnp.int32), t2d=jnp.asarray(t2d))


def save_vocab_map(path: str, vm: VocabMap, counts: np.ndarray | None = None) -> None:
    if not path.endswith((".npz", ".safetensors")):
        raise ValueError(f"vocab map file {path}: name it .npz or .safetensors (the format follows the name)")
    arrs = vocab_map_to_numpy(vm)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        from safetensors.numpy import save_file
        save_file(arrs, path)
    else:
        if counts is not None:
            arrs["counts"] = np.asarray(counts, np.int64)
        tmp = path + ".tmp.npz"
        np.savez(tmp, **arrs)
        os.replace(tmp, path)


def load_vocab_map(path: str) -> VocabMap:
    """From .npz / .safetensors with d2t and t2d (a published head's model.safetensors works too)."""
    if not os.path.isfile(path):
        raise ValueError(f"vocab map {path} does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, "np") as f:
                if not {"d2t", "t2d"} <= set(f.keys()):
                    raise ValueError("no d2t/t2d tensors")
                return vocab_map_from_numpy(f.get_tensor("d2t"), f.get_tensor("t2d"))
        with np.load(path, allow_pickle=False) as z:
            return vocab_map_from_numpy(z["d2t"], z["t2d"])
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and why
        raise ValueError(f"vocab map {path} cannot be read as a .npz or .safetensors file with d2t and t2d "
                         f"({type(e).__name__}: {e})") from None


def load_vocab_counts(path: str) -> np.ndarray:
    """The token counts a ``.npz`` written by ``python -m specjax.train.vocab`` keeps beside its map."""
    load_vocab_map(path)  # the same checks and messages as reading the map
    if not path.endswith(".npz"):
        raise ValueError(f"vocab map {path} holds no token counts (only the .npz files of python -m "
                         f"specjax.train.vocab keep them)")
    with np.load(path, allow_pickle=False) as z:
        if "counts" not in z:
            raise ValueError(f"vocab map {path} holds no token counts")
        return np.asarray(z["counts"], np.int64)


def compute_vocab_map(cfg, vocab_size: int, log=print) -> tuple[VocabMap, np.ndarray]:
    """Tokenize the run config's data (same split as training) and build the map."""
    tok = data_lib.load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    full = data_lib.load_dataset(cfg.data, tok, log=log)
    train, _ = data_lib.train_and_eval(cfg.data, full, tok, cfg.training.seed, log=log)
    counts = count_tokens(train.tokens, train.loss_mask, vocab_size)
    vm = build_vocab_map(counts, min(cfg.head.draft_vocab_size, vocab_size))
    covered = counts[np.asarray(vm.t2d)].sum() / max(1, counts.sum())
    log(f"vocab: {int((counts > 0).sum())} distinct target ids in {int(counts.sum())} loss tokens; draft vocab "
        f"{len(vm.d2t)} covers {covered:.2%} of them")
    return vm, counts


@dataclasses.dataclass
class VocabOptions:
    config: str = option(required=True, help="run config YAML (configs/*.yaml)")
    out: str = option(required=True, help="output file (.npz or .safetensors)")


def main(argv=None) -> int:
    p = add_override_options(options_parser(
        VocabOptions, "python -m specjax.train.vocab",
        "Count loss-masked target token ids over the training data of a run config and save the draft<->target "
        "vocab map (d2t, t2d). Training computes it itself when head.vocab_map is not set; precompute it to share it "
        "between runs.",
        epilog="Any --section.key VALUE override of the run config is accepted (e.g. --head.draft_vocab_size 16000).",
        formatter_class=argparse.HelpFormatter))
    if (got := config_from_command_line(p, argv)) is None:
        return 2
    args, cfg = from_namespace(VocabOptions, got[0]), got[1]
    try:  # a model.path that is no model folder is a WeightsError / ConfigError, both ValueErrors
        tcfg = ModelConfig.from_pretrained(resolve_model_path(cfg.model.path))
        check_output_file(args.out, "--out")
        vm, counts = compute_vocab_map(cfg, tcfg.vocab_size)
    except (data_lib.NoUsableData, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        save_vocab_map(args.out, vm, counts)
    except (OSError, ValueError) as e:
        print(f"error: --out: {error_text(e)}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
