"""What every bench tool ends with: measure, print the table, and keep the figures as JSON when ``--json`` asks."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from typing import Any, Callable

from specjax.cli import check_output_file, option
from specjax.config import DTYPES
from specjax.host import available_host_bytes, cpu_model, cpu_vector_extension, device_bytes_limit
from specjax.train.data import BadRecord, open_binary, to_messages

PROMPT_FORMATS = ("one prompt per line, or JSON lines with a prompt in turns[0], prompt, text, or the first user turn "
                  "of messages / conversations")


@dataclasses.dataclass
class TargetRunOptions:
    """How the target runs in the speculative benches (spec, tune): its dtype and its cache attention."""
    dtype: str | None = option(None, choices=list(DTYPES),
                               help="target dtype (default: the checkpoint's)")
    attention_impl: str = option("auto", choices=["auto", "xla", "pallas"],
                                 help="cache attention: XLA, the Pallas kernel, or auto (Pallas on TPU)")


def machine_description() -> str:
    """The machine a figure was measured on: CPU model, cores and vector extension, accelerator, JAX version and
    backend ("2-core CPU (AMD EPYC, x86_64, AVX2), no accelerator, JAX 0.10.2 CPU")."""
    import jax  # here, not at the top: the decode bench sets XLA's thread flags before jax is first imported
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    acc = "no accelerator" if dev.platform == "cpu" else f"{len(jax.devices())} x {kind}"
    ext = cpu_vector_extension()
    vector = f", {ext}" if ext else ""
    return (f"{os.cpu_count()}-core CPU ({cpu_model()}, {platform.machine()}{vector}), {acc}, JAX {jax.__version__} "
            f"{dev.platform.upper()}")


def available_device_bytes() -> int | None:
    """Memory the default device can hold: an accelerator's allocator limit, else the host's available memory."""
    return device_bytes_limit() or available_host_bytes()


def check_fits_device(nbytes: int, what: str, hint: str) -> None:
    """A clear exit, before anything is allocated, when ``nbytes`` cannot fit the default device's memory."""
    limit = available_device_bytes()
    if limit is not None and nbytes > limit:
        raise SystemExit(f"error: {what} needs {nbytes / 1e9:.1f} GB and the device has {limit / 1e9:.1f} GB "
                         f"available; {hint}")


def write_json(path: str | None, results: Any, indent: int = 2) -> None:
    """The results as JSON at ``path`` (nothing when it is None or empty; missing folders are made)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=indent)


def prompt_of(record: Any) -> str | None:
    """The prompt of one JSON record in the chat formats the trainer reads (MT-bench's ``turns``, a ``prompt`` or
    ``text`` field, the first user turn of ``messages`` / ``conversations``), or None when it holds none."""
    if not isinstance(record, dict):
        return None
    turns = record.get("turns")
    for text in ([turns[0]] if isinstance(turns, list) and turns else []) + [record.get("prompt"), record.get("text")]:
        if isinstance(text, str) and text.strip():
            return text
    try:
        msgs = to_messages(record, prompts=True)
    except BadRecord:
        return None
    return next(m["content"] for m in msgs if m["role"] == "user")


def _prompt_lines(path: str):
    """Each non-empty line of ``path`` (decompressed when its name says so): a JSON record or a plain prompt."""
    with open_binary(path) as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace").strip()
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield None  # a broken line is skipped like a record without a prompt
            elif line:
                yield line


def read_prompt_file(path: str, n: int | None = None) -> list[str]:
    """The first ``n`` (default: all) prompts of ``path``; records without a prompt are skipped. A ValueError,
    before anything loads, when none is usable (was a KeyError on ShareGPT records, an IndexError on an empty file)."""
    out = []
    for item in _prompt_lines(path):
        text = item if isinstance(item, str) else prompt_of(item)
        if text:
            out.append(text)
            if n is not None and len(out) >= n:
                break
    if not out:
        raise ValueError(f"no usable prompts in {path} (expected {PROMPT_FORMATS})")
    return out


def print_table(header: list[str], rows: list[list[Any]], align: str = "---") -> None:
    """A Markdown table: the header, the ``align`` rule under each column ("---", or "---:" for right-aligned), one
    line per row (cells already formatted)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join([align] * len(header)) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def report(options, measure: Callable[[Any], dict], show: Callable[[dict], None], indent: int = 2) -> int:
    """``measure(options)``, ``show`` its results, write them to ``options.json`` when set; exit status 0. Results
    that do not name their machine and load get both (``machine_description``, the 1-minute load average after the
    run), printed under the table."""
    check_output_file(options.json, "--json")  # now, not after the measurements
    results = measure(options)
    show(results)
    extra = {} if "machine" in results else {"machine": machine_description()}
    if not any(k.startswith("load_av") for k in results):
        extra["load_average"] = round(os.getloadavg()[0], 2)  # the 1-minute load average after the run
    if extra:
        results.update(extra)
        print("\n" + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in extra.items()))
    write_json(options.json, results, indent)
    return 0
