"""Request and response bodies of the HTTP endpoints (pydantic), with SGLang's / OpenAI's field names and defaults.

Unknown extra fields are ignored (clients send many); known fields of the wrong type are a 400. Parameters that
would change the output but are not implemented (penalties, logit_bias, logprobs, constrained decoding) are refused
with a clear message rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .request import RequestError, SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- errors ------------------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- SGLang native /generate -------------------------------------------------------------------------------------
class GenerateSamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    sampling_seed: int | None = None


# Extra sampling parameters SGLang knows: accepted at their neutral value, refused otherwise.
NEUTRAL_EXTRAS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
                  "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
                  "no_stop_trim": False, "spaces_between_special_tokens": True, "custom_params": None,
                  "stream_interval": None}


def check_extras(extras: dict[str, Any], where: str = "sampling_params") -> None:
    for k, v in extras.items():
        if k in NEUTRAL_EXTRAS:
            if v not in (NEUTRAL_EXTRAS[k], None) and v != {}:
                raise RequestError(f"{where}.{k}={v!r} is not supported by specjax", param=k,
                                   code="unsupported_parameter")
        else:
            raise RequestError(f"unknown sampling parameter {k!r}", param=k)


def to_sampling(p: GenerateSamplingParams) -> SamplingParams:
    check_extras(p.model_extra or {})
    seed = p.seed if p.seed is not None else p.sampling_seed
    sp = SamplingParams(max_new_tokens=p.max_new_tokens if p.max_new_tokens is not None else 1 << 30,
                        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                        stop=[p.stop] if isinstance(p.stop, str) else list(p.stop or []),
                        stop_token_ids=list(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
                        skip_special_tokens=p.skip_special_tokens, n=p.n, seed=seed)
    sp.validate()
    return sp


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


# ---- OpenAI ------------------------------------------------------------------------------------------------------
class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang / vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            if v is not None and v != neutral:
                raise RequestError(f"{name}={v} is not supported by specjax", param=name,
                                   code="unsupported_parameter")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by specjax", param="logit_bias",
                               code="unsupported_parameter")
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        sp = SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else 1 << 30,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, n=self.n, seed=self.seed)
        sp.validate()
        return sp


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.logprobs:
            raise RequestError("logprobs are not supported by specjax", param="logprobs",
                               code="unsupported_parameter")
        if self.best_of not in (None, 1, self.n):
            raise RequestError("best_of is not supported by specjax", param="best_of", code="unsupported_parameter")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        if self.logprobs:
            raise RequestError("logprobs are not supported by specjax", param="logprobs",
                               code="unsupported_parameter")
        if self.tools:
            raise RequestError("tools are not supported by specjax", param="tools", code="unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise RequestError("response_format other than text is not supported", param="response_format",
                               code="unsupported_parameter")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


def finish_reason_openai(reason: dict | None) -> str | None:
    """SGLang meta_info finish_reason -> OpenAI's finish_reason."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), "abort")
