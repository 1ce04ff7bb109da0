"""Run configuration: short YAML -> nested frozen dataclasses, with dotted command-line overrides.

    python -m specjax.train --config configs/qwen2.5-7b.yaml --optimizer.lr 3e-4 --mesh.tp 2

The target's architecture always comes from its HF config.json (``model.path``); the YAML only says where things
are and how to train. Unknown keys (in YAML or on the command line) raise ``ConfigError`` naming the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import typing
from typing import Any, Callable, Sequence

import yaml

from specjax import configs
from specjax.cli import add_dotted_options, dotted_values, option, strip_optional
from specjax.config import DTYPES, ConfigError  # the one config error of specjax (run configs raise it too)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The frozen target: where it is (its architecture comes from its config.json, see specjax.config)."""
    path: str = option("", help='local HF folder (config.json, *.safetensors, tokenizer) or hub id')
    tokenizer: str | None = option(None, help='tokenizer folder / hub id; default: model.path')
    dtype: str | None = option(None, help="target compute dtype; default: config.json's torch_dtype")
    random_init: bool = option(
        False, help='tests only: config.json + tokenizer but random weights (seeded by training.seed)')


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The EAGLE3 draft head being trained."""
    draft_vocab_size: int = option(
        32000, help='Vd: the most frequent target ids of the data (capped at the target vocab)')
    num_layers: int = option(1, help='decoder layers of the head (EAGLE3: 1)')
    init_from: str | None = option(
        None, help='a specjax checkpoint dir or an HF EAGLE3 head folder (published, SpecForge, an export): '
        'fine-tune that head (keeps its vocab map; see widen_vocab)')
    widen_vocab: bool = option(
        False, help="with init_from: grow that head's draft vocab to draft_vocab_size (its ids and rows kept, the "
        "most frequent other ids of the data, or of vocab_map's saved counts when given, added; their lm_head rows "
        "mapped from the target's)")
    init_lm_head: str = option(
        "random", help="random | target: a fresh head's lm_head/norm start as the target's (draft rows)")
    vocab_map: str | None = option(
        None, help='.npz / .safetensors from `python -m specjax.train.vocab`; default: computed (with widen_vocab: '
        'an .npz whose counts choose the added ids)')
    dtype: str = option(
        "float32", help='compute dtype of the head (master weights and Adam moments are fp32 regardless)')
    aux_layer_ids: tuple[int, ...] | None = option(None, help="default: EAGLE3's {1, L/2-1, L-4}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Chat data, rendered with the target tokenizer's chat template."""
    paths: tuple[str, ...] = option((), help="local .json / .jsonl / .parquet files or `datasets.save_to_disk` "
                                    "folders; the name 'sharegpt' means the cleaned ShareGPT fetched into the cache")
    hf_datasets: tuple[str, ...] = option((), help='hub datasets (`datasets.load_dataset(name, split=...)`)')
    split: str = option("train", help='split of the hub datasets')
    format: str = option("auto", help='auto | sharegpt (conversations/from/value) | messages (OpenAI role/content) | '
                                      'text (preformatted: each record\'s `text` is a conversation already rendered '
                                      'with the target\'s chat template, as SpecForge\'s preformatted data; auto reads '
                                      'a record with `text` and no turns as such)')
    assistant_header: str | None = option(None, help='preformatted text: what opens an assistant turn (default: what '
                                          'the chat template writes there, e.g. "<|im_start|>assistant\\n"; taken as '
                                          'typed; for escapes such as a newline write a YAML double-quoted string, in '
                                          'a YAML file or on the command line as \'"...\\n"\')')
    end_of_turn: str | None = option(None, help='preformatted text: what ends an assistant turn (default: what the '
                                     'chat template writes there, e.g. "<|im_end|>")')
    max_length: int = option(2048, help='tokens per conversation (after rendering)')
    buckets: tuple[int, ...] = option((128, 256, 512, 1024, 2048, 4096), help='padded lengths (one compile each)')
    overlong: str = option("truncate", help='truncate | drop: what to do with conversations longer than max_length')
    eval_fraction: float = option(0.01, help='held-out share of the conversations (deterministic from training.seed)')
    eval_max: int = option(512, help='at most this many held-out conversations')
    eval_paths: tuple[str, ...] = option((), help='a held-out set of its own (files as `paths`, e.g. prepare_data\'s '
                                         '*_test.jsonl): evaluate on its first eval_max conversations and train on '
                                         'all of `paths` (eval_fraction is then unused)')
    max_examples: int | None = option(None, help='use only the first N conversations (smoke runs)')
    chat_template_kwargs: dict = option(default_factory=dict, help='e.g. {enable_thinking: false}')
    cache_dir: str | None = option(None, help='tokenized-data cache; default: ~/.cache/specjax/data')


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """Batches, length of the run, the TTT rollout."""
    batch_size: int = option(4, help='GLOBAL micro-batch (sequences), split over mesh.dp')
    grad_accum: int = option(1, help='micro-batches per optimizer step')
    epochs: int = option(1, help='passes over the training split')
    max_steps: int | None = option(None, help='stop after this many optimizer steps (default: epochs over the data)')
    seed: int = option(0, help='data order, eval split, head init')
    ttt_length: int = option(7, help='rollout steps of the training-time test')
    decay: float = option(0.8, help='weight of rollout step k is decay**k')
    max_nonfinite_steps: int = option(
        10, help='a NaN/inf loss or gradient skips the update; this many in a row stop the run')
    max_zero_grad_steps: int = option(
        10, help='this many updates in a row with a gradient of exactly zero (a saturated head) stop the run')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW after global-norm clipping; linear warmup then cosine."""
    lr: float = option(8e-4, help='peak learning rate')
    warmup_ratio: float = option(0.03, help='share of the steps spent warming up linearly from 0')
    min_lr_ratio: float = option(0.0, help='cosine decays to lr * min_lr_ratio')
    weight_decay: float = option(0.0, help='decoupled, on matrices only')
    b1: float = option(0.9, help='Adam beta1')
    b2: float = option(0.95, help='Adam beta2')
    clip_norm: float = option(0.5, help='global gradient-norm clip (0: off)')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data parallel x tensor parallel (dp * tp = all devices of all hosts)."""
    dp: int = option(-1, help='-1: all devices not used by tp')
    tp: int = option(1, help='tensor-parallel devices (the target and head are split over them)')


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints (params, optimizer, step, rng, data position, configs, vocab map)."""
    dir: str = option("checkpoints/run", help='local folder or gs://... (multi-host: must be shared by all hosts)')
    every: int = option(500, help='optimizer steps between saves (and one at the end, and on SIGTERM)')
    keep: int = option(3, help='keep the newest K checkpoints')
    async_save: bool = option(True, help='write in the background while training continues')
    resume: bool = option(True, help='continue from the latest good checkpoint in dir, if any')
    export: str = option('hf', help='when the run completes, also write the final head as an HF EAGLE3 folder (bf16, '
                                    'what SGLang and vLLM load) into <dir>/<export>, gs:// dirs too; "" to skip')


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics (JSONL on process 0, optional TensorBoard and Weights & Biases), progress bar, periodic eval."""
    every: int = option(10, help='steps between metric lines')
    jsonl: str | None = option(None, help='default: <checkpoint.dir>/metrics.jsonl')
    tensorboard: str | None = option(None, help='log dir; needs tensorboardX or torch')
    wandb_project: str | None = option(None, help='also log to Weights & Biases under this project (needs wandb; '
                                                  'a rerun of the same checkpoint.dir continues its wandb run)')
    wandb_name: str | None = option(None, help='the wandb run name (default: the checkpoint folder\'s name)')
    eval_every: int = option(500, help='steps between evals on the held-out split (0: never)')
    eval_batches: int = option(8, help='batches of the held-out split per eval')
    progress: bool = option(True, help='tqdm progress bar (process 0)')


@dataclasses.dataclass(frozen=True)
class OfflineConfig:
    """Offline mode: cache the target's aux features + final hidden states once, then train from disk."""
    dir: str | None = option(None, help='cache folder; setting it trains from the cache')
    build: bool = option(False, help='build the cache (then exit)')


@dataclasses.dataclass(frozen=True)
class MultihostConfig:
    """jax.distributed.initialize arguments. Left empty, it is called when the environment shows several processes
    (TPU_WORKER_HOSTNAMES, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS), or always with ``auto: true`` (what
    tpu_scripts/train.sh passes on TPU pods)."""
    auto: bool = option(False, help='always call jax.distributed.initialize() (TPU pods)')
    coordinator: str | None = option(None, help='host:port of process 0')
    num_processes: int | None = option(None, help='with coordinator')
    process_id: int | None = option(None, help="with coordinator: this process's index")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    offline: OfflineConfig = dataclasses.field(default_factory=OfflineConfig)
    multihost: MultihostConfig = dataclasses.field(default_factory=MultihostConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)


# ---- building from dicts -----------------------------------------------------------------------------------------
def _coerce(value: Any, tp: Any, where: str) -> Any:
    tp, optional = strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed here")
    origin = typing.get_origin(tp)
    if origin is tuple:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (elt, *_) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, elt, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _unknown(key: str, valid: Sequence[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"unknown config key '{where}{key}'{hint}; valid keys: {', '.join(valid)}")


def from_dict(d: dict[str, Any], cls=RunConfig, where: str = ""):
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for key, value in d.items():
        if key not in fields:
            raise _unknown(key, list(fields), where)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kw[key] = from_dict(value or {}, tp, f"{where}{key}.")
        else:
            kw[key] = _coerce(value, tp, f"{where}{key}")
    return cls(**kw)


def to_dict(obj) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cls = RunConfig
    node = d
    for i, p in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if p not in names:
            raise _unknown(p, names, ".".join(parts[:i]) + ("." if i else ""))
        tp = typing.get_type_hints(cls)[p]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"--{dotted} names a section; set one of its keys, e.g. --{dotted}."
                                  f"{dataclasses.fields(tp)[0].name}")
            node[p] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"--{dotted}: {'.'.join(parts[:i + 1])} is not a section")
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"--{dotted}: {'.'.join(parts[:i + 1])} is not a mapping in the YAML")
        node = nxt
        cls = tp


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``--a.b VALUE`` / ``--a.b=VALUE`` pairs; a bare ``--a.b`` (last, or followed by another flag) means true.
    Values are parsed as YAML scalars/lists (``3e-4`` -> float, ``[128,256]`` -> list, ``null`` -> None), except
    that a text key keeps what was typed where YAML would read something else (``parse_value``)."""
    out = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            raw = argv[i + 1]
            i += 2
        else:
            raw = "true"
            i += 1
        key = key.replace("-", "_")
        out.append((key, parse_value(raw, _key_type(key))))
    return out


def _key_type(dotted: str) -> Any:
    """The type of the run-config key ``section.key`` (None for a name that is not one: refused later, by name)."""
    cls = RunConfig
    for p in dotted.split("."):
        if not dataclasses.is_dataclass(cls) or p not in {f.name for f in dataclasses.fields(cls)}:
            return None
        cls = typing.get_type_hints(cls)[p]
    return cls


def parse_value(raw: str, tp: Any = None) -> Any:
    """A command-line value as a YAML scalar or list (``3e-4`` -> float, ``[128,256]`` -> list, ``null`` -> None);
    the config loader types it against the key afterwards. For a text key (``tp`` str) a value YAML reads as
    something else is kept as typed: ``### Assistant:`` (a YAML comment), ``Assistant: `` (a mapping), ``[/INST]``
    (a list) stay those strings; ``null`` still clears an optional one, and a double-quoted YAML string
    (``'"<|im_start|>assistant\\n"'``) is how escapes such as a newline are written."""
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _is_number(value):  # yaml 1.1 reads "3e-4" as a string
        value = float(value)
    if tp is not None and strip_optional(tp)[0] is str:
        if raw.strip() in ("null", "Null", "NULL", "~"):
            return None
        quoted = raw.strip()[:1] in ("'", '"') and isinstance(value, str)
        return value if quoted else raw  # YAML strips spaces and reads "#..." as a comment: kept as typed
    return value


def add_override_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--section.key VALUE`` for every key of the run config (one --help section per config section)."""
    return add_dotted_options(parser, RunConfig, parse_value)


def parse_known_overrides(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[tuple[str, Any]]]:
    """(the parser's own arguments, the run-config overrides): those the parser knows, then whatever it does not,
    which ``load_config`` refuses naming the valid keys and the nearest one."""
    args, rest = parser.parse_known_args(argv)
    return args, dotted_values(args) + parse_overrides(rest)


def config_from_command_line(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, RunConfig] | None:
    """(the parser's own arguments, the run config its ``--config`` and overrides make); None, after printing the
    ``ConfigError`` on stderr, when they make none."""
    try:
        args, overrides = parse_known_overrides(parser, argv)
        return args, load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def load_config(path: str | None = None, overrides: Sequence[str] | Sequence[tuple[str, Any]] = ()) -> RunConfig:
    """YAML file (optional; a path, or the name of a shipped recipe such as ``qwen2.5-7b.yaml``) + overrides ->
    validated RunConfig. Relative paths in the YAML stay relative to the working directory."""
    d: dict[str, Any] = {}
    if path is not None:
        path = configs.resolve(path)
        if not os.path.isfile(path):
            what = "is a folder, not a YAML file" if os.path.isdir(path) else "does not exist"
            raise ConfigError(f"config file {path} {what}; {configs.help_text()}")
        with open(path) as f:
            try:
                d = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    pairs = parse_overrides(overrides) if overrides and isinstance(overrides[0], str) else list(overrides)
    for key, value in pairs:
        _set_dotted(d, key, value)
    cfg = expand_paths(from_dict(d))
    validate(cfg)
    return cfg


def _expand(p):
    return os.path.expanduser(os.path.expandvars(p)) if isinstance(p, str) and "://" not in p else p


def expand_paths(cfg: RunConfig) -> RunConfig:
    """``~`` and ``$VARS`` in every path-valued key (remote URLs such as gs://... are left alone)."""
    r = dataclasses.replace
    return cfg.replace(
        model=r(cfg.model, path=_expand(cfg.model.path), tokenizer=_expand(cfg.model.tokenizer)),
        head=r(cfg.head, init_from=_expand(cfg.head.init_from), vocab_map=_expand(cfg.head.vocab_map)),
        data=r(cfg.data, paths=tuple(_expand(p) for p in cfg.data.paths), cache_dir=_expand(cfg.data.cache_dir),
               eval_paths=tuple(_expand(p) for p in cfg.data.eval_paths)),
        checkpoint=r(cfg.checkpoint, dir=_expand(cfg.checkpoint.dir)),
        logging=r(cfg.logging, jsonl=_expand(cfg.logging.jsonl), tensorboard=_expand(cfg.logging.tensorboard)),
        offline=r(cfg.offline, dir=_expand(cfg.offline.dir)))


def validate(cfg: RunConfig) -> None:
    dc = cfg.data
    if dc.format not in ("auto", "sharegpt", "messages", "text"):
        raise ConfigError(f"data.format must be auto, sharegpt, messages or text, not {dc.format!r}")
    for key in ("assistant_header", "end_of_turn"):
        if getattr(dc, key) is not None and (not isinstance(getattr(dc, key), str) or not getattr(dc, key).strip()):
            raise ConfigError(f"data.{key} must be a non-empty string, not {getattr(dc, key)!r}")
    if dc.overlong not in ("truncate", "drop"):
        raise ConfigError(f"data.overlong must be truncate or drop, not {dc.overlong!r}")
    if dc.max_length < 2:
        raise ConfigError("data.max_length must be at least 2")
    if any(b <= 0 for b in dc.buckets):
        raise ConfigError(f"data.buckets must be positive lengths, got {list(dc.buckets)}")
    if not 0.0 <= dc.eval_fraction < 1.0:
        raise ConfigError("data.eval_fraction must be in [0, 1)")
    t = cfg.training
    for name in ("batch_size", "grad_accum", "epochs", "ttt_length"):
        if getattr(t, name) < 1:
            raise ConfigError(f"training.{name} must be >= 1")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError("training.max_steps must be >= 1 (or null)")
    if cfg.mesh.tp < 1 or cfg.mesh.dp == 0 or cfg.mesh.dp < -1:
        raise ConfigError("mesh.tp must be >= 1 and mesh.dp >= 1 (or -1 for all remaining devices)")
    if cfg.checkpoint.every < 1 or cfg.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every and checkpoint.keep must be >= 1")
    if cfg.head.draft_vocab_size < 1:
        raise ConfigError("head.draft_vocab_size must be >= 1")
    if cfg.head.widen_vocab and not cfg.head.init_from:
        raise ConfigError("head.widen_vocab grows the vocab of the head given by head.init_from: set that too")
    if cfg.head.init_lm_head not in ("random", "target"):
        raise ConfigError(f"head.init_lm_head must be random or target, not {cfg.head.init_lm_head!r}")
    for key, (ok, what) in _RANGES.items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v is not None and not (math.isfinite(v) and ok(v)):
            raise ConfigError(f"{key} must be {what}, got {v}")
    if t.ttt_length >= dc.max_length:
        raise ConfigError(f"training.ttt_length ({t.ttt_length}) must be smaller than data.max_length "
                          f"({dc.max_length}): each rollout step predicts one position further")
    if t.ttt_length > MAX_TTT_LENGTH:
        raise ConfigError(f"training.ttt_length must be <= {MAX_TTT_LENGTH} (the rollout is unrolled into the "
                          f"compiled step; EAGLE3 uses 7), got {t.ttt_length}")
    if cfg.model.dtype is not None and cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be float32, bfloat16 or float16 (or unset), not {cfg.model.dtype!r}")
    aux = cfg.head.aux_layer_ids
    if aux is not None and (len(set(aux)) != len(aux) or any(i < 0 for i in aux)):
        raise ConfigError(f"head.aux_layer_ids must be distinct layer indices >= 0, got {list(aux)}")
    if cfg.head.dtype not in DTYPES:
        raise ConfigError(f"head.dtype must be float32, bfloat16 or float16, not {cfg.head.dtype!r}")
    if cfg.offline.build and not cfg.offline.dir:
        raise ConfigError("offline.build needs offline.dir: the folder the feature cache is written to")
    if cfg.offline.dir and cfg.data.eval_paths:
        raise ConfigError("data.eval_paths with offline.dir: the feature cache holds the features of data.paths "
                          "only; hold conversations out with data.eval_fraction instead")
    mh = cfg.multihost
    if (mh.coordinator is None) != (mh.num_processes is None) or \
            (mh.coordinator is not None and mh.process_id is None):
        raise ConfigError("multihost.coordinator, multihost.num_processes and multihost.process_id go together: "
                          "give all three (or none, and multihost.auto on a TPU pod)")
    if mh.num_processes is not None and not 0 <= (mh.process_id or 0) < mh.num_processes:
        raise ConfigError(f"multihost.process_id must be in [0, {mh.num_processes}), got {mh.process_id}")


MAX_TTT_LENGTH = 64
# section.key -> (check, what it must be): the numeric keys whose every value of the right type is not meaningful
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "optimizer.lr": (lambda v: v > 0, "> 0"),
    "optimizer.warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "optimizer.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optimizer.b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.clip_norm": (lambda v: v >= 0, ">= 0 (0: off)"),
    "training.decay": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "training.max_nonfinite_steps": (lambda v: v >= 1, ">= 1"),
    "training.max_zero_grad_steps": (lambda v: v >= 1, ">= 1"),
    "data.eval_max": (lambda v: v >= 0, ">= 0"),
    "data.max_examples": (lambda v: v >= 1, ">= 1 (or null: all)"),  # -1 was "kept 0 of 0 conversations"
    "head.num_layers": (lambda v: v >= 1, ">= 1"),
    "logging.every": (lambda v: v >= 1, ">= 1"),
    "logging.eval_every": (lambda v: v >= 0, ">= 0 (0: never)"),
    "logging.eval_batches": (lambda v: v >= 1, ">= 1"),
}
