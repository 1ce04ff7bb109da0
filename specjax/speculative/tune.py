"""The tuned tree shape per batch size, stored next to a draft head as ``speculative_tune.json``.

Written by ``python -m specjax.bench tune`` (measured tokens/s of every candidate shape and of plain decoding on a
prompt set); read by the server and ``specjax.Engine`` when the tree flags are not given. Format 1:

    {"format": 1, "algorithm": "EAGLE3", "batch_sizes": {"1": {"num_steps": 7, "eagle_topk": 1,
     "num_draft_tokens": 8}, "16": null, ...}, "best_speculative": {"1": {...}, "16": {...}},
     ...measurement details...}

``null`` means plain decoding was faster at that batch size; ``best_speculative`` keeps the fastest tree shape of
every batch size regardless. The server serves plain decoding when every tuned batch size says ``null`` (unless
tree flags are given); ``python -m specjax.generate`` runs the best speculative shape and reports the ratio. A batch size between two tuned ones uses the entry of
the largest tuned size not above it (the smallest tuned size below the first).
"""

from __future__ import annotations

import json
import os

FORMAT = 1
FILENAME = "speculative_tune.json"
SHAPE_KEYS = ("num_steps", "eagle_topk", "num_draft_tokens")


class TuneError(ValueError):
    """A speculative_tune.json that cannot be used; the message names the file and the problem."""


def save_tune(path: str, table: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_tune(folder_or_file: str | None, which: str = "batch_sizes") -> dict[int, tuple[int, int, int] | None] | None:
    """{batch size: (num_steps, eagle_topk, num_draft_tokens) or None (plain)} from a head folder's tune file, or
    None when there is no such file. ``which="best_speculative"``: the fastest tree shape per batch size even where
    plain decoding was faster (what to run when speculation is asked for explicitly)."""
    if not folder_or_file:
        return None
    path = folder_or_file
    if os.path.isdir(path):
        path = os.path.join(path, FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
        if raw.get("format") != FORMAT:
            raise TuneError(f"{path}: format {raw.get('format')!r}, this specjax reads format {FORMAT}")
        out = {}
        for b, shape in raw[which].items():
            out[int(b)] = None if shape is None else tuple(int(shape[k]) for k in SHAPE_KEYS)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, TuneError):
            raise
        raise TuneError(f"{path} is not a valid {FILENAME} ({type(e).__name__}: {e}); rerun "
                        f"`python -m specjax.bench tune` or delete it") from None
    if not out:
        raise TuneError(f"{path} lists no batch sizes")
    return out


def shape_for(table: dict[int, tuple[int, int, int] | None], batch_size: int) -> tuple[int, int, int] | None:
    """The tuned shape for ``batch_size`` (None: plain decoding)."""
    sizes = sorted(table)
    below = [b for b in sizes if b <= batch_size]
    return table[below[-1] if below else sizes[0]]
