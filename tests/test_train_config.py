"""Run config: YAML + dotted overrides into nested frozen dataclasses; unknown keys and bad values are refused."""

import dataclasses
import glob
import os

import pytest

from specjax.train.config import ConfigError, RunConfig, describe, load_config, parse_overrides

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
                               "--training.max_steps", "null", "--offline.build", "--checkpoint.async-save", "false",
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


def test_describe_lists_every_key():
    text = describe()
    for sec in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(sec.type if isinstance(sec.type, type) else getattr(RunConfig(), sec.name)):
            assert f"--{sec.name}.{f.name} =" in text
