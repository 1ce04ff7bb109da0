"""Chat data -> tokenized conversations with an assistant-only loss mask -> bucketed, sharded global batches.

Inputs (``data.paths`` / ``data.hf_datasets``): ShareGPT JSON/JSONL (``conversations`` of ``{from, value}``,
roles human/gpt/system), OpenAI-style ``messages`` JSONL (``{role, content}``), any ``datasets`` dataset (hub name,
parquet, or a ``save_to_disk`` folder) holding either shape, and the name ``sharegpt`` (the cleaned ShareGPT file
that ``specjax.hub`` downloads into the cache); preformatted ``text`` (SpecForge's ``--is-preformatted``: a
conversation already rendered with the chat template, its assistant turns found by the template's header and
end-of-turn marker, ``ChatEncoder.text_spans``).

Rendering: the TARGET tokenizer's chat template. Assistant spans are found by rendering incrementally: turn i's
tokens start where ``render(messages[:i], add_generation_prompt=True)`` stops matching the full rendering, and end
where ``render(messages[:i+1])`` ends (or, when a template renders a turn differently once it is no longer last,
e.g. Qwen3 dropping thinking spans from history, at the template's end-of-turn marker). The mask covers the
assistant's text and its end-of-turn token, not the role header, nor a thinking span that the generation prompt
itself injects. Character spans map to tokens through the fast tokenizer's offsets on the one full rendering.

Batches: lengths are rounded up to a few ``buckets``; each global batch (grad_accum x batch_size rows) holds
conversations of one bucket, so the step compiles once per bucket. The order is a deterministic function of
(seed, epoch); the iterator state is ``{"epoch", "position"}``. Every process builds the same plan and
materialises only the rows its devices hold; ``jax.make_array_from_process_local_data`` assembles the global array.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import json
import logging
import os
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from specjax import weights
from specjax.hub import ParseProblem, default_cache_dir as cache_root, fetch_sharegpt, parse_truncated_json_array
from specjax.train.config import DataConfig

_log = logging.getLogger("specjax.train.data")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "tool": "tool"}


class NoUsableData(ValueError):
    """Data the run cannot use (a path that does not exist, a file of unknown format, a dataset in which no
    conversation survives cleaning): the user's data to fix, not a bug; the CLIs print it as an error."""


class BadRecord(Exception):
    """A conversation that cannot be used; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---- reading records -----------------------------------------------------------------------------------------------
COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}


def open_binary(path: str):
    """The file's bytes, decompressed when its name ends in .gz, .bz2 or .xz."""
    ext = os.path.splitext(path)[1].lower()
    if ext in COMPRESSION:
        import importlib
        return importlib.import_module(COMPRESSION[ext]).open(path, "rb")
    return open(path, "rb")


def _problem(path: str, exc, log: Callable[[str], None]) -> BadRecord:
    """A place in ``path`` that cannot be parsed (a hub.ParseProblem): said (where) in the log, counted (why)
    in the skipped table."""
    log(f"data: {path}: {exc}")
    return BadRecord(exc.reason, str(exc))


def _read_json_array(path: str, log: Callable[[str], None]) -> Iterator[Any]:
    """Items of a top-level JSON array; an unparseable item or a cut-off tail is logged with its place and
    counted, the items after a bad one are still read."""
    with open_binary(path) as f:
        text = f.read().decode("utf-8", errors="surrogatepass")
    for item in parse_truncated_json_array(text):
        yield _problem(path, item, log) if isinstance(item, ParseProblem) else item


def _read_jsonl(path: str, log: Callable[[str], None]) -> Iterator[Any]:
    lineno = 0
    try:
        with open_binary(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    log(f"data: {path}: line {lineno} does not parse ({str(e)[:80]})")
                    yield BadRecord("undecodable", f"line {lineno}: {str(e)[:80]}")
    except (EOFError, OSError) as e:  # a cut-off or damaged compressed file
        msg = f"the file cannot be read past line {lineno} ({type(e).__name__}: {e})"
        log(f"data: {path}: {msg}")
        yield BadRecord("truncated_file", msg)


def _read_local(path: str, log: Callable[[str], None]) -> Iterator[Any]:
    if os.path.isdir(path):
        import datasets
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        yield from ds
        return
    low = path.lower()
    base = low[:-len(os.path.splitext(low)[1])] if os.path.splitext(low)[1] in COMPRESSION else low
    if base.endswith(".jsonl"):
        yield from _read_jsonl(path, log)
    elif base.endswith(".json"):
        with open_binary(path) as f:
            head = f.read(4096).lstrip()
        if head.startswith(b"["):
            yield from _read_json_array(path, log)
        else:
            _refuse_one_object(path)
            yield from _read_jsonl(path, log)  # JSON lines named .json
    elif low.endswith((".parquet", ".arrow", ".csv")):
        import datasets
        kind = {"parquet": "parquet", "arrow": "arrow", "csv": "csv"}[low.rsplit(".", 1)[1]]
        yield from datasets.load_dataset(kind, data_files=path, split="train")
    else:
        raise NoUsableData(f"data file {path}: unknown format (use .json, .jsonl (optionally .gz, .bz2 or .xz "
                           f"compressed), .parquet, .arrow or a datasets.save_to_disk folder)")


def _refuse_one_object(path: str) -> None:
    """A .json file whose first line is not a JSON value but whose whole text is one object (pretty-printed, e.g.
    ``{"data": [...]}``) is refused in one line, not read as JSON lines that each fail to parse. Only a short first
    line (an object's opening) makes it read the whole file."""
    with open_binary(path) as f:
        first = f.readline().strip()
    try:
        json.loads(first.decode("utf-8"))
        return
    except (UnicodeDecodeError, json.JSONDecodeError):
        if len(first) > 4096:
            return  # a long record cut or damaged: read as JSON lines, the bad one counted
    try:
        with open_binary(path) as f:
            whole = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, EOFError, OSError):
        return  # not one object either: read as JSON lines, each bad line counted
    if isinstance(whole, dict):
        lists = [k for k, v in whole.items() if isinstance(v, list)]
        where = " (one record over several lines)" if {"conversations", "messages", "text"} & set(whole) else \
            f" (its records look to be under {lists[0]!r})" if len(lists) == 1 else ""
        raise NoUsableData(f"data file {path} is one JSON object{where}, not records: write the records as a "
                           f"top-level JSON array or as JSON lines (one record per line)")


def resolve_paths(paths: Iterable[str]) -> list[str]:
    out = []
    for p in paths:
        if p == "sharegpt":
            out.append(str(fetch_sharegpt()))
            continue
        p = os.path.expanduser(p)
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
        if not hits or not all(os.path.exists(h) for h in hits):
            raise NoUsableData(f"data path {p} does not exist (a data path is a file, folder or glob, or sharegpt; "
                               f"a regenerated set is written by `python -m specjax.train.regenerate`)")
        out.extend(hits)
    return out


def iter_records(cfg: DataConfig, log: Callable[[str], None] | None = None) -> Iterator[Any]:
    """Raw records of every source in order (BadRecord instances for places that could not be parsed, each also
    reported through ``log`` with the file and where in it; default: the module's logger)."""
    log = log or _log.warning
    for path in resolve_paths(cfg.paths):
        yield from _read_local(path, log)
    for name in cfg.hf_datasets:
        import datasets
        yield from datasets.load_dataset(name, split=cfg.split)


# ---- normalising a record ------------------------------------------------------------------------------------------
def to_messages(record: Any, fmt: str = "auto", prompts: bool = False) -> list[dict[str, Any]]:
    """A record in either supported shape -> [{"role": system|user|assistant|tool, "content": str}] (an assistant
    turn keeps its ``reasoning_content``, which thinking models' templates render, its ``tool_calls``, and
    regenerate's ``truncated``), cleaned: leading assistant and tool turns dropped, cut at the first empty turn (an
    assistant turn that calls tools, or a tool's answer, may be empty), trailing non-assistant turns dropped.
    ``prompts=True`` (regeneration, where only the user turns matter): the record needs a user turn with text, not
    an answer, trailing user turns are kept, and tool turns are refused (their answers would not follow)."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("bad_format", f"record is a {type(record).__name__}")
    if fmt in ("auto", "sharegpt") and _has(record, "conversations"):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif fmt in ("auto", "messages") and _has(record, "messages"):
        turns, role_key, text_key = record["messages"], "role", "content"
    elif _has(record, "text"):
        raise BadRecord("bad_format", "preformatted text (a `text` field) where turns are needed")
    else:
        wanted = {"sharegpt": "conversations", "messages": "messages"}.get(fmt, "conversations or messages")
        raise BadRecord("bad_format", f"no {wanted} field")
    if not isinstance(turns, list):
        raise BadRecord("bad_format", "turns are not a list")
    return _cleaned([_message(t, role_key, text_key) for t in turns], prompts)


def _has(record: dict, key: str) -> bool:
    """Whether the record has ``key`` with a value: a table (parquet, a hub set) that mixes shapes gives every row
    every column, None where a row has none."""
    return record.get(key) is not None


def record_text(record: Any, fmt: str = "auto") -> str | None:
    """A preformatted record's text (``data.format: text``, SpecForge's ``--is-preformatted``: the conversation
    already rendered with the target's chat template, in ``text``; ``auto`` reads a record with ``text`` and no
    turns as one), else None."""
    if fmt not in ("auto", "text") or isinstance(record, BadRecord):
        return None
    if fmt == "auto" and not (isinstance(record, dict) and _has(record, "text")
                              and not _has(record, "conversations") and not _has(record, "messages")):
        return None
    if not isinstance(record, dict) or not _has(record, "text"):
        raise BadRecord("bad_format", "no text field")
    text = _checked_text(record["text"], "text")
    if not text.strip():
        raise BadRecord("empty", "empty text")
    return text


def _checked_text(value: Any, what: str) -> str:
    """``value`` when it is a string of valid Unicode, else a BadRecord naming ``what``."""
    if not isinstance(value, str):
        raise BadRecord("bad_format", f"{what} is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord("undecodable", f"invalid unicode in {what}") from None
    return value


def _message(t: Any, role_key: str, text_key: str) -> dict[str, Any]:
    """One turn as {"role", "content"} plus an assistant turn's extras, or a BadRecord."""
    if not isinstance(t, dict):
        raise BadRecord("bad_format", "turn is not a mapping")
    role = t.get(role_key, t.get("role", t.get("from")))
    text = t.get(text_key, t.get("content", t.get("value")))
    if not isinstance(role, str) or role.lower() not in ROLES:
        raise BadRecord("wrong_role", repr(role)[:40])
    text = _checked_text("" if text is None else text, "content")
    m: dict[str, Any] = {"role": ROLES[role.lower()], "content": text}
    if m["role"] == "assistant":
        if t.get("truncated") is True:  # cut at a token budget (regenerate)
            m["truncated"] = True
        if isinstance(t.get("reasoning_content"), str) and t["reasoning_content"].strip():
            m["reasoning_content"] = t["reasoning_content"]  # a thinking model's template renders it
        if t.get("tool_calls"):
            m["tool_calls"] = _tool_calls(t["tool_calls"])
    return m


def _json_value(value: Any, what: str) -> Any:
    """``value``, or the JSON it spells when it is a string (datasets store tool calls and tools both ways)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise BadRecord("bad_format", f"{what} is not valid JSON") from None


def _tool_calls(value: Any) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as chat templates read them (OpenAI's shape, arguments as a mapping)."""
    calls = _json_value(value, "tool_calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise BadRecord("bad_format", "tool_calls is not a list of calls")
    out = []
    for c in calls:
        fn = c.get("function", c)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecord("bad_format", "a tool call has no function name")
        args = _json_value(fn.get("arguments", {}), "tool call arguments")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}, "id": c.get("id", "")})
    return out


def record_tools(record: Any) -> list[dict[str, Any]] | None:
    """The tool definitions a record offers its chat template (``tools``), if any."""
    tools = _json_value(record.get("tools"), "tools") if isinstance(record, dict) else None
    if tools in (None, [], ""):
        return None
    if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
        raise BadRecord("bad_format", "tools is not a list of tool definitions")
    return tools


# what may follow each role (SpecForge's rule: tools answer an assistant's calls; the assistant goes on after them)
_NEXT = {"user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant", "user")}


def _cleaned(msgs: list[dict[str, Any]], prompts: bool) -> list[dict[str, Any]]:
    if any(m["role"] == "system" for m in msgs[1:]):
        raise BadRecord("wrong_role", "system message after the first turn")
    if prompts and any(m["role"] == "tool" for m in msgs):
        raise BadRecord("wrong_role", "tool turns are not regenerated")
    system = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    rest = msgs[len(system):]
    while rest and rest[0]["role"] in ("assistant", "tool"):  # ShareGPT sometimes starts mid-conversation
        rest = rest[1:]
    for i, m in enumerate(rest):
        if not m["content"].strip() and m["role"] != "tool" and not m.get("tool_calls"):
            rest = rest[:i]
            break
    keep = "user" if prompts else "assistant"
    while rest and rest[-1]["role"] not in ("assistant", keep):
        rest = rest[:-1]
    if not any(m["role"] == keep for m in rest):
        raise BadRecord("empty", f"no {keep} turn with text")
    for a, b in zip(rest, rest[1:]):
        if b["role"] not in _NEXT[a["role"]]:
            raise BadRecord("wrong_role", f"two {a['role']} turns in a row" if a["role"] == b["role"]
                            else f"a {b['role']} turn after a {a['role']} turn")
    return system + rest


# ---- rendering with an assistant-only mask -----------------------------------------------------------------------
def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_PROBE = "Zq7 probe reply"  # an assistant message no template rewrites, found again in the rendering


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template; returns token ids and the assistant loss mask."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None, assistant_header: str | None = None,
                 end_of_turn: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None and (assistant_header is None or end_of_turn is None):
            raise NoUsableData(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set one "
                               f"in tokenizer_config.json (chat_template), or, for preformatted text only, "
                               f"data.assistant_header and data.end_of_turn")
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.end_marker = self._probe_end_marker()  # after the last answer
        head, self.history_end, self.gen_extra = self._probe_history_turn()  # around an answer in the history
        # preformatted text (text_spans) only: what opens and ends an assistant turn, probed or given
        self.assistant_header = head if assistant_header is None else assistant_header
        self.turn_end = self.history_end if end_of_turn is None else end_of_turn
        self.texts_read = 0

    def render(self, msgs, gen: bool, tools: list[dict] | None = None) -> str:
        kw = dict(self.kwargs, tools=tools) if tools else self.kwargs
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)

    def _probe_end_marker(self) -> str:
        """The text a template puts after an assistant message (e.g. '<|im_end|>', '<|eot_id|>'), stripped."""
        probe = _PROBE
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}], False)
        except Exception:  # noqa: BLE001 - templates raise anything
            return ""
        i = text.rfind(probe)
        return text[i + len(probe):].strip() if i >= 0 else ""

    def _probe_history_turn(self) -> tuple[str, str, str]:
        """(what opens, what ends an assistant message in a conversation's history, what the generation prompt adds
        after that opening): e.g. ('<|im_start|>assistant\\n', '<|im_end|>', ''), Llama 3's
        ('<|start_header_id|>assistant<|end_header_id|>\\n\\n', '<|eot_id|>', ''), Qwen3 with thinking off
        ('<|im_start|>assistant\\n', '<|im_end|>', '<think>\\n\\n</think>\\n\\n'); '' where it cannot tell."""
        probe, first = _PROBE, [{"role": "user", "content": "Zq7 hello"}]
        try:
            before, prompt = self.render(first, False), self.render(first, True)
            full = self.render(first + [{"role": "assistant", "content": probe},
                                        {"role": "user", "content": "Zq7 bye"}], False)
        except Exception:  # noqa: BLE001 - templates raise anything
            return "", "", ""
        i, k = full.find(probe), full.find("Zq7 bye")
        if i < 0 or k < i:
            return "", "", ""
        tail = full[i + len(probe):k]  # the end of the turn, then the user's header
        end = max((t for t in self.tok.get_added_vocab() if t and tail.startswith(t)), key=len, default="") \
            or (self.end_marker if self.end_marker and tail.startswith(self.end_marker) else "")
        if full.startswith(before):
            head = full[len(before):i].lstrip()
        else:  # a template that ends a conversation with EOS: the header follows the user turn's end marker
            u = full.find("Zq7 hello") + len("Zq7 hello")
            head = full[u + len(end):i].lstrip() if end and full.startswith(end, u) else ""
        gen = prompt[len(before):].lstrip() if prompt.startswith(before) else ""
        return head, end, gen[len(head):] if head and gen.startswith(head) else ""

    def text_spans(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """(text, the assistant spans of a preformatted conversation): each runs from after an assistant header to
        the end-of-turn marker after it, the marker included, or to the end of the text (an answer cut short), as
        SpecForge reads ``--is-preformatted`` data; what the generation prompt itself adds after the header (an empty
        thinking block with thinking off) is context, as in ``char_spans``."""
        head, end = self.assistant_header, self.turn_end
        if not head or not end:
            raise NoUsableData("preformatted text needs the strings that open and end an assistant turn, and the "
                               "chat template's were not found (" + ("no header" if not head else "no end-of-turn")
                               + "): set data.assistant_header and data.end_of_turn")
        self.texts_read += 1
        spans, pos = [], 0
        while (i := text.find(head, pos)) >= 0:
            start = i + len(head)
            if self.gen_extra and text.startswith(self.gen_extra, start):  # injected by the generation prompt
                start += len(self.gen_extra)
            j = text.find(end, start)
            pos = stop = len(text) if j < 0 else j + len(end)
            while stop > start and text[stop - 1].isspace():
                stop -= 1
            if stop > start:
                spans.append((start, stop))
        return text, spans

    def char_spans(self, msgs, tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(msgs, False, tools)
        spans, prev_end = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = max(_common_prefix(self.render(msgs[:i], True, tools), full), prev_end)
            upto = self.render(msgs[:i + 1], False, tools)
            if full.startswith(upto):
                end = len(upto)
            else:  # this turn renders differently once it is not last: end at a history turn's end marker
                marker = self.history_end or self.end_marker
                if not marker:
                    raise BadRecord("template_mismatch", "turn rendering is not prefix-stable and no end marker")
                j = full.find(marker, start)
                if j < 0:
                    raise BadRecord("template_mismatch", "no end-of-turn marker after an assistant turn")
                end = j + len(marker)
            if m.get("truncated"):  # the target was cut off here: its answer ends, but no end-of-turn is learnt
                end = self._content_end(full, m["content"], start, end)
            while end > start and full[end - 1].isspace():  # the newline after the end token is not generated
                end -= 1
            if end > start:
                spans.append((start, end))
                prev_end = end
        return full, spans

    def _content_end(self, full: str, content: str, start: int, end: int) -> int:
        """Where a truncated assistant turn's text ends in ``full`` (its span ``start``..``end`` without the
        template's end-of-turn marker)."""
        j = full.rfind(content.rstrip(), start, end)
        if j >= 0:
            return j + len(content.rstrip())
        k = full.rfind(self.end_marker, start, end) if self.end_marker else -1
        if k < 0:
            raise BadRecord("template_mismatch", "no end of a truncated assistant turn")
        return k

    def spans_or_bad(self, msgs, tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        try:
            return self.char_spans(msgs, tools)
        except BadRecord:
            raise
        except Exception as e:  # noqa: BLE001 - a template may raise on odd conversations
            raise BadRecord("template_error", f"{type(e).__name__}: {str(e)[:80]}") from None

    @staticmethod
    def _mask(enc_ids, offsets, spans) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(enc_ids, np.int32)
        starts = np.asarray([s for s, _ in offsets], np.int64)
        mask = np.zeros(len(ids), np.uint8)
        for s, e in spans:
            mask[(starts >= s) & (starts < e)] = 1
        return ids, mask

    def encode(self, msgs, tools: list[dict] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(i32[T] token ids, u8[T] loss mask: 1 on assistant tokens); ``tools``: the record's tool definitions."""
        out = self.encode_rendered([self.spans_or_bad(msgs, tools)])[0]
        if isinstance(out, BadRecord):
            raise out
        return out

    def encode_rendered(self, items: list[tuple[str, list[tuple[int, int]]]]) -> list:
        """Tokenize many rendered conversations at once (the Rust tokenizer runs them in parallel); each result is
        (ids, mask) or a BadRecord."""
        try:
            enc = self.tok([full for full, _ in items], add_special_tokens=False, return_offsets_mapping=True)
            return [self._mask(i, o, sp) for i, o, (_, sp) in zip(enc["input_ids"], enc["offset_mapping"], items)]
        except Exception:  # noqa: BLE001 - find the bad one(s) one at a time
            if len(items) == 1:
                return [BadRecord("undecodable", "tokenizer failed")]
            return [r for it in items for r in self.encode_rendered([it])]


def load_tokenizer(path: str):
    """The target's tokenizer (``weights.load_tokenizer``, as serving loads it), which must be a fast one."""
    tok = weights.load_tokenizer(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer at {path} is not a fast tokenizer; specjax needs offsets (tokenizer.json)")
    return tok


# ---- tokenized dataset ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TokenizedData:
    """All kept conversations, concatenated: example i is tokens[offsets[i]:offsets[i+1]]."""
    tokens: np.ndarray  # i32[N]
    loss_mask: np.ndarray  # u8[N]
    offsets: np.ndarray  # i64[n+1]
    stats: dict[str, int]  # records, kept, truncated and one counter per skip reason
    source: np.ndarray | None = None  # i64[n] index of each example in the full dataset (None: itself)

    def source_index(self, i: int) -> int:
        return int(self.source[i]) if self.source is not None else int(i)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.loss_mask[a:b]

    def subset(self, idx: np.ndarray) -> "TokenizedData":
        src = np.asarray([self.source_index(int(i)) for i in idx], np.int64)
        return TokenizedData.from_examples([self.example(int(i)) for i in idx], dict(self.stats), src)

    @classmethod
    def from_examples(cls, parts, stats: dict, source: np.ndarray | None = None) -> "TokenizedData":
        """Examples given as (tokens, loss_mask) pairs, concatenated."""
        lens = np.asarray([len(p[0]) for p in parts], np.int64)
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros((0,), dt)
        return cls(cat([p[0] for p in parts], np.int32), cat([p[1] for p in parts], np.uint8),
                   np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), stats, source)

    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, tokens=self.tokens, loss_mask=self.loss_mask, offsets=self.offsets,
                 stats=np.asarray(json.dumps(self.stats)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "TokenizedData":
        z = np.load(path)
        return cls(z["tokens"], z["loss_mask"], z["offsets"], json.loads(str(z["stats"])))


def summary(stats: dict[str, int]) -> str:
    skipped = {k: v for k, v in stats.items() if k not in ("records", "kept", "truncated") and v}
    s = f"kept {stats.get('kept', 0)} of {stats.get('records', 0)} conversations"
    if stats.get("truncated"):
        s += f" ({stats['truncated']} truncated)"
    if skipped:
        s += "; skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
    return s


def tokenize_records(records: Iterable[Any], encoder: ChatEncoder, *, max_length: int, overlong: str = "truncate",
                     fmt: str = "auto", max_examples: int | None = None, chunk: int = 256) -> TokenizedData:
    """Render, tokenize and mask every record (in order); bad records are counted in ``stats`` and skipped."""
    stats: collections.Counter = collections.Counter(records=0, kept=0)
    toks, masks, lens = [], [], []
    pending: list[tuple[str, list[tuple[int, int]]]] = []

    def flush():
        for out in encoder.encode_rendered(pending):
            try:
                if isinstance(out, BadRecord):
                    raise out
                ids, mask = out
                if len(ids) > max_length:
                    if overlong == "drop":
                        raise BadRecord("too_long")
                    ids, mask = ids[:max_length], mask[:max_length]
                    stats["truncated"] += 1
                if not mask.any():
                    raise BadRecord("no_assistant_tokens")
            except BadRecord as e:
                stats[e.reason] += 1
                continue
            toks.append(ids)
            masks.append(mask)
            lens.append(len(ids))
            stats["kept"] += 1
        pending.clear()

    for rec in records:
        if max_examples is not None and stats["records"] >= max_examples:
            break
        stats["records"] += 1
        try:
            text = record_text(rec, fmt)
            pending.append(encoder.text_spans(text) if text is not None
                           else encoder.spans_or_bad(to_messages(rec, fmt), record_tools(rec)))
        except BadRecord as e:
            stats[e.reason] += 1
            continue
        if len(pending) >= chunk:
            flush()
    if pending:
        flush()
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros((0,), dt)
    return TokenizedData(cat(toks, np.int32), cat(masks, np.uint8),
                         np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), dict(stats))


def fingerprint(cfg: DataConfig, tok) -> str:
    """Identifies the tokenized dataset (sources with every file's size and time, settings, tokenizer)."""
    h = hashlib.sha256()
    srcs = []
    for p in cfg.paths:
        srcs.extend([p] if p == "sharegpt" else [source_signature(q) for q in resolve_paths([p])])
    for name in cfg.hf_datasets:
        srcs.append((name, _hub_fingerprint(name, cfg.split)))
    vocab_sig = hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()
    h.update(json.dumps([srcs, list(cfg.hf_datasets), cfg.split, cfg.format, cfg.max_length, cfg.overlong,
                         cfg.max_examples, cfg.chat_template_kwargs, tok.chat_template, vocab_sig,
                         cfg.assistant_header, cfg.end_of_turn,
                         4],  # the reader's version: 2 read reasoning_content and truncated turns, 3 tools, 4 text
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def _hub_fingerprint(name: str, split: str) -> str | None:
    """A hub dataset's ``datasets`` fingerprint (it follows the content: an update, a new revision), or None where it
    cannot be loaded now (an offline host that has only the tokenized cache: keyed by name, as before)."""
    try:
        import datasets  # optional
        return datasets.load_dataset(name, split=split)._fingerprint
    except Exception as e:  # noqa: BLE001 - no network, no datasets: the name alone
        _log.warning("data: %s: no fingerprint (%s); its tokenized cache is keyed by name", name, type(e).__name__)
        return None


def source_signature(path: str) -> list:
    """A data source as the cache sees it: its path and, for a file, its size and time in nanoseconds; for a folder
    (a ``datasets.save_to_disk`` set, a folder of files) those of every file under it, whose rewriting leaves the
    folder's own entry unchanged."""
    if not os.path.isdir(path):
        st = os.stat(path)
        return [os.path.abspath(path), st.st_size, st.st_mtime_ns]
    files = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            st = os.stat(os.path.join(root, n))
            files.append([os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns])
    return [os.path.abspath(path), files]


def default_cache_dir() -> str:
    return os.path.join(cache_root(), "data")


def load_dataset(cfg: DataConfig, tokenizer, log: Callable[[str], None] = print) -> TokenizedData:
    """Tokenize every source (cached on disk by content of the config, sources and tokenizer)."""
    cache_dir = cfg.cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, f"tokenized-{fingerprint(cfg, tokenizer)}.npz")
    if os.path.exists(path):
        try:
            data = TokenizedData.load(path)
            log(f"data: {summary(data.stats)} (cached {path})")
            return data
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt
            pass
    encoder = ChatEncoder(tokenizer, cfg.chat_template_kwargs, cfg.assistant_header, cfg.end_of_turn)
    data = tokenize_records(iter_records(cfg, log), encoder, max_length=cfg.max_length, overlong=cfg.overlong,
                            fmt=cfg.format, max_examples=cfg.max_examples)
    log(f"data: {summary(data.stats)}")
    if len(data) == 0:
        hint = (f"; the preformatted text was read with assistant header {encoder.assistant_header!r} and "
                f"end-of-turn {encoder.turn_end!r}: set data.assistant_header / data.end_of_turn (YAML double quotes "
                f"for escapes such as \\n) if the text is laid out otherwise" if encoder.texts_read else "")
        raise NoUsableData(f"no usable conversations in {list(cfg.paths) + list(cfg.hf_datasets)}: "
                           f"{summary(data.stats)}{hint}")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        data.save(path)
    except OSError:
        pass
    return data


def train_and_eval(cfg: DataConfig, full: TokenizedData, tokenizer, seed: int,
                   log: Callable[[str], None] = print) -> tuple[TokenizedData, TokenizedData]:
    """(training, held-out) data of a run: ``data.eval_paths`` read as a set of its own (its first ``eval_max``
    conversations; all of ``full`` trains), else ``split_eval`` of ``full``. The trainer, ``train.vocab`` and
    ``bench heldout`` all split this way."""
    if not cfg.eval_paths:
        return split_eval(full, cfg.eval_fraction, cfg.eval_max, seed)
    held = load_dataset(dataclasses.replace(cfg, paths=tuple(cfg.eval_paths), hf_datasets=(), max_examples=None,
                                            eval_paths=()), tokenizer, log=lambda m: log(f"eval {m}"))
    return full, held.subset(np.arange(min(len(held), cfg.eval_max)))


def split_eval(data: TokenizedData, fraction: float, max_eval: int, seed: int) -> tuple[TokenizedData, TokenizedData]:
    """Deterministic held-out split (by conversation)."""
    n = len(data)
    n_eval = 0 if fraction <= 0 or n < 2 else min(max(1, int(round(n * fraction))), max_eval, n - 1)
    perm = np.random.default_rng([seed, 7919]).permutation(n)
    eval_idx, train_idx = np.sort(perm[:n_eval]), np.sort(perm[n_eval:])
    return data.subset(train_idx), data.subset(eval_idx)


# ---- buckets and the batch plan -----------------------------------------------------------------------------------
def bucket_sizes(buckets, max_length: int) -> tuple[int, ...]:
    """Sorted bucket lengths, capped at max_length, which is always the last bucket."""
    out = sorted({b for b in buckets if b < max_length} | {max_length})
    return tuple(out)


def bucket_of(lengths: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    return np.searchsorted(np.asarray(sizes), lengths, side="left")


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    seq_len: int  # T of this batch (its bucket)
    rows: np.ndarray  # i64[A*B] example index per row; -1 = padding row


def epoch_plan(lengths: np.ndarray, sizes: tuple[int, ...], rows_per_batch: int, seed: int, epoch: int,
               shuffle: bool = True) -> list[PlannedBatch]:
    """Batches of one epoch: examples grouped by bucket (shuffled within it), cut into global batches (the last
    of each bucket padded with empty rows), then the batches shuffled. Same (seed, epoch) -> same plan."""
    rng = np.random.default_rng([seed, epoch])
    which = bucket_of(lengths, sizes)
    batches = []
    for b, size in enumerate(sizes):
        idx = np.nonzero(which == b)[0]
        if shuffle:
            idx = idx[rng.permutation(len(idx))]
        for s in range(0, len(idx), rows_per_batch):
            rows = np.full((rows_per_batch,), -1, np.int64)
            chunk = idx[s:s + rows_per_batch]
            rows[:len(chunk)] = chunk
            batches.append(PlannedBatch(size, rows))
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def steps_per_epoch(lengths: np.ndarray, sizes: tuple[int, ...], rows_per_batch: int) -> int:
    counts = np.bincount(bucket_of(lengths, sizes), minlength=len(sizes))
    return int(sum(-(-c // rows_per_batch) for c in counts))


def local_batch_rows(sharding, global_shape: tuple[int, ...], axis: int = 1) -> np.ndarray:
    """Indices along the batch ``axis`` that this process's devices hold, in the order local data lists them."""
    n = global_shape[axis]
    if sharding is None:
        return np.arange(n)
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        sl = idx[axis] if len(idx) > axis else slice(None)
        rows.update(range(*sl.indices(n)))
    return np.asarray(sorted(rows), np.int64)


class BatchIterator:
    """Endless, resumable iterator of global batches ``dict(input_ids, loss_mask, attention_mask)``, each
    i32[A, B, T] (A = grad-accum micro-batches, B = global batch size).

    State: ``{"epoch": e, "position": p}``: the next batch is batch p of epoch e's plan. With a sharding, each
    process fills only the rows its devices hold and the global array is assembled across processes.
    """

    def __init__(self, data: TokenizedData, *, batch_size: int, grad_accum: int, buckets, max_length: int,
                 seed: int, sharding=None, pad_id: int = 0, shuffle: bool = True, features=None):
        self.data, self.b, self.a = data, batch_size, grad_accum
        self.features = features  # offline cache: .spec {name: (dim, dtype)}, .rows(source_index) -> {name: [len, dim]}
        self.sizes = bucket_sizes(buckets, max_length)
        self.seed, self.sharding, self.pad_id, self.shuffle = seed, sharding, pad_id, shuffle
        self.lengths = data.lengths
        self.epoch, self.position = 0, 0
        self._plan: list[PlannedBatch] | None = None
        self._plan_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.lengths, self.sizes, self.a * self.b)

    def plan(self, epoch: int) -> list[PlannedBatch]:
        if self._plan_epoch != epoch:
            self._plan = epoch_plan(self.lengths, self.sizes, self.a * self.b, self.seed, epoch, self.shuffle)
            self._plan_epoch = epoch
        return self._plan  # type: ignore[return-value]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        return self

    def peek(self) -> PlannedBatch:
        plan = self.plan(self.epoch)
        if self.position >= len(plan):
            self.epoch, self.position = self.epoch + 1, 0
            plan = self.plan(self.epoch)
        return plan[self.position]

    def __next__(self) -> tuple[dict[str, Any], dict[str, int]]:
        pb = self.peek()
        self.position += 1
        return self.materialise(pb)

    def materialise(self, pb: PlannedBatch) -> tuple[dict[str, Any], dict[str, int]]:
        """(batch, info): info has seq_len, tokens (real tokens in the global batch) and loss_tokens."""
        a, b, t = self.a, self.b, pb.seq_len
        grid = pb.rows.reshape(a, b)
        mine = local_batch_rows(self.sharding, (a, b, t))
        ids = np.full((a, len(mine), t), self.pad_id, np.int32)
        lmask = np.zeros((a, len(mine), t), np.int32)
        amask = np.zeros((a, len(mine), t), np.int32)
        for i in range(a):
            for j, r in enumerate(mine):
                ex = grid[i, r]
                if ex < 0:
                    continue
                tok, m = self.data.example(int(ex))
                ids[i, j, :len(tok)] = tok
                lmask[i, j, :len(tok)] = m
                amask[i, j, :len(tok)] = 1
        extra = {}
        if self.features is not None:
            for name, (dim, dt) in self.features.spec.items():
                extra[name] = np.zeros((a, len(mine), t, dim), dt)
            for i in range(a):
                for j, r in enumerate(mine):
                    ex = grid[i, r]
                    if ex >= 0:
                        for name, rows in self.features.rows(self.data.source_index(int(ex))).items():
                            extra[name][i, j, :len(rows)] = rows
        real = pb.rows[pb.rows >= 0]
        info = {"seq_len": t, "tokens": int(self.lengths[real].sum()),
                "loss_tokens": int(sum(int(self.data.example(int(e))[1].sum()) for e in real))}
        batch = {"input_ids": ids, "loss_mask": lmask, "attention_mask": amask, **extra}
        if self.sharding is not None:
            import jax
            batch = {k: jax.make_array_from_process_local_data(self.sharding, v, (a, b, t) + v.shape[3:])
                     for k, v in batch.items()}
        return batch, info
