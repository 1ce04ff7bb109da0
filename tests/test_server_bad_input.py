"""Every bad input of specs/server.md gets a 4xx with an OpenAI-style error body and the server keeps serving;
a client that disconnects mid-stream frees its slot and KV pages; the API key guards every endpoint but /health."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from server_helpers import Server, free_port, idle_state, sse_events, tiny_model_dir
from specjax.serve.api import create_app, http_protocol

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = Server(tiny_model_dir(), "--api-key", KEY, "--served-model-name", "tiny")
    yield s
    s.stop()


def post(server, path, content=None, json=None, headers=AUTH, **kw):
    return httpx.post(server.url + path, content=content, json=json, headers=headers, timeout=60, **kw)


def assert_error(r, status=400, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serves(server):
    r = post(server, "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                                              "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


BAD = [
    # (path, raw body or json, status, param)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),  # malformed JSON
    ("/generate", b"not json at all", 400, None),
    ("/v1/completions", b'["a", "list"]', 400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": "two"}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes please"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 5, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "top_p": -0.2}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 400, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(5, 300)), "max_tokens": 4}, 400, "prompt"),
    ("/generate", {"input_ids": list(range(5, 300))}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": MSG}, 404, "model"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/generate", {"text": "x", "input_ids": [1, 2]}, 400, None),
    ("/generate", {}, 400, None),
    ("/generate", {"input_ids": [1, 2, 99999]}, 400, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -2}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"frequency_penalty": 2.5}}, 400, "frequency_penalty"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "lots"}}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/generate", {"text": "x", "return_logprob": [True, False]}, 400, "return_logprob"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    # non-finite and out-of-range numbers (JSON NaN / Infinity literals, 1e999 overflows to inf)
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', 400, "top_p"),
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": NaN}}', 400, "temperature"),
    ("/generate", b'{"text": "x", "sampling_params": {"min_p": -Infinity}}', 400, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 10 ** 10}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 1e10}, 400, "top_k"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 2 ** 40}}, 400, "top_k"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "top_k": -7}, 400, "top_k"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 65}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2.5}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/generate", {"input_ids": [1, -2, 3]}, 400, "input_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ("/generate", {"text": []}, 400, "text"),
    # an output limit beyond the context (256 tokens) is refused naming the limit, not clamped
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_completion_tokens": 300}, 400,
     "max_completion_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 500}}, 400, "max_new_tokens"),
    # nesting too deep for any parser
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("/generate", b'{"text": "x", "sampling_params": ' + b'{"a": ' * 50000 + b"1" + b"}" * 50000 + b"}", 400,
     None),
    # fields that would change the output but are not implemented, or that nobody defines (penalties,
    # logit_bias, min_tokens and logprobs are implemented since issue 13: out-of-range values of them)
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "regex": "a+"}, 400, "regex"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "json_schema": "{}"}, 400, "json_schema"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "guided_json": {"type": "object"}}, 400,
     "guided_json"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "min_tokens": -5}, 400, "min_tokens"),
    # a least output length over the limit (was served up to the limit): SGLang's [0, max_new_tokens]
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "min_tokens": 50, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 50}, 400, "min_tokens"),  # max_tokens: 16
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "lora_path": "x"}, 400, "lora_path"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "image_data": "x.png"}, 400, "image_data"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "temprature": 0.2}, 400, "temprature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "stream_options": {"continuous_usage_stats": True}},
     400, "continuous_usage_stats"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "content": "x",
                                                             "tool_calls": [{"id": "1"}]}]}, 400, "tool_calls"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/generate", {"text": "x", "image_data": "x.png"}, 400, "image_data"),
    ("/generate", {"text": "x", "lora_path": "adapter"}, 400, "lora_path"),
    ("/generate", {"text": "x", "return_hidden_states": True}, 400, "return_hidden_states"),
    ("/generate", {"text": "x", "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a+"}}, 400, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{}"}}, 400, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": -3}}, 400, "min_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, 400, "min_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_token": 3}}, 400, "max_new_token"),
    # stream_options without stream: true (OpenAI and vLLM refuse it too)
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "stream": False,
                              "stream_options": {"include_usage": False}}, 400, "stream_options"),
    # a lone UTF-16 surrogate escape in any string (or field name) of a body is not valid Unicode
    ("/generate", b'{"text": "a\\ud800b"}', 400, "text"),
    ("/generate", b'{"text": ["ok", "\\udc00"]}', 400, "text"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "hi \\uDFFF"}]}]}', 400, "text"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"chat_template_kwargs": {"who": "\\udbff"}}', 400, "who"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "x\\uD83D"]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["a", "\\ude00"]}', 400, "stop"),
    ("/generate", b'{"text": "x", "sampling_params": {"stop": "\\ud800"}}', 400, "stop"),
    ("/generate", b'{"text": "x", "\\ud800": 1}', 400, None),
    # rid: one per prompt of a batch, each its own
    ("/generate", {"text": ["a", "b"], "rid": ["same", "same"]}, 400, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, 400, "rid"),
    ("/generate", {"input_ids": [[5, 6], [7, 8]], "rid": ["a", "b", "c"]}, 400, "rid"),
    ("/generate", {"text": "x", "token_ids_logprob": [-1], "return_logprob": True}, 400, "token_ids_logprob"),
    ("/generate", {"text": "x", "token_ids_logprob": [[1], [2]], "return_logprob": True}, 400, "token_ids_logprob"),
    ("/v1/score", {"query": "x", "items": ["y"], "label_token_ids": []}, 400, "label_token_ids"),
    ("/v1/score", {"query": "x", "items": ["y"], "label_token_ids": [10 ** 9]}, 400, "label_token_ids"),
    ("/v1/score", {"query": [1, 2], "items": ["y"], "label_token_ids": [1]}, 400, "items"),
    ("/v1/score", {"items": ["y"], "label_token_ids": [1]}, 400, "query"),
    ("/pause_generation", {"mode": "later"}, 400, "mode"),
    ("/get_weights_by_name", {"name": "model.nope.weight"}, 400, "name"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": -1}, 400, "truncate_size"),
    ("/abort_request", {}, 400, "rid"),
    ("/abort_request", {"rid": 5}, 400, "rid"),
    ("/abort_request", {"abort_all": "maybe"}, 400, "abort_all"),
    ("/abort_request", {"rid": "x", "everything": True}, 400, "everything"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input(server, path, body, status, param):
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers=dict(AUTH, **{"content-type": "application/json"}))
    else:
        r = post(server, path, json=body)
    assert_error(r, status, param)


def _every_field():
    """(path, body, field) with one field of every request body of every POST endpoint set to a value no field
    accepts: declared fields, fields accepted only at a neutral value, nested sampling_params / messages /
    stream_options fields."""
    from specjax.serve import protocol as P
    bad = [[{"x": 1}]]
    base = {"/generate": {"text": "x"}, "/v1/completions": {"model": "tiny", "prompt": "x"},
            "/v1/chat/completions": {"model": "tiny", "messages": MSG}, "/abort_request": {"rid": "x"},
            "/v1/score": {"model": "tiny", "query": "x", "items": ["y"], "label_token_ids": [1]},
            "/pause_generation": {}, "/get_weights_by_name": {"name": "model.norm.weight"}}
    models = {"/generate": P.GenerateRequest, "/v1/completions": P.CompletionRequest,
              "/v1/chat/completions": P.ChatCompletionRequest, "/abort_request": P.AbortRequest,
              "/v1/score": P.ScoringRequest, "/pause_generation": P.PauseGenerationRequest,
              "/get_weights_by_name": P.GetWeightsByNameRequest}
    out = []
    for path, model in models.items():
        for f in sorted(set(model.model_fields) | set(model.UNSUPPORTED)):
            out.append((path, dict(base[path], **{f: bad}), f))
    for f in sorted(set(P.GenerateSamplingParams.model_fields) | set(P.NEUTRAL_EXTRAS)):
        out.append(("/generate", {"text": "x", "sampling_params": {f: bad}}, f))
    for f in sorted(set(P.ChatMessage.model_fields) | set(P.ChatMessage.UNSUPPORTED)):
        out.append(("/v1/chat/completions", {"model": "tiny", "messages": [dict(MSG[0], **{f: bad})]}, f))
    for f in sorted(set(P.StreamOptions.model_fields) | set(P.StreamOptions.UNSUPPORTED)):
        out.append(("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {f: bad}},
                    f))
    return out


EVERY_FIELD = _every_field()


@pytest.mark.parametrize("path, body, field", EVERY_FIELD, ids=[f"{p}-{f}" for p, _, f in EVERY_FIELD])
def test_every_field_refuses_a_bad_value(server, path, body, field):
    assert_error(post(server, path, json=body), 400, field)


COERCIBLE = [  # values a lax parser would convert ("10" -> 10, "true" / 1 -> True, true -> 1): refused, as OpenAI does
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"ignore_eos": "true"}}, "ignore_eos"),
    ("/generate", {"text": "x", "sampling_params": {"n": True}}, "n"),
    ("/generate", {"text": "x", "stream": "yes"}, "stream"),
    ("/generate", {"input_ids": ["1", "2"]}, "input_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": "7"}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": "3"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "logprobs": "true"}, "logprobs"),
]


@pytest.mark.parametrize("path, body, field", COERCIBLE, ids=[f"{p}-{f}" for p, _, f in COERCIBLE])
def test_values_of_the_wrong_type_are_not_converted(server, path, body, field):
    assert_error(post(server, path, json=body), 400, field)


def test_integral_floats_count_as_integers(server):
    """A count sent as 3.0 (JSON clients that have only doubles) is 3, as SamplingParams takes it; 2.5 is not."""
    r = post(server, "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 3.0, "n": 1.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
    assert_error(post(server, "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2.5}),
                 400, "max_tokens")


def test_neutral_values_are_accepted(server):
    """Fields specjax does not implement are fine at the value that asks for nothing (what SDKs send by default)."""
    for path, body in [
        ("/v1/chat/completions", {"model": "tiny", "messages": [dict(MSG[0], name="ann")], "max_tokens": 2,
                                  "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False,
                                  "top_logprobs": None, "tools": [], "tool_choice": "auto", "user": "u-1",
                                  "response_format": {"type": "text"}, "logit_bias": {}, "n": 1, "store": False,
                                  "stream": True,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": False}}),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "best_of": 1, "suffix": None,
                             "logprobs": None, "echo": False, "min_tokens": 0}),
        ("/generate", {"text": "x", "return_hidden_states": False, "lora_path": None,
                       "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 0, "regex": None,
                                           "repetition_penalty": 1.0}}),
    ]:
        r = post(server, path, json=body)
        assert r.status_code == 200, (path, r.text)


def test_lone_surrogates_are_refused_naming_the_field(server):
    """A lone surrogate escape is a 400 naming where it is (no tokenizer takes it: it was a 500); a surrogate pair
    (what json.dumps writes for an emoji by default) is one valid character."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\ud800"}]}'
    err = assert_error(post(server, "/v1/chat/completions", content=body), 400, "content")
    assert err["code"] == "invalid_unicode" and "messages[1].content is not valid Unicode" in err["message"], err
    pair = json.dumps({"text": "smile \U0001F600", "sampling_params": {"max_new_tokens": 2}})
    assert "\\ud83d\\ude00" in pair
    assert post(server, "/generate", content=pair).status_code == 200
    still_serves(server)


def test_a_rid_in_flight_is_refused(server):
    """A second request under the rid of one still running is a 400 (an abort by rid would stop both), and the
    first runs on to its end; once it finished, its rid can be used again. The second is sent as soon as the first
    has streamed a token; on a loaded host the first (240 tokens of a tiny model) can end before the second arrives,
    which the second's success shows (it could not run beside the first): then the pair is tried again."""
    body = {"text": "Hello", "rid": "dup-rid", "stream": True,
            "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    refused = []
    for attempt in range(4):
        with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/generate", json=body,
                                                               headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)  # the request is running
            second = post(server, "/generate", json={"text": "Hi", "rid": "dup-rid",
                                                     "sampling_params": {"max_new_tokens": 1}})
            events = sse_events([first, *lines])
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert events[-1]["meta_info"]["completion_tokens"] == 240
        if second.status_code == 200:  # the first had ended: its rid was free again
            assert second.json()["meta_info"]["id"] == "dup-rid", second.text
            continue
        refused.append(assert_error(second, 400, "rid"))
        break
    assert refused and refused[0]["code"] == "duplicate_rid", (attempt, refused)
    r = post(server, "/generate", json={"text": "Hi", "rid": "dup-rid", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "dup-rid", r.text


class _BrokenScheduler:
    @property
    def alive(self):
        raise RuntimeError("scheduler state unreadable")


def test_an_internal_error_keeps_the_connection(caplog):
    """An unexpected exception in a handler is a 500 with the error body, logged once with its traceback, on a
    keep-alive connection that stays open (re-raised, as Starlette does, uvicorn closed it: the client's next
    request on it failed). An app over a fake backend whose /health raises; no model."""
    backend = SimpleNamespace(args=SimpleNamespace(api_key=None), scheduler=_BrokenScheduler())
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_config=None,
                                        http=http_protocol(10.0), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not srv.started and time.time() < deadline:
            time.sleep(0.02)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        socks = []
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                conn.request("GET", "/health")
                resp = conn.getresponse()
                err = json.loads(resp.read())["error"]
                assert resp.status == 500 and err["type"] == "internal_server_error", err
                assert "RuntimeError: scheduler state unreadable" in err["message"], err
                assert not resp.will_close
                socks.append(conn.sock)
        conn.close()
        assert socks[0] is not None and all(s is socks[0] for s in socks)  # one connection, kept open
    finally:
        srv.should_exit = True
        thread.join(10)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3 and all(r.exc_info for r in errors), [r.getMessage() for r in errors]
    assert not any("Exception in ASGI application" in r.getMessage() for r in caplog.records)


def _timed_health(server, stop, times):
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get(server.url + "/health").status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)


def test_large_bodies_are_refused_without_stalling_health(server):
    """413 from the Content-Length alone (before the body is read), 413 while a chunked body streams in, and a large
    body under the limit tokenized off the event loop: /health keeps answering fast all along."""
    import threading
    stop, times = threading.Event(), []
    t = threading.Thread(target=_timed_health, args=(server, stop, times))
    t.start()
    try:
        time.sleep(0.3)
        big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"word " * (2 << 20) + b'"}]}'
        err = assert_error(post(server, "/v1/chat/completions", content=big), 413)  # 10 MiB > 8 MiB default
        assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]

        def chunks():
            yield big[:1 << 20]
            for _ in range(20):
                yield b" " * (1 << 20)
        assert_error(post(server, "/v1/completions", content=chunks()), 413)  # no Content-Length
        under = b'{"model": "tiny", "prompt": "' + b"word " * (1 << 20) + b'", "max_tokens": 4}'  # 5 MiB
        t0 = time.perf_counter()
        assert_error(post(server, "/v1/completions", content=under), 400, "prompt")  # tokenized, then too long
        busy = time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
    times.sort()
    assert len(times) > 10, (len(times), busy)
    # generous bounds for a loaded CI machine; docs/benchmarks.md has the measured figures
    assert times[len(times) // 2] < 0.2 and times[-1] < 1.0, (times[len(times) // 2], times[-1], busy)
    still_serves(server)


def test_connections_without_complete_headers_are_closed():
    """A client that opens a connection and trickles its headers (slowloris) is cut off after
    --http-header-timeout; one that never sends a byte too."""
    s = Server(tiny_model_dir(), "--http-header-timeout", "1", "--http-idle-timeout", "2")
    try:
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", s.port)) as idle, \
                socket.create_connection(("127.0.0.1", s.port)) as slow:
            idle.settimeout(10)
            slow.settimeout(10)
            slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            for _ in range(6):  # keeps sending, never finishes the headers
                time.sleep(0.25)
                try:
                    slow.sendall(b"X-Pad: 1\r\n")
                except OSError:
                    break
            assert idle.recv(100) == b""  # closed by the server
            assert slow.recv(100) == b""
        assert time.perf_counter() - t0 < 8
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("host, why", [("127.0.0.1", "Address already in use"),
                                       ("192.0.2.1", "Cannot assign requested address")])  # TEST-NET-1: not ours
def test_an_address_it_cannot_listen_on_fails_before_the_model_loads(host, why):
    """A port in use or a host that is not this machine's: one line naming the address, exit 1, and the model is
    never loaded or warmed up (the sockets are bound first, not after minutes of start-up)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "specjax.serve", "--model-path", tiny_model_dir(), "--host", host,
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"python -m specjax.serve: cannot start: cannot listen on {host}:{port} "
                                                f"(--host {host}, --port {port}): {why}"], proc.stderr
    assert "warm" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_still_serves_after_bad_inputs(server):
    still_serves(server)
    assert httpx.get(server.url + "/health_generate", headers=AUTH, timeout=60).status_code == 200


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)
    assert_error(httpx.get(server.url + "/generate", headers=AUTH), 405)


def test_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    for method, path in [("GET", "/v1/models"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
                         ("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/health_generate"),
                         ("GET", "/metrics"), ("POST", "/update_weights_from_disk"), ("POST", "/v1/tokenize"),
                         ("POST", "/v1/detokenize")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={"text": "x"}, timeout=30)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    import openai
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert ok.data[0].id == "tiny"


def kv_state(server):
    s = httpx.get(server.url + "/get_server_info", headers=AUTH).json()["internal_states"][0]
    return s["kv_pages_used"], s["num_running_reqs"]


def test_disconnect_mid_stream_frees_pages(server):
    start = idle_state(server.url, headers=AUTH)  # the earlier tests' requests out of the state
    aborted = start["aborted"]
    idle = start["kv_pages_used"], start["num_running_reqs"]
    assert idle == (0, 0)
    for path, body in [("/generate", {"text": "Hello", "stream": True,
                                      "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 220,
                                                 "ignore_eos": True})]:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", server.url + path, json=body, headers=AUTH) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data: ")
                    if got == 3:
                        assert kv_state(server)[0] > 0  # the request holds pages while it runs
                        break
        deadline = time.time() + 20
        while kv_state(server) != idle and time.time() < deadline:
            time.sleep(0.1)
        assert kv_state(server) == idle
    info = httpx.get(server.url + "/get_server_info", headers=AUTH).json()["internal_states"][0]
    assert info["aborted"] == aborted + 2  # both were cut short by the disconnect, not finished
    still_serves(server)


def test_disconnect_while_waiting_for_a_non_streaming_response(server):
    aborted = httpx.get(server.url + "/get_server_info", headers=AUTH).json()["internal_states"][0]["aborted"]
    # 16 requests of 240 tokens on 8 slots: two waves, far longer than the disconnect takes to be noticed
    body = json.dumps({"text": ["Hello"] * 16, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}})
    raw = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw)
        deadline = time.time() + 10
        while kv_state(server)[1] == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert kv_state(server)[1] > 0
    deadline = time.time() + 20
    while kv_state(server) != (0, 0) and time.time() < deadline:
        time.sleep(0.1)
    assert kv_state(server) == (0, 0)
    info = httpx.get(server.url + "/get_server_info", headers=AUTH).json()["internal_states"][0]
    assert info["aborted"] >= aborted + 8
    still_serves(server)

