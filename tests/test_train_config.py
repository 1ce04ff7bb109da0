"""Run config: YAML + dotted overrides into nested frozen dataclasses; unknown keys and bad values are refused."""

import dataclasses
import glob
import os
import sys
import types

import pytest

from specjax import config as core_config
from specjax.cli import field_help
from specjax.train.__main__ import Logger, build_parser
from specjax.train.config import ConfigError, RunConfig, config_from_command_line, load_config, parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and cfg.model.path
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.seed = 1  # type: ignore[misc]


def test_overrides_and_types(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model: {path: ~/m}\noptimizer: {lr: 1.0e-3}\ndata: {buckets: [64, 128]}\n")
    cfg = load_config(str(y), ["--optimizer.lr", "3e-4", "--mesh.tp=2", "--data.paths", "[a.json, b.jsonl]",
                               "--training.max_steps", "null", "--offline.build", "--offline.dir", "cache",
                               "--checkpoint.async-save", "false",
                               "--data.chat_template_kwargs", "{enable_thinking: false}"])
    assert cfg.optimizer.lr == 3e-4 and cfg.mesh.tp == 2 and cfg.data.buckets == (64, 128)
    assert cfg.data.paths == ("a.json", "b.jsonl") and cfg.training.max_steps is None and cfg.offline.build
    assert cfg.checkpoint.async_save is False and cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.model.path == os.path.expanduser("~/m")
    assert load_config(None, [("training.seed", 5)]).training.seed == 5
    assert parse_overrides(["--a.b", "-1"]) == [("a.b", -1)]


@pytest.mark.parametrize("argv,msg", [
    (["--optimizer.lrr", "1"], "did you mean 'lr'"),
    (["--optimiser.lr", "1"], "did you mean 'optimizer'"),
    (["--mesh.tp", "x"], "expected an integer"),
    (["--mesh", "1"], "names a section"),
    (["--data.format", "csv"], "data.format"),
    (["--training.batch_size", "0"], "batch_size"),
    (["positional"], "unexpected argument"),
    (["--optimizer.lr", "-1"], "optimizer.lr must be > 0"),
    (["--optimizer.warmup_ratio", "nan"], "optimizer.warmup_ratio must be in"),
    (["--optimizer.min_lr_ratio", "-1"], "optimizer.min_lr_ratio must be in"),
    (["--optimizer.b2", "2"], "optimizer.b2 must be in"),
    (["--optimizer.clip_norm", "-1"], "optimizer.clip_norm must be >= 0"),
    (["--training.decay", "nan"], "training.decay must be in"),
    (["--training.ttt_length", "100000"], "must be smaller than data.max_length"),
    (["--training.ttt_length", "100", "--data.max_length", "4096"], "training.ttt_length must be <= 64"),
    (["--data.eval_max", "-1"], "data.eval_max must be >= 0"),
    (["--data.max_examples", "-1"], r"data.max_examples must be >= 1 \(or null: all\), got -1"),
    (["--data.max_examples", "0"], "data.max_examples must be >= 1"),
    (["--head.num_layers", "0"], "head.num_layers must be >= 1"),
    (["--head.aux_layer_ids", "[1, 1, 2]"], "must be distinct"),
    (["--head.dtype", "float42"], "head.dtype must be"),
    (["--head.widen_vocab", "true"], "head.widen_vocab grows the vocab of the head given by head.init_from"),
    (["--model.dtype", "bogus"], "model.dtype must be"),
    (["--logging.every", "0"], "logging.every must be >= 1"),
    (["--logging.eval_every", "-1"], "logging.eval_every must be >= 0"),
    (["--offline.build", "true"], "offline.build needs offline.dir"),
    (["--offline.dir", "/tmp/x", "--data.eval_paths", "[t.jsonl]"], "data.eval_paths with offline.dir"),
    (["--multihost.num_processes", "2"], "go together"),
    (["--multihost.coordinator", "h:1", "--multihost.num_processes", "2", "--multihost.process_id", "5"],
     "process_id must be in"),
])
def test_bad_overrides(argv, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, argv)


def test_bad_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model: {path: x}\nheadd: {num_layers: 1}\n")
    with pytest.raises(ConfigError, match="unknown config key 'headd'"):
        load_config(str(y))
    y.write_text("head: {num_layerz: 1}\n")
    with pytest.raises(ConfigError, match="head.num_layerz"):
        load_config(str(y))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load_config(str(tmp_path))


def test_help_lists_every_key_with_its_documentation():
    text = " ".join(build_parser().format_help().split())  # argparse wraps long help lines
    for sec in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(getattr(RunConfig(), sec.name)):
            assert f"--{sec.name}.{f.name} " in text
            assert field_help(f), f"{sec.name}.{f.name} has no help text"
            assert " ".join(field_help(f).split()) in text


def test_help_start_here_trains_on_what_its_fetch_steps_make():
    """The --help "Start here" train command reads only what the fetch commands above it put in the cache (the
    config's own data, the regenerated set, is not one of them: the command failed with "data path ... does not
    exist"); run by hand it trains (checked with --training.max_steps 2)."""
    from specjax.train.__main__ import HELP_EPILOG
    start = HELP_EPILOG.split("Start here")[1].split("What happens")[0].replace("\\\n", " ")
    fetched = {line.split()[3].removeprefix("fetch-") for line in start.splitlines() if "convert fetch-" in line}
    train = next(line.split("#")[0].split() for line in start.splitlines() if "-m specjax.train " in line)
    assert fetched == {"smollm2", "sharegpt"}
    args = train[train.index("--config"):]
    args[1] = os.path.join(ROOT, args[1])
    cfg = load_config(args[1], args[2:])
    assert list(cfg.data.paths) == ["sharegpt"] and not cfg.data.hf_datasets
    assert cfg.model.path == os.path.expanduser("~/.cache/specjax/SmolLM2-135M-Instruct")  # fetch-smollm2's


def test_cli_flags_reach_the_config(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("model: {path: m}\ntraining: {seed: 3}\n")
    args, cfg = config_from_command_line(build_parser(), [
        "--config", str(y), "--optimizer.lr", "3e-4", "--offline.build", "--offline.dir", "c",
        "--checkpoint.async-save", "false", "--training.max_steps=7", "--data.buckets", "[64,128]"])
    assert args.config == str(y)
    assert cfg.optimizer.lr == 3e-4 and cfg.offline.build and cfg.checkpoint.async_save is False
    assert cfg.training.max_steps == 7 and cfg.training.seed == 3 and cfg.data.buckets == (64, 128)
    for argv, msg in ((["--optimizer.lrr", "1"], "did you mean 'lr'"), (["positional"], "unexpected argument"),
                      (["--mesh.tp", "x"], "expected an integer")):
        assert config_from_command_line(build_parser(), argv) is None
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("typed, want", [
    ("### Assistant:", "### Assistant:"), ("Assistant: ", "Assistant: "), ("[/INST]", "[/INST]"), ("3", "3"),
    ('"<|im_start|>assistant\\n"', "<|im_start|>assistant\n"), ("null", None), ("</s> ", "</s> "),
    ("a # b", "a # b")])
def test_text_keys_keep_what_was_typed(typed, want):
    """A text key's value is what was typed where YAML would read it as a comment, a mapping, a list or a number (a
    preformatted chat layout's header is all of those); a YAML double-quoted string still writes escapes, null still
    clears it. The same through the trainer's flags and the overrides the parser does not know."""
    _, cfg = config_from_command_line(build_parser(), ["--data.assistant-header", typed])
    assert cfg.data.assistant_header == want
    assert load_config(None, ["--data.end_of_turn", typed]).data.end_of_turn == want


def test_one_config_error():
    assert ConfigError is core_config.ConfigError


class _FakeWandbRun:
    def __init__(self, **kw):
        self.init, self.logged, self.finished = kw, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_logging_of_metrics(tmp_path, monkeypatch, capsys):
    """logging.wandb_project (SpecForge's --report-to wandb): process 0 starts a wandb run whose id follows the
    checkpoint folder (a rerun resumes it) and logs the scalar metrics at their step; without wandb installed, a
    note and JSONL only."""
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(tmp_path / "run1")),
                              logging=dataclasses.replace(cfg.logging, wandb_project="eagle3"))
    for _ in range(2):
        log = Logger(cfg, primary=True)
        log.metrics(3, {"loss": 0.5, "acc_0": 0.25, "note": "x", "skipped": True})
        log.close()
    assert [r.init["id"] for r in runs] == [runs[0].init["id"]] * 2 and runs[0].init["resume"] == "allow"
    assert runs[0].init["project"] == "eagle3" and runs[0].init["name"] == "run1"
    assert runs[0].logged == [(3, {"loss": 0.5, "acc_0": 0.25})] and runs[0].finished
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed; TensorBoard's writers neither (the note on
    for name in ("tensorboardX", "torch.utils.tensorboard"):  # a missing TensorBoard was an AttributeError)
        monkeypatch.setitem(sys.modules, name, None)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, tensorboard=str(tmp_path / "tb")))
    Logger(cfg, primary=True).close()
    out = capsys.readouterr().out
    assert "wandb is not installed" in out and "neither tensorboardX nor torch's tensorboard is installed" in out
