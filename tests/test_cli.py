"""The one dataclass -> argparse builder (specjax/cli.py) and the command lines built with it: help from field
metadata, aliases, switches, lists, positionals, exclusive choices, dotted run-config overrides, subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from specjax import cli
from specjax.bench.__main__ import main as bench_main


@dataclasses.dataclass
class Opts:
    src: str = cli.option(positional=True, help="input file")
    model_path: str = cli.option("", flags=("--model",), required=True, group="model", help="the model folder")
    steps: int = cli.option(3, group="model", help="how many steps")
    sizes: tuple[int, ...] = cli.option((1, 8), help="batch sizes")
    ratio: float | None = cli.option(None, help="a ratio")
    fast: bool = cli.option(False, help="go fast")
    name: str = cli.option("a", choices=("a", "b"), type=str.lower, help="a or b")
    secret: int | None = cli.option(None, hidden=True)


def test_fields_become_flags_with_their_help():
    p = cli.options_parser(Opts, "prog", group_descriptions={"model": "what to load"})
    text = p.format_help()
    for flag, help_text in (("--model-path", "the model folder"), ("--model", "the model folder"),
                            ("--steps", "how many steps"), ("--sizes", "batch sizes"), ("--fast", "go fast"),
                            ("src", "input file")):
        assert flag in text and help_text in text
    assert "what to load" in text and "--secret" not in text
    assert {a.dest for a in p._actions} - {"help"} == {f.name for f in dataclasses.fields(Opts)}


def test_parse_gives_the_dataclass():
    o = cli.parse_options(Opts, ["in.txt", "--model", "m", "--sizes", "2", "4", "--ratio", "0.5", "--fast",
                                 "--name", "B", "--secret", "7"], "prog")
    assert o == Opts(src="in.txt", model_path="m", steps=3, sizes=(2, 4), ratio=0.5, fast=True, name="b", secret=7)
    o = cli.parse_options(Opts, ["x", "--model-path", "m"], "prog")
    assert (o.steps, o.sizes, o.ratio, o.fast, o.name, o.secret) == (3, (1, 8), None, False, "a", None)


@pytest.mark.parametrize("argv", [["x"], ["--model", "m"], ["x", "--model", "m", "--steps", "two"],
                                  ["x", "--model", "m", "--name", "c"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_options(Opts, argv, "prog")
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_one_of_is_exclusive_and_required(capsys):
    @dataclasses.dataclass
    class Src:
        config: str | None = cli.option(None, one_of="source")
        model_config: str | None = cli.option(None, one_of="source")

    assert cli.parse_options(Src, ["--config", "c"], "prog") == Src(config="c")
    for argv, msg in (([], "one of the arguments --config --model-config is required"),
                      (["--config", "c", "--model-config", "m"], "not allowed with argument")):
        with pytest.raises(SystemExit):
            cli.parse_options(Src, argv, "prog")
        assert msg in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class Inner:
    """The inner section."""
    learning_rate: float = cli.option(0.1, help="step size")
    on: bool = cli.option(False, help="a switch")


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_dotted_overrides():
    p = cli.add_dotted_options(argparse.ArgumentParser(prog="prog"), Outer, float_or_true)
    ns, rest = p.parse_known_args(["--inner.learning-rate", "3", "--inner.on", "--other.x", "1"])
    assert cli.dotted_values(ns) == [("inner.learning_rate", 3.0), ("inner.on", True)]
    assert rest == ["--other.x", "1"]
    text = p.format_help()
    assert "The inner section." in text and "step size (default: 0.1)" in text and "[--section.key VALUE ...]" in text


def float_or_true(raw: str, tp):
    assert tp in (float, bool)  # the key's type comes with its value
    return True if raw == "true" else float(raw)


def test_dispatch(capsys):
    commands = {"one": ("json", "the first"), "two": ("os", "the second")}
    seen = []
    assert cli.dispatch("prog", commands, [], lambda *a: seen.append(a)) == 0
    assert "the first" in capsys.readouterr().out
    assert cli.dispatch("prog", commands, ["three"], lambda *a: seen.append(a)) == 2
    assert "prog: error: unknown command 'three'" in capsys.readouterr().err
    assert cli.dispatch("prog", commands, ["two", "--x"], lambda mod, cmd, args: 5) == 5
    assert cli.dispatch("prog", commands, ["one"], lambda mod, cmd, args: seen.append((mod.__name__, cmd, args))) == 0
    assert seen == [("json", "one", [])]


def test_bench_tools_report_user_errors_in_one_line(tmp_path, capsys):
    """Every bench tool: a folder that is not a model (specjax's ValueErrors) is one line on stderr, exit 2."""
    assert bench_main(["spec", "--model", str(tmp_path), "--random-draft", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m specjax.bench spec: error: no config.json") and "Traceback" not in err


@pytest.mark.parametrize("argv, said", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),  # was an IndexError after loading the model
    (["--verify-sweep", "0,8"], "--verify-sweep takes comma-separated integers >= 1 (e.g. 1,8,16), got '0,8'"),
    (["--verify-sweep", "a"], "--verify-sweep takes comma-separated integers >= 1"),
    (["--runner-steps", "0"], "--runner-steps takes comma-separated integers >= 1"),  # was numpy's "need at least one"
    (["--context", "-5", "--verify-sweep", "8"], "--context must be >= 1, got -5"),
    (["--topk", "1", "--num-draft-tokens", "6"],  # was said after loading the model and warming up
     "with speculative eagle_topk == 1 (a chain) num_draft_tokens must be num_steps + 1 = 4, got 6"),
])
def test_bench_spec_refuses_sizes_before_loading(argv, said, capsys):
    assert bench_main(["spec", "--random-draft"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m specjax.bench spec: error: {said}") and "Traceback" not in err


def test_file_system_errors_are_said_in_words(tmp_path):
    """An output path the tools cannot use names the path and what is wrong, not Python's ``[Errno N]``."""
    (tmp_path / "afile").write_text("")
    for target in (tmp_path / "afile" / "out", tmp_path / "afile" / "a" / "b"):
        with pytest.raises(OSError) as e:
            os.makedirs(target)
        assert cli.error_text(e.value).endswith(f": {tmp_path / 'afile'} is a file, not a folder")
    with pytest.raises(OSError) as e:
        open(tmp_path, "w")
    assert cli.error_text(e.value) == f"cannot use {tmp_path}: it is a folder, not a file"
    assert cli.error_text(PermissionError(13, "Permission denied", "/x")) == "cannot use /x: permission denied"
    assert cli.error_text(ValueError("plain")) == "plain"


def test_outputs_are_checked_before_the_work(tmp_path, capsys):
    """An output file that cannot be written is refused before a bench measures anything (not after an hour)."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        cli.check_output_file(str(tmp_path), "--out")
    cli.check_output_file(str(tmp_path / "new" / "x.json"), "--json")  # missing folders are made when it is written
    assert not (tmp_path / "new").exists()  # the check made them to try, and removed them again
    (tmp_path / "kept.json").write_text("old")
    cli.check_output_file(str(tmp_path / "kept.json"), "--json")
    assert (tmp_path / "kept.json").read_text() == "old"
    # os.access lets root write anywhere under /proc; the real attempt does not (the bench ran, then failed to write)
    with pytest.raises(ValueError, match=r"^--json /proc/specjax-no/out\.json: "):
        cli.check_output_file("/proc/specjax-no/out.json", "--json")
    assert bench_main(["decode", "--json", str(tmp_path / "afile" / "x.json"), "--batch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"python -m specjax.bench decode: error: --json {tmp_path / 'afile' / 'x.json'}: "
                           f"{tmp_path / 'afile'} is a file, not a folder")


def test_bench_train_refuses_sizes_before_compiling(capsys):
    """bench train: a size below 1 or an unknown dtype is one line (was numpy's traceback, or rows of 451% MFU)."""
    assert bench_main(["train", "--model-config", "smollm2-135m", "--ttt-length", "0"]) == 2
    assert "error: --ttt-length must be >= 1, got 0" in capsys.readouterr().err
    assert bench_main(["train", "--model-config", "smollm2-135m", "--head-dtype", "float42"]) == 2
    assert "--head-dtype must be float32, bfloat16 or float16" in capsys.readouterr().err


def test_prompt_files_in_the_trainers_chat_formats(tmp_path):
    """``--prompts FILE`` (bench spec, tune, serve): ShareGPT ``conversations``, ``messages``, ``turns``, ``prompt``
    and plain lines all give their first user turn (ShareGPT records were a KeyError); records without one are
    skipped; a file without any is one ValueError before the model loads (an empty file was an IndexError after)."""
    from specjax.bench.common import read_prompt_file
    from specjax.bench.spec import prompt_texts
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "A?"}, '
                 '{"from": "gpt", "value": "a"}]}\n'
                 '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "B?"}]}\n'
                 '{"id": 3}\n{"turns": ["C?", "more"]}\nnot json {\n\n{"prompt": "D?"}\n{"broken": \n')
    assert read_prompt_file(str(f)) == ["A?", "B?", "C?", "not json {", "D?"]
    assert prompt_texts(str(f), 2) == (["A?", "B?"], f"{f} (first 2)", False)
    for text in ("", '{"id": 1}\n{"messages": [{"role": "assistant", "content": "x"}]}\n'):
        f.write_text(text)
        with pytest.raises(ValueError, match=f"no usable prompts in {f} \\(expected one prompt per line, or JSON"):
            read_prompt_file(str(f))


def test_bench_spec_reads_the_prompt_file_before_the_model(tmp_path, capsys):
    """A prompt file without prompts is said before the model loads (the model folder here is not one)."""
    (tmp_path / "empty.jsonl").write_text("")
    assert bench_main(["spec", "--model", str(tmp_path), "--random-draft", "--prompts",
                       str(tmp_path / "empty.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m specjax.bench spec: error: no usable prompts in {tmp_path / 'empty.jsonl'}")
    assert bench_main(["tune", "--model", str(tmp_path), "--draft", str(tmp_path), "--prompts",
                       str(tmp_path / "empty.jsonl")]) == 2  # bench tune too
    assert "no usable prompts in" in capsys.readouterr().err
