"""SGLang-native endpoints of a live server (tiny random Llama, CPU): /generate with text, input_ids, batches and
streaming; equality with the offline Engine; 32 concurrent streams; prefix reuse; abort; info endpoints."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from server_helpers import SHARED_NAME, model_dir, offline_engine, server, sse_events  # noqa: F401 (fixtures)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def gen(server, **body):
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **body):
    with httpx.stream("POST", server.url + "/generate", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_text_and_input_ids(server, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = gen(server, text="The capital of France is", sampling_params=dict(GREEDY, max_new_tokens=12))
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    ids = tok("The capital of France is")["input_ids"]
    assert meta["prompt_tokens"] == len(ids)
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}
    again = gen(server, input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=12))
    assert again["output_ids"] == out["output_ids"]
    assert again["text"] == out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_batch_matches_singles(server):
    texts = ["Hello world", "The quick brown fox", "def add(a, b):"]
    sp = [dict(GREEDY, max_new_tokens=n) for n in (5, 9, 3)]
    outs = gen(server, text=texts, sampling_params=sp)
    assert isinstance(outs, list) and len(outs) == 3
    for t, s, o in zip(texts, sp, outs):
        assert o["output_ids"] == gen(server, text=t, sampling_params=s)["output_ids"]
        assert len(o["output_ids"]) == s["max_new_tokens"]
    ids_batch = gen(server, input_ids=[[5, 6, 7], [8, 9]], sampling_params=dict(GREEDY, max_new_tokens=4))
    assert [len(o["output_ids"]) for o in ids_batch] == [4, 4]


def test_stream_is_cumulative_and_matches(server):
    body = dict(text="Speculative decoding drafts", sampling_params=dict(GREEDY, max_new_tokens=10))
    events = stream(server, **body)
    full = gen(server, **body)
    assert events[-1]["output_ids"] == full["output_ids"] and events[-1]["text"] == full["text"]
    for a, b in zip(events, events[1:]):  # SGLang's native stream carries the text so far
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_sampled_output_equals_offline_engine(server, model_dir):
    eng = offline_engine(model_dir)
    cases = [("The quick brown fox", {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "max_new_tokens": 16}),
             ("Hello there", {"temperature": 0.7, "top_k": 20, "seed": 7, "max_new_tokens": 12, "ignore_eos": True}),
             ("Hello there", dict(GREEDY, max_new_tokens=12))]
    for text, sp in cases:
        http = gen(server, text=text, sampling_params=sp)
        off = eng.generate(text, sp)
        assert http["output_ids"] == off["output_ids"], (text, sp)
        assert http["text"] == off["text"]
    # different seeds give different samples (the seed is really used)
    a = gen(server, text="Hello", sampling_params={"temperature": 1.0, "seed": 1, "max_new_tokens": 16,
                                                   "ignore_eos": True})
    b = gen(server, text="Hello", sampling_params={"temperature": 1.0, "seed": 2, "max_new_tokens": 16,
                                                   "ignore_eos": True})
    assert a["output_ids"] != b["output_ids"]


def test_32_concurrent_streams(server):
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world paris rome".split()
    jobs = [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))), rng.randint(2, 40)) for _ in range(32)]

    async def one(client, text, n):
        body = {"text": text, "sampling_params": dict(GREEDY, max_new_tokens=n), "stream": True}
        async with client.stream("POST", server.url + "/generate", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        return sse_events(lines)

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, t, n) for t, n in jobs))

    results = asyncio.run(run_all())
    for (text, n), events in zip(jobs, results):
        final = events[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert len(final["output_ids"]) == n  # no token lost or duplicated
        seen = []
        for ev in events:  # each event extends the previous one exactly
            assert ev["output_ids"][:len(seen)] == seen
            seen = ev["output_ids"]
        one_by_one = gen(server, text=text, sampling_params=dict(GREEDY, max_new_tokens=n))
        assert one_by_one["output_ids"] == final["output_ids"], text


def test_prefix_reuse(server):
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    prompt = ("The capital of France is Paris. The capital of Italy is Rome. " * 3).strip()
    sp = dict(GREEDY, max_new_tokens=10)
    first = gen(server, text=prompt, sampling_params=sp)
    assert first["meta_info"]["cached_tokens"] == 0
    second = gen(server, text=prompt, sampling_params=sp)
    n = second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] == (n - 1) // 8 * 8 > 0  # page-aligned, at least one token computed
    assert second["output_ids"] == first["output_ids"]
    # a different continuation of the same prefix reuses the shared pages only
    third = gen(server, text=prompt + " And Berlin", sampling_params=sp)
    assert 0 < third["meta_info"]["cached_tokens"] <= n
    info = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
    assert info["kv_pages_cached"] > 0 and info["cached_tokens"] > 0


def test_n_and_stop(server):
    outs = gen(server, text="Hello", sampling_params={"temperature": 1.0, "seed": 3, "n": 3, "max_new_tokens": 8,
                                                      "ignore_eos": True})
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1
    base = gen(server, text="Hello world", sampling_params=dict(GREEDY, max_new_tokens=6))
    stop_id = base["output_ids"][3]
    out = gen(server, text="Hello world", sampling_params=dict(GREEDY, max_new_tokens=6, stop_token_ids=[stop_id]))
    k = base["output_ids"].index(stop_id)
    assert out["output_ids"] == base["output_ids"][:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_abort_request(server):
    body = {"text": "Hello", "rid": "abort-me", "stream": True,
            "sampling_params": dict(GREEDY, max_new_tokens=200)}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    assert httpx.post(server.url + "/abort_request", json={"rid": "abort-me"}).status_code == 200
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-1]["output_ids"]) < 200
    assert httpx.post(server.url + "/abort_request", json={"abort_all": True}).status_code == 200
    assert httpx.post(server.url + "/abort_request", json={}).status_code == 400


def test_info_endpoints(server, model_dir):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info == {"model_path": model_dir, "tokenizer_path": model_dir, "is_generation": True,
                    "weight_version": "default"}
    si = httpx.get(server.url + "/get_server_info").json()
    assert si["page_size"] == 8 and si["context_length"] == 256 and "version" in si and "api_key" not in si
    assert {"num_running_reqs", "kv_usage", "gen_throughput"} <= set(si["internal_states"][0])
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == SHARED_NAME and models["data"][0]["root"] == model_dir
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200
    for name in ("specjax:num_requests_total", "specjax:generation_tokens_total", "specjax:num_queue_reqs",
                 "specjax:token_usage", "specjax:gen_throughput", "specjax:time_to_first_token_seconds"):
        assert name in m.text, name
