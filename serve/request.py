"""One generation request as the scheduler sees it: sampling parameters, incremental detokenization, stop conditions
and the output events it sends to its consumer (an HTTP handler or the offline engine)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import time
from typing import Any, Callable, Mapping

import numpy as np

from specjax import sampling

INT32_MAX = (1 << 31) - 1
DETOK_CONTEXT = 6  # prompt tokens decoded with the output so that the first output token gets its leading space
MAX_STOP_CHARS = 512  # per stop string: the held-back tail is compared against each on every step
NO_LIMIT = 1 << 30  # the max_new_tokens of a request without an output limit (the context's: the scheduler caps it)
# Extra sampling parameters SGLang knows: accepted at their neutral value, refused otherwise.
NEUTRAL_EXTRAS = {"regex": (), "json_schema": (), "ebnf": (), "structural_tag": (),
                  "spaces_between_special_tokens": (True,),
                  "custom_params": (), "stream_interval": (), "lora_path": ()}


class RequestError(ValueError):
    """A request that can never be served as asked (too long, bad parameters); maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _is_neutral(value: Any, neutral: tuple) -> bool:
    if value is None or (isinstance(value, (str, list, dict)) and not value):  # null / empty asks for nothing
        return True
    for n in neutral:
        if isinstance(n, bool) or isinstance(value, bool):
            if value is n:
                return True
        elif value == n:
            return True
    return False


def refuse_unsupported(name: str, value: Any, table: dict[str, tuple], where: str = "") -> None:
    """A RequestError (400) for a field other servers define that specjax does not implement (``table``: field ->
    its neutral values), unless it asks for nothing (None, empty, or one of its neutral values)."""
    if not _is_neutral(value, table[name]):
        raise RequestError(f"{where}{name}={value!r} is not supported by specjax", param=name,
                           code="unsupported_parameter")


def batch_rids(rid: str | list[str] | None, count: int) -> list[str | None]:
    """The rid of each of ``count`` prompts: a list gives one per prompt, each its own (an abort by rid would stop
    every request under it; a rid still in flight is the scheduler's refusal)."""
    if not isinstance(rid, list):
        return [rid] * count
    if len(rid) != count:
        raise RequestError(f"{len(rid)} rids for {count} prompts: give one rid per prompt", param="rid")
    seen = set()
    for r in rid:
        if r and r in seen:  # "" asks for none: the scheduler makes one
            raise RequestError(f"the rid {r!r} repeats in the batch: give each prompt its own rid", param="rid",
                               code="duplicate_rid")
        seen.add(r)
    return list(rid)


def copy_rid(given: str | list[str] | None, rids: list[str | None], k: int, j: int, n: int,
             prompts: int) -> tuple[str | None, str | None]:
    """(rid, group) of copy ``j`` of prompt ``k``: the prompt's own rid, or, where several requests share the rid
    the client gave (n > 1, or one rid for a batch), ``{rid}-{k}-{j}`` in the group of that rid (an abort by the
    client's rid still reaches every copy)."""
    rid = rids[k]
    if rid is not None and (n > 1 or (prompts > 1 and not isinstance(given, list))):
        return f"{rid}-{k}-{j}", rid
    return rid, None


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling and stop parameters (SGLang's names and defaults)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id (int or its string, as JSON keys are) -> bias
    no_stop_trim: bool = False  # keep the matched stop string / stop token in the text
    # Logprobs (SGLang's request fields; the OpenAI endpoints map theirs onto these).
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position on (-1: the last prompt token only, as SGLang)
    return_text_in_logprobs: bool = False
    token_ids_logprob: list[int] | None = None  # the logprobs of these ids at every position reported

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """A Python dict of SGLang's sampling parameters (the Engine's; /generate's JSON goes through pydantic's
        ``GenerateSamplingParams``): SGLang's extras accepted at their neutral value, ``max_new_tokens: None`` = no
        limit but the context, ``sampling_seed`` as ``seed``; a RequestError naming the first bad field."""
        if d is not None and not isinstance(d, Mapping):
            raise RequestError(f"sampling_params must be a dict of parameters, got {type(d).__name__}",
                               "sampling_params")
        d = dict(d or {})
        for name in [k for k in d if k in NEUTRAL_EXTRAS]:  # SGLang's extras: accepted when they ask for nothing
            refuse_unsupported(name, d.pop(name), NEUTRAL_EXTRAS, "sampling_params.")
        no_limit = "max_new_tokens" in d and d["max_new_tokens"] is None
        if "sampling_seed" in d and d.get("seed") is None:
            d["seed"] = d.pop("sampling_seed")
        d.pop("sampling_seed", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(names)}", param=unknown[0])
        d = {k: v for k, v in d.items() if v is not None}
        sp = cls(**d)
        if no_limit:
            sp.max_new_tokens = NO_LIMIT
        sp.validate()
        return sp

    def validate(self) -> None:
        """Check every parameter's type and range (RequestError naming it) and normalise it in place: integral
        floats to int (JSON clients send 3.0), a single stop string to a list, logit_bias keys to ints."""
        self._normalise_types()
        if self.max_new_tokens < 0:  # 0: SGLang's prefill-only request (prompt logprobs, a cached prefix)
            raise RequestError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}", "max_new_tokens")
        if self.top_k == 0:  # OpenAI-style clients sometimes send 0 for "off"
            self.top_k = -1
        if self.top_k > INT32_MAX:  # the device kernels take int32; any k >= the vocab size means "off"
            raise RequestError(f"top_k must be <= {INT32_MAX} (or -1 for off), got {self.top_k}", "top_k")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63) - 64:
            raise RequestError(f"seed must fit in a signed 64-bit integer, got {self.seed}", "seed")
        if not 1 <= self.n <= 64:
            raise RequestError(f"n must be in [1, 64], got {self.n}", "n")
        if len(self.stop) > 16:
            raise RequestError("at most 16 stop strings", "stop")
        if any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise RequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
        if not 0 <= self.top_logprobs_num <= sampling.TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {sampling.TOP_LOGPROBS}], got {self.top_logprobs_num}",
                               "top_logprobs_num")
        if self.logprob_start_len < -1:
            raise RequestError(f"logprob_start_len must be >= -1, got {self.logprob_start_len}", "logprob_start_len")
        check_min_tokens(self.min_new_tokens, self.max_new_tokens)
        try:  # temperature, top_k/p, min_p, penalties, logit_bias: the runner row's own ranges
            self.runner_row(0, ()).validate()
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split(" ")[0]) from None

    def _normalise_types(self) -> None:
        for name in _INTS:
            setattr(self, name, _integer(name, getattr(self, name)))
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
        for name in _FLOATS:
            setattr(self, name, _number(name, getattr(self, name)))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
            setattr(self, name, bool(getattr(self, name)))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
        self.stop = list(stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise RequestError(f"stop_token_ids must be a list of token ids in [0, {INT32_MAX}]", "stop_token_ids")
        self.stop_token_ids = [int(t) for t in ids]
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise RequestError("logit_bias must map token ids to numbers", "logit_bias")
        self.logit_bias = {_token_key(k): _number("logit_bias", v) for k, v in (self.logit_bias or {}).items()} or None
        if self.token_ids_logprob is not None:
            self.token_ids_logprob = token_ids(self.token_ids_logprob, "token_ids_logprob") or None

    def runner_row(self, seed: int | None, eos_ids) -> sampling.SamplingRow:
        """The runner's typed row: min_new_tokens holds back the stop tokens (eos unless ignore_eos)."""
        stops = tuple(dict.fromkeys(list(self.stop_token_ids) + ([] if self.ignore_eos else sorted(eos_ids))))
        return sampling.SamplingRow(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=seed,
            frequency_penalty=float(self.frequency_penalty), presence_penalty=float(self.presence_penalty),
            repetition_penalty=float(self.repetition_penalty), min_new_tokens=int(self.min_new_tokens),
            logit_bias=tuple((self.logit_bias or {}).items()), stop_ids=stops,
            logprobs=bool(self.return_logprob), logprob_ids=tuple(self.token_ids_logprob or ()))


_INTS = ("max_new_tokens", "top_k", "n", "min_new_tokens", "top_logprobs_num", "logprob_start_len")
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "no_stop_trim", "return_logprob", "return_text_in_logprobs")
_F32_MAX = float(np.finfo(np.float32).max)
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_min_tokens(min_new: int, max_new: int, min_name: str = "min_new_tokens",
                     max_name: str = "max_new_tokens") -> None:
    """SGLang's rule: the least output length is in [0, the output limit] (the limit in effect: the given one, or
    the endpoint's default); else a RequestError naming ``min_name`` (the endpoint's own field names)."""
    if not 0 <= min_new <= max_new:
        raise RequestError(f"{min_name} must be in [0, {max_name}], got {min_new} ({max_name} is {max_new})",
                           min_name)


def _is_int(v) -> bool:
    # type() first: a prompt's million ids are plain ints, and an ABC isinstance per id would stall the event loop
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)))


def _integer(name: str, v) -> int:
    """``v`` as an int: an integer, or a float with an integral value; anything else is a RequestError."""
    if _is_int(v):
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and float(v).is_integer():
        return int(v)
    raise RequestError(f"{name} must be an integer, got {v!r}", name)


def token_ids(x, param: str = "input_ids") -> list[int]:
    """A prompt's token ids from a list of integers (range checks are the scheduler's); else a RequestError."""
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple, np.ndarray)) or \
            not all(_is_int(t) for t in x):
        raise RequestError(f"{param} must be a list of integer token ids", param)
    return [int(t) for t in x]


def check_text(text, param: str = "prompt") -> str:
    """A prompt or message text: a str that is valid Unicode (a lone surrogate such as "\\ud800" is not, and no
    tokenizer takes it); else a RequestError naming ``param``."""
    if not isinstance(text, str):
        raise RequestError(f"{param} must be a string, got {type(text).__name__}", param)
    if has_lone_surrogate(text):
        raise RequestError(f"{param} is not valid Unicode: it holds a lone surrogate", param)
    return text


def has_lone_surrogate(text: str) -> bool:
    """Does ``text`` hold a UTF-16 surrogate code point (one that JSON's "\\ud800" escape or Python's "\\ud800" made,
    without its pair: a joined pair is one code point)? Not valid Unicode: no tokenizer nor UTF-8 encoder takes it."""
    return _SURROGATE.search(text) is not None


def _token_key(k) -> int:
    """A logit_bias key: a token id, or its decimal string (JSON object keys are strings)."""
    try:
        if isinstance(k, str) and not (k.isascii() and k.lstrip("-").isdigit()):
            raise ValueError(k)  # int() would also take " 5", "1_0" and other digits than 0-9
        return int(k, 10) if isinstance(k, str) else _integer("logit_bias", k)
    except (RequestError, ValueError):
        raise RequestError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None


def _number(name: str, v) -> float:
    """``v`` as a float that the device's float32 holds (1e39 would be inf there); else a RequestError."""
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v) \
            and abs(float(v)) <= _F32_MAX:
        return float(v)
    raise RequestError(f"{name} must be a finite number, got {v!r}", name)


def with_logprob_fields(params: list[SamplingParams], **fields) -> list[SamplingParams]:
    """``params`` (one per prompt) with SGLang's request-level logprob fields applied (``return_logprob``,
    ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``token_ids_logprob``): each a value
    for every prompt or a list of one per prompt (``token_ids_logprob``: a list of ids, or a list of such lists);
    None leaves a field as it is."""
    out = []
    for i, sp in enumerate(params):
        given = {}
        for name, v in fields.items():
            if name == "token_ids_logprob" and isinstance(v, (list, tuple)) and \
                    not any(isinstance(x, (list, tuple)) for x in v):
                v = [list(v)] * len(params)  # one list of ids for every prompt
            if isinstance(v, list):
                if len(v) != len(params):
                    raise RequestError(f"{len(v)} values of {name} for {len(params)} prompts", param=name)
                v = v[i]
            if v is not None:
                given[name] = v
        sp = dataclasses.replace(sp, **given)
        sp.validate()
        out.append(sp)
    return out


def stop_prefix_at_end(text: str, stop: str) -> int:
    """Length of the longest tail of ``text`` that begins ``stop`` (shorter than ``stop`` itself). Only the tails
    that start with ``stop[0]`` are compared, longest first, so a step costs no scan over every length."""
    j = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while j != -1:
        if stop.startswith(text[j:]):
            return len(text) - j
        j = text.find(stop[0], j + 1)
    return 0


@dataclasses.dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[dict], None]  # receives output events; called on the scheduler thread
    seed: int = 0
    group: str | None = None  # the client's rid when it was expanded per prompt / copy (an abort by it stops all)
    priority: int = 0  # SGLang's (``scheduler.PriorityPolicy``)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # Scheduling state (owned by the scheduler thread).
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # page-table row (logical page -> pool page)
    nodes: list = dataclasses.field(default_factory=list)  # radix nodes this request holds a reference on
    cached_tokens: int = 0  # prompt tokens reused from the radix cache
    prefilled: int = 0  # prompt tokens in the KV cache
    prefill_from: int = 0  # where its latest prefill began (the cached prefix found at admission)
    shared_with: dict = dataclasses.field(default_factory=dict)  # (rid, arrival) -> whole pages its fill shares with
    # that prefilling request's (``Scheduler._waits_for_prefill``; a waiting request's fill does not change)
    first_token: int | None = None  # the prefill's token, held while the prompt is scored
    admitted: bool = False  # it has held a slot (a retracted request waits again)
    prompt_counted: bool = False  # its prompt's prefill is in the metrics
    saved_row: Any = None  # a retracted request's slot sampling row (its random stream, penalty state)
    decoding: bool = False  # the first token is out: the request takes decode steps
    output_ids: list[int] = dataclasses.field(default_factory=list)
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0  # draft tokens its steps proposed (SGLang's spec_draft_token_num)
    spec_accepted: int = 0  # of them accepted (SGLang's spec_accept_token_num)
    finish_reason: dict | None = None
    abort_requested: bool = False
    first_token_time: float | None = None
    # Logprobs (when params.return_logprob): per output token (logprob, id) and its top (logprob, id) pairs;
    # prompt tokens from logprob_start_len on as (logprob or None for the first, id, top pairs or None).
    # With token_ids_logprob: per output position the logprobs of those ids (a prefill-only request: the position
    # after the prompt, as SGLang's scoring reads it); prompt entries carry theirs fourth (None for the first).
    output_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    output_ids_logprobs: list = dataclasses.field(default_factory=list)
    input_logprobs: list = dataclasses.field(default_factory=list)
    # Detokenization state.
    text: str = ""  # visible output text so far (stop strings removed)
    sent_chars: int = 0  # text[:sent_chars] has been streamed
    sent_ids: int = 0
    _detok_ids: list[int] = dataclasses.field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def resumed(self) -> int:
        """Output tokens a prefill runs again with the prompt (``fill_ids``): all of them while a retracted request
        waits or is prefilled again (its output does not change meanwhile), none once it decodes."""
        return 0 if self.decoding else len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + self.resumed

    @property
    def fill_ids(self) -> list[int]:
        """The tokens a prefill runs: the prompt, and after a retraction the output emitted before it."""
        return self.prompt_ids + self.output_ids[:self.resumed] if self.resumed else self.prompt_ids

    @property
    def prefill_done(self) -> bool:
        return self.decoding or self.prefilled >= self.fill_len

    @property
    def scored(self) -> int:
        """Prompt positions scored so far (``score_span``): the entries after the unscored first one."""
        return max(len(self.input_logprobs) - 1, 0)

    def score_span(self) -> tuple[int, int]:
        """Prompt positions [begin, end) whose next token's logprob the request asks for (SGLang's prompt tokens
        from ``logprob_start_len`` on, the first without one): empty unless it scores more than one prompt token."""
        sp, n = self.params, len(self.prompt_ids)
        if sp.return_logprob and 0 <= sp.logprob_start_len < n - 1:
            return sp.logprob_start_len, n - 1
        return 0, 0

    def tokens_in_cache(self) -> list[int]:
        """Tokens whose KV sits in this request's pages: the prompt part computed so far, then every emitted token
        but the last (which has not been fed back yet)."""
        if not self.prefill_done:
            return self.fill_ids[:self.prefilled]
        return self.prompt_ids + self.output_ids[:-1]

    def init_detok(self) -> None:
        ctx = self.prompt_ids[-DETOK_CONTEXT:]
        self._detok_ids = list(ctx)
        self._prefix_offset, self._read_offset = 0, len(ctx)

    def _decode_delta(self, tokenizer, final: bool) -> str:
        """vLLM-style incremental decode: emit text only once it no longer ends in a partial UTF-8 character (no
        text without a tokenizer: ``--skip-tokenizer-init``)."""
        if tokenizer is None:
            return ""
        skip = self.params.skip_special_tokens
        prefix = tokenizer.decode(self._detok_ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = tokenizer.decode(self._detok_ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            # Some tokenizers rewrite the prefix when more tokens follow; keep what we have already emitted.
            delta = full[len(prefix):] if full.startswith(prefix) else full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._detok_ids)
            return delta
        return ""

    def _record_logprob(self, logprobs, j: int, tok: int) -> None:
        if logprobs is None or not self.params.return_logprob:
            return
        lp, ids, vals, _ = logprobs
        k = self.params.top_logprobs_num
        self.output_logprobs.append((float(lp[j]), tok))
        self.output_top_logprobs.append([(float(v), int(i)) for v, i in zip(vals[j, :k], ids[j, :k])])
        self.record_ids_logprobs(logprobs, j)

    def record_ids_logprobs(self, logprobs, j: int) -> None:
        """The logprobs of ``token_ids_logprob`` at column ``j`` of a step's ``logprobs`` (when it asks for them)."""
        want = self.params.token_ids_logprob
        if logprobs is not None and self.params.return_logprob and want:
            self.output_ids_logprobs.append([float(v) for v in logprobs[3][j, :len(want)]])

    def append_tokens(self, tokens, tokenizer, eos_ids: frozenset[int], context_left: int, logprobs=None) -> None:
        """Add newly generated tokens one by one, stopping at the first stop condition (the rest are dropped).
        ``logprobs``: (f32[W], i32[W, K], f32[W, K], f32[W, I]) of these tokens (``sampling.read_logprobs`` of the
        slot)."""
        sp = self.params
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        max_stop = max((len(s) for s in sp.stop), default=0)
        for j, tok in enumerate(tokens):
            tok = int(tok)
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            self.output_ids.append(tok)
            self._record_logprob(logprobs, j, tok)
            if tok in stop_ids:
                self.finish_reason = {"type": "stop", "matched": tok}
                if sp.no_stop_trim:  # the stop token stays in the text (unless skip_special_tokens hides it)
                    self._detok_ids.append(tok)
                    self.text += self._decode_delta(tokenizer, final=True)
                return
            self._detok_ids.append(tok)
            old_len = len(self.text)
            self.text += self._decode_delta(tokenizer, final=False)
            if max_stop and len(self.text) > old_len:
                start = max(0, old_len - max_stop + 1)
                hits = [(self.text.find(s, start), s) for s in sp.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    self.text = self.text[:i + (len(s) if sp.no_stop_trim else 0)]
                    self.finish_reason = {"type": "stop", "matched": s}
                    return
            if len(self.output_ids) >= sp.max_new_tokens or len(self.output_ids) >= context_left:
                self.finish_reason = {"type": "length", "length": len(self.output_ids)}
                return

    def flush_text(self, tokenizer) -> None:
        """At finish: emit the tail held back for a possibly incomplete character."""
        if self.finish_reason and self.finish_reason.get("type") == "stop" and isinstance(
                self.finish_reason.get("matched"), str):
            return
        self.text += self._decode_delta(tokenizer, final=True)

    def stream_delta(self) -> tuple[str, list[int]]:
        """New text and ids since the last event. While running, text that might begin a stop string is held back."""
        end = len(self.text)
        if not self.finished and self.params.stop:
            end -= max(stop_prefix_at_end(self.text, s) for s in self.params.stop)
        end = max(end, self.sent_chars)
        text = self.text[self.sent_chars:end]
        ids = self.output_ids[self.sent_ids:]
        self.sent_chars, self.sent_ids = end, len(self.output_ids)
        return text, ids

    def logprob_meta(self, tokenizer=None) -> dict:
        """SGLang's meta_info logprob fields: lists of (logprob, token_id, text or None) tuples; the top-logprob
        fields only with top_logprobs_num > 0, a position without them (the first prompt token) None."""
        text = (lambda t: tokenizer.decode([t])) if tokenizer is not None and self.params.return_text_in_logprobs \
            else (lambda t: None)
        triple = lambda lp, t: (lp, t, text(t))
        k = self.params.top_logprobs_num
        tops = lambda top: [triple(lp, t) for lp, t in top[:k]] if top else None
        meta = {"input_token_logprobs": [triple(e[0], e[1]) for e in self.input_logprobs],
                "output_token_logprobs": [triple(lp, t) for lp, t in self.output_logprobs]}
        if k > 0:
            meta["input_top_logprobs"] = [tops(e[2]) for e in self.input_logprobs]
            meta["output_top_logprobs"] = [tops(top) for top in self.output_top_logprobs]
        want = self.params.token_ids_logprob
        if want:
            by_id = lambda lps: [triple(lp, t) for lp, t in zip(lps, want)] if lps is not None else None
            meta["input_token_ids_logprobs"] = [by_id(e[3]) for e in self.input_logprobs]
            meta["output_token_ids_logprobs"] = [by_id(lps) for lps in self.output_ids_logprobs]
        return meta

    def meta_info(self, spec: bool, tokenizer=None) -> dict:
        now = time.perf_counter()
        m = {"id": self.rid, "finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt_ids),
             "completion_tokens": len(self.output_ids), "cached_tokens": self.cached_tokens,
             "e2e_latency": now - self.arrival}
        if spec:  # SGLang's fields: tokens per verify step (the prefill's included), accepted / proposed drafts
            m["spec_verify_ct"] = self.spec_verify_ct
            m["spec_accept_length"] = (len(self.output_ids) / self.spec_verify_ct) if self.spec_verify_ct else 0.0
            m["spec_accept_rate"] = self.spec_accepted / self.spec_draft_tokens if self.spec_draft_tokens else 0.0
            m["spec_accept_token_num"], m["spec_draft_token_num"] = self.spec_accepted, self.spec_draft_tokens
        if self.params.return_logprob:
            m.update(self.logprob_meta(tokenizer))
        return m
