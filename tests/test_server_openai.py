"""OpenAI-compatible endpoints through the real ``openai`` client: chat and completions, streaming and not, n > 1,
stop strings (also across token boundaries), usage counts."""

from __future__ import annotations

import re

import openai
import pytest

from server_helpers import SHARED_NAME, model_dir, server  # noqa: F401 (fixtures)

NAME = SHARED_NAME
IGNORE_EOS = {"ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to Paris."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_tokenize_and_detokenize(server, tokenizer):
    """SGLang's /v1/tokenize and /v1/detokenize (also without /v1): the served tokenizer's ids and text, one prompt or
    a list; ids outside the vocabulary and a wrong model are refused."""
    import httpx
    url = server.url
    r = httpx.post(url + "/v1/tokenize", json={"model": NAME, "prompt": "Hello Paris"}).json()
    want = tokenizer("Hello Paris")["input_ids"]
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] > len(want)
    r = httpx.post(url + "/tokenize", json={"prompt": ["a b", "", "Paris"], "add_special_tokens": False}).json()
    assert r["tokens"] == [tokenizer("a b", add_special_tokens=False)["input_ids"], [],
                           tokenizer("Paris", add_special_tokens=False)["input_ids"]] and r["count"][1] == 0
    eos = tokenizer.eos_token_id
    r = httpx.post(url + "/v1/detokenize", json={"tokens": want + [eos]}).json()
    assert r == {"text": tokenizer.decode(want + [eos], skip_special_tokens=True)}
    r = httpx.post(url + "/detokenize", json={"tokens": [want, [eos]], "skip_special_tokens": False}).json()
    assert r == {"text": [tokenizer.decode(want), tokenizer.decode([eos])]}
    assert httpx.post(url + "/v1/detokenize", json={"tokens": []}).json() == {"text": ""}
    bad = httpx.post(url + "/v1/detokenize", json={"tokens": [1, len(tokenizer)]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/detokenize", json={"tokens": [1, "2"]}).status_code == 400
    assert httpx.post(url + "/v1/tokenize", json={"prompt": 5}).status_code == 400
    assert httpx.post(url + "/v1/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_chat(client, tokenizer):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body=IGNORE_EOS)
    assert r.object == "chat.completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == len(prompt_ids) + 8
    # max_completion_tokens is the newer name of the same limit
    r2 = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                        extra_body=IGNORE_EOS)
    assert r2.choices[0].message.content == c.message.content


def test_chat_stream_with_usage(client):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_and_stream(client):
    kw = dict(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == "The quick brown fox" + r.choices[0].text
    # default max_tokens is 16; token-id prompts work too
    d = client.completions.create(model=NAME, prompt=[5, 6, 7, 8], temperature=0, extra_body=IGNORE_EOS)
    assert d.usage.completion_tokens == 16 and d.usage.prompt_tokens == 4
    batch = client.completions.create(model=NAME, prompt=["Hello", "The quick brown fox"], max_tokens=12,
                                      temperature=0, extra_body=IGNORE_EOS)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == r.choices[0].text


def test_n_greater_than_one(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0, seed=11,
                                       extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert len({c.message.content for c in r.choices}) > 1
    again = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0,
                                           seed=11, extra_body=IGNORE_EOS)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=5, n=2, temperature=1.0, seed=5,
                                            stream=True, extra_body=IGNORE_EOS))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def _boundary_stop(tokenizer, ids):
    """A 3-character window of the decoded output that crosses a token boundary (and occurs there first)."""
    full = tokenizer.decode(ids)
    prefixes = (tokenizer.decode(ids[:k]) for k in range(1, len(ids)))
    cuts = {len(p) for p in prefixes if full.startswith(p) and not p.endswith("\ufffd")}
    for i in range(1, len(full) - 3):
        window = full[i:i + 3]
        if "\ufffd" in window or full.find(window) != i:
            continue
        if any(i < c < i + 3 for c in cuts):
            return i, window
    return None, None


def test_stop_strings(client, server, tokenizer):
    import httpx
    kw = dict(model=NAME, max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    for prompt in ("The capital of France is Paris. The capital of Italy is", "Hello world, hello there!",
                   "def add(a, b):", "Pack my box"):
        native = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
        text = native["text"]
        i, stop = _boundary_stop(tokenizer, native["output_ids"])
        if stop is not None and text.find(stop) == i:
            kw["prompt"] = prompt
            break
    else:
        pytest.skip("the random model produced no clean text window to stop on")
    assert client.completions.create(**kw).choices[0].text == text
    r = client.completions.create(stop=[stop, "zzzz-never"], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:i]
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text[:i]  # held-back text never leaks past the stop
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                          extra_body=IGNORE_EOS)
    content = chat.choices[0].message.content
    visible = [k for k in range(1, len(content) - 2) if "\ufffd" not in content[:k + 2]]
    if visible:
        k = visible[len(visible) // 2]
        s = content[k:k + 2]
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0, stop=s,
                                           extra_body=IGNORE_EOS)
        assert r.choices[0].message.content == content[:content.find(s)] and r.choices[0].finish_reason == "stop"


def test_bench_serve_against_this_server(server, capsys):
    from specjax.bench.serve import main
    assert main(["--url", server.url, "--concurrency", "1", "3", "--num-prompts", "4", "--max-tokens", "6",
                 "--prompts", "builtin", "--ignore-eos", "--warmup-requests", "1"]) == 0
    out = capsys.readouterr().out
    assert "out tok/s" in out and "TTFT p50" in out and "TPOT p50" in out and "ITL p50" in out
    rows = [line for line in out.splitlines() if line.startswith("|") and "conc" not in line and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(r.split("|")[2].strip() == "4" for r in rows)  # every request completed


def test_bench_serve_interleaved_levels_alternate(server, monkeypatch, capsys):
    """--interleave: every configuration's server is up at once and each level runs them back to back, the order
    reversed on every other level (here both "servers" are the test server, started once)."""
    import contextlib

    from specjax.bench import serve as bench_serve
    started, order = [], []
    real_level = bench_serve.Target.level

    @contextlib.contextmanager
    def launched(name, args):
        started.append(name)
        yield server.url

    def level(self, c):
        order.append((self.name, c))
        return real_level(self, c)

    monkeypatch.setattr(bench_serve, "launched", launched)
    monkeypatch.setattr(bench_serve.Target, "level", level)
    assert bench_serve.main(["--launch", "plain,eagle3", "--interleave", "--model-path", "unused", "--draft",
                             "unused", "--concurrency", "1", "2", "--num-prompts", "2", "--max-tokens", "4",
                             "--prompts", "builtin", "--ignore-eos", "--warmup-requests", "0"]) == 0
    assert started == ["plain", "eagle3"]
    assert order == [("plain", 1), ("eagle3", 1), ("eagle3", 2), ("plain", 2)]
    out = capsys.readouterr().out
    assert "side by side" in out and "eagle3/plain" in out
    assert "eagle3 accept" not in out  # a server that reports no accept length (here plain) gets no such column
    with pytest.raises(SystemExit):  # --interleave without --launch: a usage error, not a silently ignored flag
        bench_serve.main(["--url", server.url, "--interleave"])
    assert "--interleave runs the servers of --launch" in capsys.readouterr().err
    # --rounds: every level again, the order also reversed from round to round; the median and range of the ratios
    order.clear()
    assert bench_serve.main(["--launch", "plain,eagle3", "--interleave", "--model-path", "unused", "--draft",
                             "unused", "--concurrency", "1", "2", "--num-prompts", "2", "--max-tokens", "4",
                             "--prompts", "builtin", "--ignore-eos", "--warmup-requests", "0", "--rounds", "2"]) == 0
    assert order == [("plain", 1), ("eagle3", 1), ("eagle3", 2), ("plain", 2),
                     ("eagle3", 1), ("plain", 1), ("plain", 2), ("eagle3", 2)]
    out = capsys.readouterr().out
    assert "of 2 rounds" in out and re.search(r"\d\.\d\dx \(\d\.\d\d-\d\.\d\d\)", out)


def test_cache_report_only_with_the_flag(client):
    """SGLang's --enable-cache-report: usage.prompt_tokens_details.cached_tokens with it (a repeated prompt's cached
    pages), absent without it."""
    from starlette.testclient import TestClient

    import specjax
    from server_helpers import ENGINE_KW, tiny_model_dir
    from specjax.serve.api import create_app
    msgs = [{"role": "user", "content": "Tell me about the weather in a long sentence, please, in detail."}]
    r = client.chat.completions.create(model=SHARED_NAME, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens_details is None
    with specjax.Engine(model_path=tiny_model_dir(), skip_server_warmup=True, enable_cache_report=True,
                        **ENGINE_KW) as engine, TestClient(create_app(engine.backend)) as http:
        usage = [http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()["usage"]
                 for _ in range(2)]
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= 8  # page-aligned reuse of the same prompt
