"""Regenerate a chat dataset with the TARGET: every assistant turn is answered again by the target model itself.

    python -m specjax.train.regenerate --model ~/.cache/specjax/SmolLM2-135M-Instruct --data sharegpt \
        --out ~/.cache/specjax/sharegpt-smollm2-regen.jsonl --max-conversations 4000

A draft head is accepted where it predicts what the TARGET says, not what ChatGPT said in ShareGPT, so the published
trainers (EAGLE, HASS, SpecForge) answer the prompts with the target first; it is the biggest lever on acceptance.

How: conversations are read with the trainer's own reader and cleaner (``data.iter_records`` / ``data.to_messages``,
so every conversation format the trainer reads works here; preformatted text has no turns to answer and is counted
as ``bad_format``), the human turns are kept, and the assistant turns are produced in
rounds: round r answers the r-th user turn of every conversation in a chunk, given the regenerated history, with
specjax's batched engine (``specjax.generate``: one jitted while loop per batch, rows of similar prompt length
batched together). Greedy by default (``--temperature`` > 0 samples). A conversation stops growing at its last
human turn, at ``--max-turns``, when the rendered prompt would exceed ``--max-prompt-tokens``, or when the target
answers with nothing.

Output: JSONL, one ``{"id", "messages": [{"role", "content"}, ...], "source_index"}`` per conversation, the format
the trainer reads (``data.format: messages`` or ``auto``). Written a chunk at a time, flushed and fsynced, so a
killed run loses at most one chunk; a rerun skips every ``source_index`` already in the file (resumable).
Records that cannot be used are counted by reason and skipped; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import sys
import time
from typing import Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from specjax import generate as gen
from specjax.cli import error_text, option, options_parser, parse_into
from specjax.config import DTYPES
from specjax.hub import enable_compilation_cache
from specjax.train import data as data_lib
from specjax.train.config import DataConfig
from specjax.weights import load_model, resolve_model_path, stop_token_ids


@dataclasses.dataclass
class RegenConfig:
    """What ``python -m specjax.train.regenerate`` does (its flags are these fields)."""
    model: str = option(required=True, metavar="PATH", help="target model folder (or hub id when online)")
    out: str = option(required=True, metavar="FILE", help="output messages JSONL (appended to; resumable)")
    data: Sequence[str] = option(("sharegpt",), nargs="+", metavar="PATH",
                                 help="input files (ShareGPT JSON/JSONL, messages JSONL, parquet, ...) or 'sharegpt' "
                                      "(default)")
    format: str = option("auto", choices=("auto", "sharegpt", "messages"), help="input record shape")
    max_conversations: int = option(0, help="read at most this many input records (0 = all) (default 0)")
    first_conversation: int = option(0, help="skip the input records before this index, to regenerate a new slice of "
                                             "a dataset (default 0)")
    max_turns: int = option(3, help="user turns answered per conversation (default 3)")
    max_prompt_tokens: int = option(1024, help="stop a conversation when its rendered prompt is longer (default 1024)")
    max_new_tokens: int = option(384, help="tokens per answer (default 384)")
    batch_size: int = option(16, help="prompts decoded together (default 16)")
    chunk: int = option(64, help="conversations per written chunk (a kill loses at most one) (default 64)")
    temperature: float = option(0.0, help="0 = greedy (default 0.0)")
    top_p: float = option(1.0, help="nucleus sampling (with temperature > 0) (default 1.0)")
    seed: int = option(0, help="sampling seed (default 0)")
    dtype: str | None = option(None, choices=("auto", *DTYPES),
                               help="target dtype (default: the checkpoint's)")


@dataclasses.dataclass
class Conversation:
    source_index: int
    id: str
    users: list[dict]  # the system message (if any) then the user turns, in order
    messages: list[dict] = dataclasses.field(default_factory=list)  # regenerated so far
    done: bool = False


def done_indices(path: str) -> set[int]:
    """``source_index`` of every complete record already written (a torn last line is ignored and rewritten)."""
    seen: set[int] = set()
    if not os.path.exists(path):
        return seen
    with open(path, "rb") as f:
        for line in f:
            try:
                seen.add(int(json.loads(line)["source_index"]))
            except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError):
                continue
    return seen


def _truncate_torn_tail(path: str) -> None:
    """Drop a last line without its newline (a run killed mid-write) so that appends start on a fresh line."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def iter_conversations(cfg: RegenConfig, skip: set[int], stats: collections.Counter) -> Iterable[Conversation]:
    """Usable conversations (human turns only), in file order, skipping those already written."""
    dcfg = DataConfig(paths=list(cfg.data), format=cfg.format)
    for i, rec in enumerate(data_lib.iter_records(dcfg)):
        if not _in_slice(cfg, i):
            if i >= cfg.first_conversation:
                return  # past the slice's end
            stats["before_first_conversation"] += 1  # said when nothing is left: a --first-conversation past the end
            continue
        if i in skip:
            stats["already_done"] += 1
            continue
        try:
            msgs = data_lib.to_messages(rec, cfg.format, prompts=True)
        except data_lib.BadRecord as e:
            stats[e.reason] += 1
            continue
        system = [m for m in msgs[:1] if m["role"] == "system"]
        users = system + [m for m in msgs if m["role"] == "user"][: cfg.max_turns]
        rid = rec.get("id") if isinstance(rec, dict) else None
        yield Conversation(source_index=i, id=str(rid if rid is not None else i), users=users)


def _in_slice(cfg: RegenConfig, i: int) -> bool:
    """Whether input record ``i`` is in the slice ``--first-conversation`` / ``--max-conversations`` select."""
    return i >= cfg.first_conversation and not (cfg.max_conversations and
                                                i >= cfg.first_conversation + cfg.max_conversations)


def usable_conversations(cfg: RegenConfig, skip: set[int], stats: collections.Counter) -> Iterator[Conversation]:
    """``iter_conversations``, read up to the first usable one now: a NoUsableData (before the model loads) when the
    slice holds none and none of it was already written (was "wrote 0 conversations" and exit status 0)."""
    convs = iter_conversations(cfg, skip, stats)
    first = next(convs, None)
    if first is None and not stats["already_done"]:
        counts = ", ".join(f"{k} {v:,}" for k, v in sorted(stats.items())) or "no records"
        before = stats["before_first_conversation"]
        past = (f"; --first-conversation {cfg.first_conversation:,} is past its {before:,} records"
                if before and before == sum(stats.values()) else "")
        raise data_lib.NoUsableData(f"no usable conversations in {', '.join(cfg.data)} (counts: {counts}){past}")
    return itertools.chain([first] if first else [], convs)


def _next_prompt(conv: Conversation) -> list[dict] | None:
    """The messages to answer next (history + the next user turn), or None when the conversation is complete."""
    n_sys = 1 if conv.users and conv.users[0]["role"] == "system" else 0
    turn = sum(m["role"] == "assistant" for m in conv.messages)
    user_turns = conv.users[n_sys:]
    if conv.done or turn >= len(user_turns):
        return None
    history = conv.messages if conv.messages else conv.users[:n_sys]
    return list(history) + [user_turns[turn]]


class Regenerator:
    """Holds the loaded target and answers rounds of prompts in length-sorted batches."""

    def __init__(self, cfg: RegenConfig):
        self.cfg = cfg
        folder = resolve_model_path(cfg.model)
        self.model_cfg, self.params = load_model(folder, dtype=cfg.dtype, layout="decode")  # as generate runs it
        self.tokenizer = gen.load_tokenizer(folder)
        self.stop_ids = stop_token_ids(folder, self.model_cfg, self.tokenizer)
        self.generated_tokens = 0

    def answer(self, prompts: list[list[dict]], seed: int) -> list[tuple[str, bool] | None]:
        """One (answer, cut at max_new_tokens) per prompt (None: the prompt is over the length limit)."""
        texts = [self.tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        out: list[tuple[str, bool] | None] = [None] * len(prompts)
        order = [i for i in np.argsort([len(x) for x in ids], kind="stable")
                 if len(ids[i]) <= self.cfg.max_prompt_tokens]
        bs = self.cfg.batch_size
        for start in range(0, len(order), bs):
            rows = order[start:start + bs]
            toks = gen.generate(self.params, self.model_cfg, [ids[i] for i in rows],
                                max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                top_p=self.cfg.top_p, seed=[seed + int(i) for i in rows],
                                stop_token_ids=self.stop_ids)
            for i, t in zip(rows, toks):
                self.generated_tokens += len(t)
                cut = not t or t[-1] not in self.stop_ids  # the budget ran out before the target's stop token
                out[i] = self.tokenizer.decode(t, skip_special_tokens=True).strip(), cut
        return out

    def run_chunk(self, convs: list[Conversation], stats: collections.Counter, chunk_seed: int) -> None:
        """Answer every turn of ``convs`` in rounds (round r answers each conversation's r-th user turn)."""
        for rnd in range(self.cfg.max_turns):
            live = [(c, p) for c in convs if (p := _next_prompt(c)) is not None]
            if not live:
                return
            answers = self.answer([p for _, p in live], seed=chunk_seed + 100_003 * rnd)
            for (c, p), got in zip(live, answers):
                if got is None:
                    stats["prompt_too_long" if not c.messages else "turns_cut_at_length"] += 1
                    c.done = True
                elif not got[0]:
                    stats["empty_answer"] += 1
                    c.done = True
                elif got[1]:  # kept, marked: the trainer learns no end of turn the target did not write; no more
                    stats["answers_cut_at_max_new_tokens"] += 1  # turns after an answer the target had not finished
                    c.messages = p + [{"role": "assistant", "content": got[0], "truncated": True}]
                    c.done = True
                else:
                    c.messages = p + [{"role": "assistant", "content": got[0]}]


def _write_chunk(f, convs: list[Conversation], stats: collections.Counter) -> int:
    n = 0
    for c in convs:
        if not any(m["role"] == "assistant" for m in c.messages):
            continue  # counted when it was cut
        f.write(json.dumps({"id": c.id, "messages": c.messages, "source_index": c.source_index},
                           ensure_ascii=False) + "\n")
        n += 1
    f.flush()
    os.fsync(f.fileno())
    stats["written"] += n
    return n


def regenerate(cfg: RegenConfig, log=print) -> collections.Counter:
    """Regenerate ``cfg.data`` into ``cfg.out`` (appending; resumable). Returns the counters."""
    out = os.path.abspath(os.path.expanduser(cfg.out))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    _truncate_torn_tail(out)
    skip = done_indices(out)
    if skip:
        log(f"resuming: {len(skip):,} conversations already in {out}")
    stats: collections.Counter = collections.Counter()
    convs = usable_conversations(cfg, skip, stats)
    regen = Regenerator(cfg)
    t0 = time.perf_counter()
    bar = tqdm(desc="regenerate", unit="conv", total=cfg.max_conversations or None,
               initial=sum(_in_slice(cfg, i) for i in skip), dynamic_ncols=True)  # the slice's, not other slices'
    chunk: list[Conversation] = []
    with open(out, "a", encoding="utf-8") as f:
        def flush(chunk):
            regen.run_chunk(chunk, stats, chunk_seed=cfg.seed * 1_000_003 + chunk[0].source_index)
            _write_chunk(f, chunk, stats)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{regen.generated_tokens / (time.perf_counter() - t0):.0f}",
                            written=stats["written"])
        for conv in convs:
            chunk.append(conv)
            if len(chunk) == cfg.chunk:
                flush(chunk)
                chunk = []
        if chunk:
            flush(chunk)
    bar.close()
    dt = time.perf_counter() - t0
    log(f"generated {regen.generated_tokens:,} tokens in {dt:.0f} s ({regen.generated_tokens / max(dt, 1e-9):.0f} "
        f"tok/s); wrote {stats['written']:,} conversations to {out}")
    log("counts: " + ", ".join(f"{k} {v:,}" for k, v in sorted(stats.items())))
    return stats


def _parser() -> argparse.ArgumentParser:
    return options_parser(
        RegenConfig, "python -m specjax.train.regenerate",
        "Answer a chat dataset's prompts with the TARGET model (specjax's batched engine) and write messages JSONL "
        "for the trainer. Resumable: rerun the same command to continue.",
        epilog="example:\n  python -m specjax.train.regenerate --model ~/.cache/specjax/SmolLM2-135M-Instruct "
               "--data sharegpt --out regen.jsonl --max-conversations 2000")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_into(RegenConfig, _parser(), argv)
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype=None)
    for name in ("max_turns", "max_prompt_tokens", "max_new_tokens", "batch_size", "chunk"):
        if getattr(cfg, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if cfg.max_conversations < 0 or cfg.first_conversation < 0 or cfg.temperature < 0:
        print("error: --max-conversations, --first-conversation and --temperature must be >= 0", file=sys.stderr)
        return 2
    enable_compilation_cache()
    try:
        regenerate(cfg)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {error_text(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
