"""Every bad input of specs/server.md gets a 4xx with an OpenAI-style error body and the server keeps serving;
a client that disconnects mid-stream frees its slot and KV pages; the API key guards every endpoint but /health."""

from __future__ import annotations

import time

import httpx
import pytest

from test_server_helpers import Server, tiny_model_dir

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
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_completion_tokens": -1}, 400, "max_tokens"),
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
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -2}}, 400, None),
    ("/generate", {"text": "x", "sampling_params": {"frequency_penalty": 0.5}}, 400, "frequency_penalty"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "lots"}}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/generate", {"text": "x", "return_logprob": True}, 400, "return_logprob"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input(server, path, body, status, param):
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers=dict(AUTH, **{"content-type": "application/json"}))
    else:
        r = post(server, path, json=body)
    assert_error(r, status, param)


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
                         ("GET", "/metrics")]:
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
    aborted = httpx.get(server.url + "/get_server_info", headers=AUTH).json()["internal_states"][0]["aborted"]
    idle = kv_state(server)
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
    import json
    import socket
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

