"""The command lines of README.md and docs/0*.md name only flags their CLI has: each command's ``--help`` (run once per
CLI) must list every ``--flag`` the docs give it, dotted run-config overrides (``--optimizer.lr``) included.
docs/benchmarks.md is a dated log of what ran then, and is not checked."""

from __future__ import annotations

import functools
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITH_SUBCOMMANDS = ("specjax.bench", "specjax.convert", "specjax.preflight")


def doc_commands() -> list[tuple[str, str]]:
    """(doc file, command line) for every ``python -m specjax...`` in a fenced block (continuations joined) or an
    inline code span."""
    out = []
    for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "0*.md")))]:
        text = open(os.path.join(ROOT, path)).read()
        name = os.path.relpath(os.path.join(ROOT, path), ROOT)
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if m := re.search(r"python -m (specjax[\w.]*.*)", line):
                    out.append((name, m.group(1).split(" #")[0]))
        for span in re.findall(r"`python -m (specjax[^`]*)`", text.replace("\n", " ")):
            out.append((name, span))
    return out


def cli_of(command: str) -> tuple[str, ...] | None:
    """The module (and subcommand) a command runs; None for a placeholder such as ``bench {decode,train}``."""
    toks = command.split()
    if toks[0] in WITH_SUBCOMMANDS and len(toks) > 1 and not toks[1].startswith("-"):
        return None if "{" in toks[1] else (toks[0], toks[1])
    return (toks[0],)


def flags_in(command: str) -> list[str]:
    try:
        toks = shlex.split(command)
    except ValueError:  # an unbalanced quote in prose: split on spaces
        toks = command.split()
    return [t.split("=")[0] for t in toks if re.fullmatch(r"--[a-z][\w.-]*(=.*)?", t)]


@functools.lru_cache(maxsize=None)
def help_flags(cli: tuple[str, ...]) -> frozenset[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", *cli, "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, f"python -m {' '.join(cli)} --help failed: {r.stderr[-2000:]}"
    return frozenset(re.findall(r"--[a-z][\w.-]*", r.stdout))


COMMANDS = doc_commands()
CLIS = sorted({c for _, cmd in COMMANDS if (c := cli_of(cmd))})


def test_the_docs_give_commands():
    assert len(COMMANDS) > 30 and ("specjax.train",) in CLIS and ("specjax.serve",) in CLIS


@pytest.mark.parametrize("cli", CLIS, ids=[" ".join(c) for c in CLIS])
def test_every_documented_flag_exists(cli):
    known = help_flags(cli)
    run_config = help_flags(("specjax.train",))  # a --section.key override means the same to every run-config CLI
    unknown = [(doc, cmd, f) for doc, cmd in COMMANDS if cli_of(cmd) == cli for f in flags_in(cmd)
               if f not in known and not ("." in f and f in run_config)]
    assert not unknown, "\n".join(f"{doc}: `python -m {cmd}`: no {f}" for doc, cmd, f in unknown)
