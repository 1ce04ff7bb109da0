"""The tuned tree shape per batch size, stored next to a draft head as ``speculative_tune.json``.

Written by ``python -m specjax.bench tune`` (measured tokens/s of every candidate shape and of plain decoding on a
prompt set); read by the server and ``specjax.Engine`` when the tree flags are not given. Format 1:

    {"format": 1, "algorithm": "EAGLE3", "batch_sizes": {"1": {"num_steps": 7, "eagle_topk": 1,
     "num_draft_tokens": 8}, "16": null, ...}, "best_speculative": {"1": {...}, "16": {...}},
     ...measurement details...}

``null`` means plain decoding was faster at that batch size; ``best_speculative`` keeps the fastest tree shape of
every batch size regardless, and ``rows`` every measurement (tokens/s, speedup, tau), from which
:class:`TreeChoice` knows what each tree step costs and re-decides the table on the live traffic (so a server
whose table says ``null`` everywhere starts with target-only steps and turns a tree on where the traffic pays for
it; without rows, or with adaptation off, it serves plain decoding). ``python -m specjax.generate`` runs the best
speculative shape and reports the ratio. A batch size between two tuned ones uses the entry of the largest tuned
size not above it (the smallest tuned size below the first).

A tree step's cost in plain steps is the machine's, so a head folder may hold one table per kind of machine beside
the plain one: ``speculative_tune[.<dtype>].on-<machine>.json`` (``machine_tag``: the accelerator's device kind, or
the CPU model and its vector extension). A run reads this machine's table where there is one (``table_path``); a
table measured on another kind of machine (``machine``, ``same_machine``) runs the smallest tree that paid there
instead (``_smallest_paying``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re

import jax

from specjax.host import VECTOR_EXTENSIONS, cpu_model, cpu_vector_extension
from specjax.weights import WeightsError, hub_snapshot, is_hub_id

FORMAT = 1
FILENAME = "speculative_tune.json"
_log = logging.getLogger("specjax.tune")
SHAPE_KEYS = ("num_steps", "eagle_topk", "num_draft_tokens")


class TuneError(ValueError):
    """A speculative_tune.json that cannot be used; the message names the file and the problem."""


def save_tune(path: str, table: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def filename(dtype: str | None = None, machine: str | None = None) -> str:
    """The table's name in a head folder: ``speculative_tune.json`` (fp32 or the checkpoint's dtype), or
    ``speculative_tune.<dtype>.json`` for a table tuned with bf16/f16 weights, whose tree steps cost far fewer plain
    steps on a CPU (docs/benchmarks.md, fifteenth session); with ``machine`` (a ``machine_tag``), the table of that
    kind of machine: ``speculative_tune[.<dtype>].on-<machine>.json``."""
    parts = ["speculative_tune", *([] if dtype in (None, "auto", "float32") else [dtype])]
    return ".".join(parts + ([f"on-{machine}"] if machine else []) + ["json"])


def machine_tag() -> str:
    """This kind of machine as a file name's word: the accelerator's device kind, else the CPU model and its vector
    extension, lowercase, runs of letters and digits joined by '-' ("amd-epyc-avx2", "nvidia-h100-80gb-hbm3")."""
    cpu, vector, accelerator = this_machine()
    text = re.sub(r"\((r|tm)\)", " ", (accelerator or f"{cpu} {vector or ''}").lower())
    return "-".join(re.findall(r"[a-z0-9]+", text))


def table_path(folder_or_file: str | None, dtype: str | None = None) -> str | None:
    """A file as given, or the table a head folder holds for ``dtype`` (else the generic one), this kind of
    machine's where the folder has one (``filename``'s ``machine``); None when there is none."""
    if not folder_or_file:
        return None
    if is_hub_id(folder_or_file):
        folder_or_file = _hub_tables(folder_or_file)
        if folder_or_file is None:
            return None
    if not os.path.isdir(folder_or_file):
        return folder_or_file if os.path.isfile(folder_or_file) else None
    tagged = any(n.startswith("speculative_tune.") and ".on-" in n for n in os.listdir(folder_or_file))
    tag = machine_tag() if tagged else None  # (jax's backend is asked only where a folder has tagged tables)
    names = (filename(dtype, tag), filename(dtype), filename(None, tag), FILENAME)
    paths = (os.path.join(folder_or_file, name) for name in dict.fromkeys(names))
    return next((p for p in paths if os.path.isfile(p)), None)


@functools.lru_cache(maxsize=None)
def _hub_tables(repo: str) -> str | None:
    """The hub cache folder holding hub head ``repo``'s tree tables (fetched once per process; the head's weights
    come later, into the same folder), or None where the hub cannot provide them (warned once)."""
    try:
        return hub_snapshot(repo, (f"{FILENAME.rsplit('.', 1)[0]}*.json",))
    except WeightsError as e:
        _log.warning("no tree table for hub head %s (%s): its trees are the defaults", repo, e)
        return None


def output_path(folder: str, dtype: str | None = None) -> str:
    """Where ``bench tune`` writes a head folder's table for ``dtype``: this kind of machine's table where the folder
    has one; else the plain name, unless the table there was measured on another kind of machine (a shipped head's):
    that one is kept and this machine's goes beside it."""
    here = os.path.join(folder, filename(dtype, machine_tag()))
    plain = os.path.join(folder, filename(dtype))
    if os.path.isfile(here):
        return here
    if not os.path.isfile(plain):
        return plain
    try:
        elsewhere = _elsewhere(_read(plain))
    except TuneError:
        return plain  # a damaged table is replaced
    return plain if elsewhere is None else here


def _bad(path: str, e: Exception) -> TuneError:
    return TuneError(f"{path} is not a valid {FILENAME} ({type(e).__name__}: {e}); rerun "
                     f"`python -m specjax.bench tune` or delete it")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _bad(path, e) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise TuneError(f"{path}: format {raw.get('format') if isinstance(raw, dict) else None!r}, this specjax "
                        f"reads format {FORMAT}")
    return raw


def _shapes(path: str, raw: dict, which: str) -> dict[int, tuple[int, int, int] | None]:
    try:
        out = {int(b): None if shape is None else tuple(int(shape[k]) for k in SHAPE_KEYS)
               for b, shape in raw[which].items()}
        if _elsewhere(raw) is not None and isinstance(raw.get("rows"), list):
            out = _smallest_paying(raw["rows"], out, which)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, e) from None
    if not out:
        raise TuneError(f"{path} lists no batch sizes")
    return out


def _smallest_paying(rows: list, table: dict, which: str) -> dict[int, tuple[int, int, int] | None]:
    """A table measured on another machine: per batch size, the smallest tree (fewest draft tokens, then steps) that
    was faster than plain decoding there, where the table chose a tree (``which="best_speculative"``: at every batch
    size, the smallest measured tree where none was faster). Its step cost depends least on the machine's: the
    shipped SmolLM2 table's (5,4,8), chosen on an AVX-512 Xeon, ran at 0.70x plain on an AVX2 Zen 1 VM, where its
    smallest paying tree (1,2,3) ran at 1.21x (docs/benchmarks.md, fifty-ninth session)."""
    out = {}
    for b, shape in table.items():
        measured = [r for r in rows if int(r["batch_size"]) == b and r["shape"] is not None]
        paying = [r for r in measured if float(r["speedup"]) > 1.0]
        pool = paying or (measured if which == "best_speculative" else [])
        if (shape is None and which == "batch_sizes") or not pool:
            out[b] = shape
            continue
        best = min(pool, key=lambda r: (int(r["shape"][2]), int(r["shape"][0]), -float(r["speedup"])))
        out[b] = tuple(int(x) for x in best["shape"])
    return out


def this_machine() -> tuple[str, str | None, str | None]:
    """(this CPU's model, its vector extension, the accelerator's device kind or None on a CPU), as
    ``same_machine`` compares them."""
    dev = jax.devices()[0]
    accelerator = None if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)
    return cpu_model(), cpu_vector_extension(), accelerator


def _elsewhere(raw: dict) -> str | None:
    """The machine a table names when it is not this kind of machine (``same_machine``), else None."""
    machine = raw.get("machine")
    if not isinstance(machine, str) or not machine:
        return None
    return None if same_machine(machine, *this_machine()) else machine


def tuned_elsewhere(folder_or_file: str | None, dtype: str | None = None) -> tuple[str, str] | None:
    """(the file, the machine it names) of a head's tree table for ``dtype`` measured on another kind of machine:
    its trees are then the smallest that paid there (``_smallest_paying``); None without a table or where it was
    measured on this kind of machine."""
    path = table_path(folder_or_file, dtype)
    machine = None if path is None else _elsewhere(_read(path))
    return None if machine is None else (path, machine)


def load_tune(folder_or_file: str | None, which: str = "batch_sizes",
              dtype: str | None = None) -> dict[int, tuple[int, int, int] | None] | None:
    """{batch size: (num_steps, eagle_topk, num_draft_tokens) or None (plain)} from a head folder's tune file, or
    None when there is no such file. ``which="best_speculative"``: the fastest tree shape per batch size even where
    plain decoding was faster (what to run when speculation is asked for explicitly). ``dtype``: the served dtype
    (a folder's table for it when there is one, see ``filename``)."""
    path = table_path(folder_or_file, dtype)
    return None if path is None else _shapes(path, _read(path), which)


def load_tune_costs(folder_or_file: str | None,
                    dtype: str | None = None) -> dict[int, tuple[tuple[int, int, int], float, float]] | None:
    """{batch size: (the fastest tree shape, its measured accept length tau, its measured speedup over plain
    decoding)} from a head folder's tune file for ``dtype`` (the rows ``bench tune`` measured), or None without a
    file."""
    path = table_path(folder_or_file, dtype)
    if path is None:
        return None
    raw = _read(path)
    best = _shapes(path, raw, "best_speculative")
    out = {}
    try:
        for b, shape in best.items():
            row = next(r for r in raw["rows"] if int(r["batch_size"]) == b and r["shape"] is not None
                       and tuple(int(x) for x in r["shape"]) == shape)
            out[b] = (shape, float(row["tau"]), float(row["speedup"]))
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise _bad(path, e) from None
    return out


def same_machine(tuned: str, cpu_model: str, vector: str | None, accelerator: str | None) -> bool:
    """Whether a table measured on ``tuned`` (the bench tools' machine description: "N-core CPU (MODEL, arch[,
    VECTOR]), no accelerator | K x DEVICE, JAX ...") holds here: on a CPU (``accelerator`` None) the same CPU model
    and vector extension (a description without one, from before it was recorded: the model alone) and no
    accelerator; else the same device kind. A tree step's cost in plain steps is the machine's: the shipped SmolLM2
    table was tuned on an Intel Xeon, where a 3-4-row verify costs less than on the Zen 5 VM (docs/benchmarks.md,
    thirty-ninth session), and an 8-row step costs 1.1 plain steps there, 2.1 on an AVX2 Zen 1 "AMD EPYC"
    (fifty-ninth session) where the Zen 5 one has AVX-512."""
    if accelerator is None:
        named = next((v for v in VECTOR_EXTENSIONS if f", {v})," in tuned), None)
        return f"({cpu_model}," in tuned and "no accelerator" in tuned and named in (None, vector)
    return f"x {accelerator}," in tuned


def tuned_size(sizes, batch_size: int) -> int:
    """The tuned batch size whose entry ``batch_size`` takes: the largest not above it (else the smallest)."""
    sizes = sorted(sizes)
    below = [b for b in sizes if b <= batch_size]
    return below[-1] if below else sizes[0]


def shape_for(table: dict[int, tuple[int, int, int] | None], batch_size: int) -> tuple[int, int, int] | None:
    """The tuned shape for ``batch_size`` (None: plain decoding)."""
    return table[tuned_size(table, batch_size)]


@dataclasses.dataclass
class _Entry:
    shape: tuple[int, int, int] | None  # the tree this batch size may run (None: target-only steps only)
    cost: float | None = None  # a tree step over a plain step, as measured; None: a fixed entry, never re-decided
    tau: float = 1.0  # the accept length the tuning measured (the live average starts there)


class TreeChoice:
    """The tree shape of each speculative step, by batch bucket: ``bench tune``'s table, re-decided on live traffic.

    Fixed entries ({size: shape or None}, :meth:`fixed`) always run what they say. Measured entries
    (:meth:`measured`, from :func:`load_tune_costs`) know what their tree costs: the tuning measured its speedup s
    and accept length tau at that batch size, so a tree step costs c = tau / s plain steps, and speculating pays
    while the head's accept length on the traffic being served stays above c. That live accept length is kept per
    shape, a decaying average over the rows of recent speculative steps (about ``horizon`` row-steps, starting from
    the tuned tau with the weight of ``prior`` row-steps). While a bucket runs target-only steps it still runs the
    tree now and then (a probe), so that the average can follow the traffic back up. A probe costs at most c - 1
    plain steps, so the first one comes after max(``probe_every``, (c - 1) / ``probe_budget``) target-only steps
    (probes take at most that fraction of the time), and each probe after which the tree still does not pay doubles
    the interval, up to ``max_probe_every``: a bucket that stays off pays almost nothing for them. Any choice is
    lossless: the output is the same token for token.

    A head tuned on one prompt set and served on another thus speculates where its acceptance there pays, and
    stops where it does not (SGLang keeps one shape)."""

    def __init__(self, entries: dict[int, _Entry], *, horizon: float = 512.0, prior: float = 32.0,
                 probe_every: int = 16, max_probe_every: int = 256, probe_budget: float = 0.02, log=None):
        if not entries:
            raise ValueError("a TreeChoice needs at least one batch size")
        self.entries = dict(sorted(entries.items()))
        self.horizon, self.probe_every, self.max_probe_every = float(horizon), int(probe_every), int(max_probe_every)
        self._live: dict[tuple, list[float]] = {}
        for e in self.entries.values():
            if e.shape is not None and e.cost is not None and e.shape not in self._live:
                self._live[e.shape] = [e.tau * prior, float(prior)]
        self._skipped = {b: 0 for b in self.entries}  # target-only steps since the last probe
        # target-only steps between probes, at first and now
        self._first_interval = {b: self._budgeted(e, probe_budget) for b, e in self.entries.items()}
        self._interval = dict(self._first_interval)
        self._pays: dict[int, bool] = {}
        self._log = log or _log.info

    def _budgeted(self, e: _Entry, budget: float) -> int:
        if e.cost is None or budget <= 0:
            return self.probe_every
        wanted = math.ceil(max(e.cost - 1.0, 0.0) / budget)
        return min(max(self.probe_every, wanted), max(self.max_probe_every, self.probe_every))

    @classmethod
    def fixed(cls, table: dict[int, tuple[int, int, int] | None], **kw) -> "TreeChoice":
        return cls({int(b): _Entry(None if s is None else tuple(s)) for b, s in table.items()}, **kw)

    @classmethod
    def measured(cls, costs: dict[int, tuple[tuple[int, int, int], float, float]], **kw) -> "TreeChoice":
        return cls({int(b): _Entry(tuple(shape), tau / max(speedup, 1e-9), tau)
                    for b, (shape, tau, speedup) in costs.items()}, **kw)

    def _entry(self, nb: int) -> tuple[int, _Entry]:
        b = tuned_size(self.entries, nb)
        return b, self.entries[b]

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every tree shape a step may run."""
        return sorted({e.shape for e in self.entries.values() if e.shape is not None})

    def options(self, nb: int) -> list[tuple[int, int, int] | None]:
        """What a step over batch bucket ``nb`` may run: its tree, and a target-only step where that is re-decided."""
        e = self._entry(nb)[1]
        return [e.shape] if e.cost is None or e.shape is None else [e.shape, None]

    def accept_length(self, shape) -> float:
        """The live accept length of ``shape`` (tokens per row per speculative step)."""
        num, den = self._live[tuple(shape)]
        return num / den

    def choose(self, nb: int) -> tuple[int, int, int] | None:
        """The tree of a step over batch bucket ``nb``, or None for a target-only step."""
        b, e = self._entry(nb)
        if e.shape is None or e.cost is None:
            return e.shape
        tau = self.accept_length(e.shape)
        pays = tau >= e.cost
        was = self._pays.get(b)
        if was is not None and was != pays:
            self._log(f"speculation {'on' if pays else 'off'} at batch size >= {b}: live accept length {tau:.2f} "
                      f"{'>=' if pays else '<'} the {e.shape} tree's step cost {e.cost:.2f} plain steps")
        self._pays[b] = pays
        if pays:
            self._interval[b], self._skipped[b] = self._first_interval[b], 0
            return e.shape
        if was is False and self._skipped[b] == 0:  # the last step was a probe, and the tree still does not pay
            self._interval[b] = min(2 * self._interval[b], self.max_probe_every)
        self._skipped[b] += 1
        if self._skipped[b] < self._interval[b]:
            return None
        self._skipped[b] = 0
        return e.shape

    def record(self, shape, tokens: int, rows: int) -> None:
        """A step of ``shape`` emitted ``tokens`` tokens over ``rows`` running rows."""
        if shape is None or rows <= 0 or tuple(shape) not in self._live:
            return
        live = self._live[tuple(shape)]
        keep = math.exp(-rows / self.horizon)
        live[0] = live[0] * keep + float(tokens)
        live[1] = live[1] * keep + float(rows)
