"""Request and response bodies of the HTTP endpoints (pydantic), with SGLang's / OpenAI's field names and defaults.

Every field of a request is either honoured or refused with a 400 naming it (``check_fields``): known fields of the
wrong type or out of range, NaN/Infinity, fields that SGLang / vLLM / OpenAI define but specjax does not implement
(constrained decoding, LoRA, images, tools, ...) unless they carry their neutral value, and fields nobody defines (a
typo would otherwise pass silently). Penalties, logit_bias, min_tokens and logprobs are honoured; the logprob objects
of the responses are built here (``chat_logprobs``, ``completion_logprobs``, ``logprob_params``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
import weakref
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from specjax import sampling

from .request import (NEUTRAL_EXTRAS, NO_LIMIT, RequestError, SamplingParams, check_min_tokens,
                      refuse_unsupported, with_logprob_fields)



# A count or seed: an integer, or a float with an integral value (JSON clients send 3.0), as ``SamplingParams``
# takes them; a string or a bool is refused (the bodies are strict: "10" is no int, 1 no bool). Token ids stay int.
Int = Annotated[int, BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]


class _Body(BaseModel):
    """A request body: extra fields are collected (not dropped) so that ``check_fields`` can name each one."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)  # "10" is no int, 1 no bool
    # field -> neutral values: fields other servers define that specjax does not implement; sent with one of these
    # values (or null / empty) they ask for nothing and are accepted, otherwise refused.
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def check_fields(self, where: str = "") -> None:
        """RequestError (400) naming the first field that is neither honoured nor neutral, here or nested."""
        for k, v in (self.model_extra or {}).items():
            if k not in self.UNSUPPORTED:
                raise RequestError(f"unknown field {where}{k!r}", param=k, code="unknown_parameter")
            refuse_unsupported(k, v, self.UNSUPPORTED, where)
        for name in type(self).model_fields:
            v = getattr(self, name)
            items = v if isinstance(v, list) else [v]
            for i, x in enumerate(items):
                if isinstance(x, _Body):
                    x.check_fields(f"{where}{name}{f'[{i}]' if isinstance(v, list) else ''}.")

    def check(self) -> None:
        """Called on every parsed body (api.parse_body); endpoints with cross-field rules extend it."""
        self.check_fields()


# Unsupported-feature fields shared by the OpenAI endpoints (OpenAI's own, then SGLang / vLLM extensions).
_OPENAI_UNSUPPORTED = {
    "regex": (), "json_schema": (), "ebnf": (), "structural_tag": (), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (),
    "lora_path": (), "lora_request": (), "image_data": (), "session_params": (), "return_hidden_states": (False,),
    "spaces_between_special_tokens": (True,), "prompt_logprobs": (), "response_format": ({"type": "text"},),
    "tools": (),
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "functions": (), "function_call": (),
    "store": (False,), "metadata": (), "service_tier": ("auto", "default"), "modalities": (["text"],),
    "audio": (), "prediction": (), "reasoning_effort": (), "web_search_options": (), "best_of": (1,),
    "suffix": (), "continue_final_message": (False,), "add_generation_prompt": (True,),
    "separate_reasoning": (True, False), "stream_reasoning": (True, False), "rid": (),
}


# ---- errors ------------------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- SGLang native /generate -------------------------------------------------------------------------------------
class GenerateSamplingParams(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = NEUTRAL_EXTRAS
    max_new_tokens: Int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Int = 1
    seed: Int | None = None
    sampling_seed: Int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: Int = 0
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool = False


def to_sampling(p: GenerateSamplingParams) -> SamplingParams:
    seed = p.seed if p.seed is not None else p.sampling_seed
    sp = SamplingParams(max_new_tokens=p.max_new_tokens if p.max_new_tokens is not None else NO_LIMIT,
                        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                        stop=[p.stop] if isinstance(p.stop, str) else list(p.stop or []),
                        stop_token_ids=list(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
                        skip_special_tokens=p.skip_special_tokens, n=p.n, seed=seed,
                        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                        repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens,
                        logit_bias=p.logit_bias, no_stop_trim=p.no_stop_trim)
    sp.validate()
    return sp


class GenerateRequest(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "image_data": (), "audio_data": (), "video_data": (), "input_embeds": (), "lora_path": (), "lora_id": (),
        "return_hidden_states": (False,), "custom_logit_processor": (),
        "modalities": (), "data_parallel_rank": (), "log_metrics": (True, False),
        "bootstrap_host": (), "bootstrap_port": (), "bootstrap_room": ()}
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: Int | list[Int] = -1
    top_logprobs_num: Int | list[Int] = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: list[Int] | list[list[Int]] | None = None
    priority: Int | None = None  # with --enable-priority-scheduling (``scheduler.PriorityPolicy``)
    session_params: dict | list[dict] | None = None  # SGLang's: continue a request of a session (``serve.sessions``)

    def with_logprobs(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` (one per prompt) with this request's logprob fields (scalars or one per prompt) applied."""
        return with_logprob_fields(params, return_logprob=self.return_logprob,
                                   logprob_start_len=self.logprob_start_len, top_logprobs_num=self.top_logprobs_num,
                                   return_text_in_logprobs=self.return_text_in_logprobs,
                                   token_ids_logprob=self.token_ids_logprob)


# ---- OpenAI ------------------------------------------------------------------------------------------------------
class StreamOptions(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"continuous_usage_stats": (False,)}
    include_usage: bool = False


class _OpenAISampling(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = _OPENAI_UNSUPPORTED
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = None
    user: str | None = None  # an end-user id for the caller's own records; no effect on the output
    # SGLang / vLLM extensions.
    top_k: Int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    priority: Int | None = None  # SGLang's, with --enable-priority-scheduling
    min_tokens: Int | None = None
    no_stop_trim: bool = False

    def logprob_request(self) -> tuple[bool, int, bool]:
        """(return_logprob, top_logprobs_num, echo prompt logprobs): each endpoint maps its own fields."""
        return False, 0, False

    def check(self) -> None:
        self.check_fields()
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")

    def sampling(self, max_tokens: int | None, param: str = "max_tokens") -> SamplingParams:
        """The SamplingParams of this body with the output limit ``max_tokens`` (given as the field ``param``)."""
        want, top, echo = self.logprob_request()
        echo_field = getattr(self, "echo", None)  # completions only
        if max_tokens is not None and max_tokens < (0 if echo_field else 1):
            # 0 with echo scores the prompt alone (what evaluation harnesses send; vLLM takes it too)
            raise RequestError(f"{param} must be >= 1{' (0 only with echo)' if echo_field is not None else ''}, "
                               f"got {max_tokens}", param=param)
        if self.min_tokens is not None:  # no max_tokens: no limit but the context (the scheduler's)
            check_min_tokens(self.min_tokens, max_tokens if max_tokens is not None else NO_LIMIT, "min_tokens", param)
        sp = SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else NO_LIMIT,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, n=self.n, seed=self.seed,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_new_tokens=self.min_tokens or 0, logit_bias=self.logit_bias, no_stop_trim=self.no_stop_trim)
        sp.return_logprob, sp.top_logprobs_num, sp.logprob_start_len = want, top, 0 if echo else -1
        sp.validate()
        return sp


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None  # completions: the number of top logprobs per token (0: the chosen token's only)

    def logprob_request(self) -> tuple[bool, int, bool]:
        if self.logprobs is not None and not 0 <= self.logprobs <= sampling.TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {sampling.TOP_LOGPROBS}], got {self.logprobs}",
                               param="logprobs")
        want = self.logprobs is not None
        return want, self.logprobs or 0, want and self.echo

    def check(self) -> None:
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of == self.n and isinstance(best_of, int):
            self.model_extra.pop("best_of")  # best_of == n: the n samples are the answer, as asked
        super().check()


class ChatMessage(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"tool_calls": (), "tool_call_id": (), "function_call": (),
                                               "reasoning_content": (), "refusal": (), "audio": ()}
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template (templates that know it use it)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"message content part of type {part.get('type')!r} is not supported "
                                   f"(text only)", param="messages")
            parts.append(part["text"])
        return "".join(parts)

    def template_dict(self) -> dict[str, str]:
        d = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (enable_thinking...)
    logprobs: bool = False
    top_logprobs: Int | None = None

    def check(self) -> None:
        super().check()
        for i, m in enumerate(self.messages):  # only an assistant turn may come without content (OpenAI's rule)
            if m.content is None and m.role != "assistant":
                raise RequestError(f"messages[{i}].content is required for a {m.role} message", param="messages")

    def logprob_request(self) -> tuple[bool, int, bool]:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= sampling.TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {sampling.TOP_LOGPROBS}], got {self.top_logprobs}",
                                   param="top_logprobs")
            if self.top_logprobs and not self.logprobs:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return self.logprobs, self.top_logprobs or 0, False

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specjax"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class GetWeightsByNameRequest(_Body):
    """SGLang's ``/get_weights_by_name``."""
    name: str
    truncate_size: Int = 100


class PauseGenerationRequest(_Body):
    """SGLang's ``/pause_generation``: ``abort``, ``retract`` or ``in_place`` (``Scheduler.pause_generation``)."""
    mode: str = "abort"


class ScoringRequest(_Body):
    """SGLang's ``/v1/score``: the probabilities of ``label_token_ids`` after query + each item (``serve.scoring``)."""
    model: str | None = None
    query: str | list[Int] | None = None
    items: str | list[str] | list[list[Int]] | None = None
    label_token_ids: list[Int] | None = None
    apply_softmax: bool = False
    item_first: bool = False


class ScoringResponse(BaseModel):
    scores: list[list[float]]  # per item, in the order of label_token_ids
    model: str
    usage: UsageInfo | None = None
    object: str = "scoring"


class TokenizeRequest(_Body):
    """SGLang's ``/v1/tokenize``: one prompt or a list of them."""
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(_Body):
    """SGLang's ``/v1/detokenize``: one list of token ids or a list of them."""
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    text: str | list[str]


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang's ``/update_weights_from_disk``."""
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    # SGLang's for CUDA memory and graphs: nothing to do under JAX (programs take the new weights as arguments)
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    # SGLang's that specjax lacks: refused when they ask for something
    is_async: bool = False
    keep_pause: bool = False


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionRequest(_Body):
    """SGLang's ``/update_weight_version``: relabel the weights served (every running request aborted first unless
    ``abort_all_requests`` is false)."""
    new_version: str
    abort_all_requests: bool = True


class MemoryOccupationRequest(_Body):
    """SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``: ``weights``, ``kv_cache``,
    ``cuda_graph`` (nothing to do here); none: all."""
    tags: list[str] | None = None


class OpenSessionRequest(_Body):
    """SGLang's ``/open_session`` (``serve.sessions``); ``capacity_of_str_len`` is recorded, as SGLang's."""
    capacity_of_str_len: Int
    session_id: str | None = None


class CloseSessionRequest(_Body):
    session_id: str


class ProfileRequest(_Body):
    """SGLang's ``/start_profile`` (``serve.profiler``)."""
    output_dir: str | None = None
    start_step: Int | None = None
    num_steps: Int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_prefix: str | None = None


def finish_reason_openai(reason: dict | None) -> str | None:
    """SGLang meta_info finish_reason -> OpenAI's finish_reason."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), "abort")


# ---- logprob objects -----------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to the printable characters that byte-level BPE vocabularies spell them with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}  # byte-level BPE character -> its byte
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
_SP_SPACE = "\u2581"  # SentencePiece's space marker


def _decoder_types(tokenizer) -> set[str]:
    """The ``type`` names in a fast tokenizer's decoder (a Sequence's included), and "Replace▁" for a Replace of
    SentencePiece's space marker; empty for a tokenizer without a tokenizers decoder."""
    try:
        state = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a slow tokenizer, no decoder, or an unreadable one: no types
        return set()
    types, todo = set(), [state]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            types.add(str(d.get("type")))
            if d.get("type") == "Replace" and _SP_SPACE in json.dumps(d.get("pattern"), ensure_ascii=False):
                types.add("Replace" + _SP_SPACE)
            todo.extend(d.get("decoders") or [])
    return types


class TokenBytes:
    """A token id's own bytes, read from the vocabulary (cached per id): what OpenAI's logprob ``bytes`` hold, so
    that the bytes of consecutive tokens joined are the text's even where a token holds part of a character (which
    ``tokenizer.decode([id])`` turns into U+FFFD). Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell
    bytes with GPT-2's ``bytes_to_unicode`` characters; SentencePiece ones (Llama 2, Mistral) have ``▁`` for a space
    and ``<0xNN>`` byte-fallback pieces; added and special tokens are their text. Any other tokenizer: the UTF-8 of
    ``decode([id])``."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        types = _decoder_types(tokenizer)
        if "ByteLevel" in types or isinstance(getattr(tokenizer, "byte_decoder", None), dict):
            self.scheme = "byte_level"
        elif types & {"ByteFallback", "Metaspace", "Replace" + _SP_SPACE} or hasattr(tokenizer, "sp_model"):
            self.scheme = "sentencepiece"
        else:
            self.scheme = "decode"
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self.special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        self.special |= {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}

    def __call__(self, tok: int) -> bytes:
        raw = self.cache.get(tok)
        if raw is None:
            raw = self.cache[tok] = self._read(tok)
        return raw

    def _read(self, tok: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(tok) if self.scheme != "decode" else None
        if not isinstance(piece, str):
            return self.tokenizer.decode([tok]).encode("utf-8")
        if self.scheme == "sentencepiece" and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if tok in self.added:
            return self.added[tok].encode("utf-8")
        if self.scheme == "sentencepiece":
            return piece.replace(_SP_SPACE, " ").encode("utf-8")
        if all(c in BYTE_DECODER for c in piece):
            return bytes(BYTE_DECODER[c] for c in piece)
        return self.tokenizer.decode([tok]).encode("utf-8")  # (not a byte-level piece: what it decodes to)


_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer) -> TokenBytes:
    """The (cached) ``TokenBytes`` of ``tokenizer``."""
    try:
        tb = _TOKEN_BYTES.get(tokenizer)
        if tb is None:
            tb = _TOKEN_BYTES[tokenizer] = TokenBytes(tokenizer)
        return tb
    except TypeError:  # a tokenizer that takes no weak reference: read without the cache of earlier requests
        return TokenBytes(tokenizer)


def token_text(raw: bytes) -> str:
    """A token's ``token`` string, as OpenAI's: its UTF-8 text, each byte of a partial character written as a
    backslash escape (the first two bytes of U+1F600 give the 8 characters ``\\xf0\\x9f``)."""
    return raw.decode("utf-8", "backslashreplace")


def chat_logprobs(meta: dict, tokenizer, top_n: int, start: int = 0) -> dict | None:
    """OpenAI chat ``choices[i].logprobs`` from SGLang meta_info (output tokens from index ``start``): per token its
    text and its own bytes (``TokenBytes``), so that the entries' bytes joined are the content's."""
    if "output_token_logprobs" not in meta:
        return None
    tb = token_bytes_of(tokenizer)

    def entry(lp, tok):
        raw = tb(tok)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    toks = meta["output_token_logprobs"]
    tops = meta.get("output_top_logprobs") or [None] * len(toks)  # absent with top_logprobs_num 0, as SGLang
    content = []
    for (lp, tok, _), top in list(zip(toks, tops))[start:]:
        content.append(dict(entry(lp, tok), top_logprobs=[entry(l, t) for l, t, _ in (top or [])[:top_n]]))
    return {"content": content}


def _chars(raw: bytes) -> int:
    """The characters that start in ``raw`` (its UTF-8 lead bytes and ASCII)."""
    return sum(1 for b in raw if b & 0xC0 != 0x80)


def completion_logprobs(meta: dict, tokenizer, top_n: int, echo: bool, start: int = 0, text_offset: int = 0,
                        skip_special: bool = True) -> dict | None:
    """OpenAI completions ``choices[i].logprobs`` ({tokens, token_logprobs, top_logprobs, text_offset}) from SGLang
    meta_info; with ``echo`` the prompt's tokens come first (the first one's logprob and top_logprobs None)."""
    return completion_logprobs_chunk(meta, tokenizer, top_n, echo, start, text_offset, skip_special)[0]


def completion_logprobs_chunk(meta: dict, tokenizer, top_n: int, echo: bool, start: int = 0, text_offset: int = 0,
                              skip_special: bool = True) -> tuple[dict | None, int]:
    """``completion_logprobs`` of the output tokens from index ``start`` (a stream's next chunk), and the
    ``text_offset`` the chunk after it starts from. ``text_offset`` counts characters of the returned text: a token
    starts where its first byte falls (a token that continues a character: at that character), so the offsets never
    decrease nor run past the text; an output special token that ``skip_special`` leaves out of the text spans none."""
    if "output_token_logprobs" not in meta:
        return None, text_offset
    tb = token_bytes_of(tokenizer)
    inp, out_ = meta["input_token_logprobs"], meta["output_token_logprobs"]
    in_tops = meta.get("input_top_logprobs") or [None] * len(inp)  # absent with top_logprobs_num 0, as SGLang
    out_tops = meta.get("output_top_logprobs") or [None] * len(out_)
    pairs = [(lp, t, top, False) for (lp, t, _), top in zip(inp, in_tops)] if echo and start == 0 else []
    pairs += [(lp, t, top or [], skip_special) for (lp, t, _), top in list(zip(out_, out_tops))[start:]]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for lp, t, top, skip in pairs:
        raw = b"" if skip and t in tb.special else tb(t)
        out["tokens"].append(token_text(tb(t)))
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {token_text(tb(tt)): l for l, tt, _ in top[:top_n]})
        out["text_offset"].append(offset - 1 if offset and raw and raw[0] & 0xC0 == 0x80 else offset)
        offset += _chars(raw)
    return out, offset
