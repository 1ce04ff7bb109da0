"""The offline ``specjax.Engine`` (SGLang's keyword names): outputs equal specjax.generate's (the independent plain
decoder) token for token, through paging, chunked prefill, prefix reuse and continuous batching; streaming; n > 1;
requests that cannot fit are refused clearly."""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np
import pytest
from server_helpers import offline_engine, tiny_model_dir
from starlette.testclient import TestClient

from specjax.serve.api import create_app
from specjax.serve.request import RequestError


@pytest.fixture(scope="module")
def engine():
    return offline_engine(tiny_model_dir())


@pytest.fixture(scope="module")
def oracle():
    """specjax.generate: the on-device while_loop decoder with a contiguous cache (no scheduler, no radix cache)."""
    from specjax.generate import generate
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(), dtype="float32")

    def run(prompts, n, **kw):
        return generate(params, cfg, prompts, max_new_tokens=n, stop_token_ids=(), page_size=8, **kw)
    return run


def test_greedy_equals_plain_decoder(engine, oracle):
    rng = np.random.default_rng(0)
    # lengths around page (8) and chunk (32) boundaries, and one longer than several chunks
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (1, 7, 8, 9, 31, 33, 100, 200)]
    want = oracle(prompts, 12)
    got = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True})
    assert [g["output_ids"] for g in got] == want
    # the same prompts again hit the radix cache: same tokens, reported cached tokens
    again = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True})
    assert [g["output_ids"] for g in again] == want
    assert [g["meta_info"]["cached_tokens"] for g in again] == [(len(p) - 1) // 8 * 8 for p in prompts]


def test_seeded_sampling_equals_plain_decoder(engine, oracle):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    want = oracle(prompts, 10, temperature=0.8, top_k=40, top_p=0.9, seed=[3, 4])
    got = engine.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": 10, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": s, "ignore_eos": True}
        for s in (3, 4)])
    assert [g["output_ids"] for g in got] == want


def test_text_api_stream_and_n(engine):
    sp = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    out = engine.generate("The capital of France is", sp)
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 9
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    # streamed chunks carry the output so far, as SGLang's Engine streams them (and /generate does)
    chunks = list(engine.generate("The capital of France is", sp, stream=True))
    assert chunks[-1]["text"] == out["text"] and chunks[-1]["output_ids"] == out["output_ids"]
    assert all(b["output_ids"][:len(a["output_ids"])] == a["output_ids"] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    assert "index" not in chunks[0]  # one request: no index, as SGLang's
    # SGLang's incremental_streaming_output: the new text and ids only, in the Engine and over /generate
    engine.server_args.incremental_streaming_output = True
    try:
        chunks = list(engine.generate("The capital of France is", sp, stream=True))
        assert "".join(c["text"] for c in chunks) == out["text"]
        assert sum((c["output_ids"] for c in chunks), []) == out["output_ids"]
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/generate", json={"text": "The capital of France is", "sampling_params": sp,
                                               "stream": True})
            events = [json.loads(ln[len("data: "):]) for ln in r.text.splitlines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert sum((e["output_ids"] for e in events), []) == out["output_ids"] and len(events) > 1
    finally:
        engine.server_args.incremental_streaming_output = False
    many = engine.generate(["Hello", "World"], {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "seed": 1})
    assert len(many) == 4 and all(m["meta_info"]["completion_tokens"] <= 5 for m in many)
    # each prompt's two samples are two draws (prompt-major order, as SGLang's), not one answer twice
    assert many[0]["output_ids"] != many[1]["output_ids"] and many[2]["output_ids"] != many[3]["output_ids"]


def test_stopping_a_stream_early_frees_the_request(engine):
    info = lambda: engine.get_server_info()["internal_states"][0]  # noqa: E731
    aborted = info()["aborted"]
    it = engine.generate("Hello", {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}, stream=True)
    next(it)
    it.close()
    # The state is the scheduler's at the end of its last iteration: the request's first token reaches us before
    # the iteration that admitted it ends, so "no request running" alone can be the state from before it arrived.
    # Wait for its abort to be counted (each state counts a finished request with its slot and pages already freed).
    deadline = time.time() + 60  # the abort lands at the scheduler's next iteration: seconds on a loaded CI host
    while (state := info())["aborted"] == aborted and time.time() < deadline:
        time.sleep(0.05)
    assert state["aborted"] == aborted + 1, _scheduler_report(engine, state)
    assert state["num_running_reqs"] == 0 and state["kv_pages_used"] == 0, _scheduler_report(engine, state)


def _scheduler_report(engine, state: dict) -> str:
    """What the scheduler holds and where its thread is: a failure above says why the request was not freed."""
    sch = engine.backend.scheduler
    thread = sch._thread
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    slots = [dict(rid=r.rid[:8], finish_reason=r.finish_reason, prefilled=r.prefilled, prompt=len(r.prompt_ids),
                  output=len(r.output_ids), slot=r.slot) for r in sch.slots if r is not None]
    where = "".join(traceback.format_stack(frame)) if frame is not None else "no scheduler thread"
    return (f"thread alive: {thread is not None and thread.is_alive()}; inbox: {sch._inbox.qsize()}; waiting: "
            f"{len(sch.waiting)}; step in flight: {sch._pending is not None}; slots: {slots}; state: {state}\n"
            f"scheduler thread at:\n{where}")


def test_refusals(engine):
    from specjax.serve.request import RequestError
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=list(range(3, 300)), sampling_params={"max_new_tokens": 4})
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    # an explicit max_new_tokens beyond the context is refused, as over HTTP; the default one is clamped to what fits
    with pytest.raises(RequestError, match="lower max_new_tokens to at most 9"):
        engine.generate(input_ids=list(range(3, 250)), sampling_params={"max_new_tokens": 100})
    out = engine.generate(input_ids=list(range(3, 250)), sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 256 - 247}


@pytest.mark.parametrize("kw, message", [
    (dict(prompt=123), "prompt must be a string or a list of strings"),
    (dict(prompt=["hi", None]), "prompt must be a string, got NoneType"),
    (dict(prompt={"text": "hi"}), "prompt must be a string or a list of strings"),
    (dict(prompt=[]), "empty batch"),
    (dict(prompt="\ud800"), "lone surrogate"),
    (dict(input_ids=[1.7, 2.9]), "input_ids must be a list of integer token ids"),
    (dict(input_ids="hello"), "input_ids must be a list of integer token ids"),
    (dict(input_ids=[[1, 2], 3]), "input_ids must be a list of integer token ids"),
    (dict(input_ids=[True, False]), "input_ids must be a list of integer token ids"),
    (dict(prompt="x", sampling_params="greedy"), "sampling_params must be a dict"),
    (dict(prompt="x", sampling_params={"n": 2.5}), "n must be an integer"),
    (dict(prompt="x", sampling_params={"seed": "7"}), "seed must be an integer"),
    (dict(prompt="x", sampling_params={"max_new_tokens": 2.7}), "max_new_tokens must be an integer"),
    (dict(prompt="x", sampling_params={"ignore_eos": "false"}), "ignore_eos must be true or false"),
    (dict(prompt="x", sampling_params={"temperature": 1e39}), "temperature must be a finite number"),
    (dict(prompt="x", sampling_params={"top_logprobs_num": "3", "return_logprob": True}),
     "top_logprobs_num must be an integer"),
    (dict(prompt="x", sampling_params={"stop": {"x": 1}}), "stop must be a non-empty string or a list"),
    (dict(prompt="x", sampling_params={"stop_token_ids": [2 ** 40]}), "stop_token_ids must be a list of token ids"),
    (dict(prompt="x", sampling_params={"logit_bias": [1, 2]}), "logit_bias must map token ids to numbers"),
    (dict(prompt="x", sampling_params={"logit_bias": {"-1": 1}}), r"outside \[0, vocab size\)"),
    (dict(prompt="x", sampling_params={"logit_bias": {" 5": 1}}), "logit_bias keys must be token ids"),
    (dict(prompt="x", sampling_params={"logit_bias": {"1_0": 1}}), "logit_bias keys must be token ids"),
    (dict(input_ids=[5], sampling_params={"return_logprob": True, "logprob_start_len": 5}),
     "must be smaller than the prompt's 1 tokens"),
])
def test_bad_inputs_are_clear_errors(engine, kw, message):
    """Wrong types and values from Python are RequestErrors naming the parameter (none hangs, is coerced
    silently or fails inside the scheduler); the engine serves on afterwards."""
    from specjax.serve.request import RequestError
    with pytest.raises(RequestError, match=message):
        engine.generate(**kw)
    assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]


def test_sglang_generate_arguments_and_async_generate(engine):
    """SGLang's request-level logprob arguments (a value or one per prompt) give what the same fields inside
    sampling_params give; its arguments for features specjax lacks are refused unless they ask for nothing;
    ``async_generate`` (plain and streamed) returns what ``generate`` does; get_server_info is /get_server_info's."""
    import asyncio
    from specjax.serve.request import RequestError
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    inside = engine.generate("Hello", dict(sp, return_logprob=True, top_logprobs_num=2))
    outside = engine.generate("Hello", sp, return_logprob=True, top_logprobs_num=2)
    assert outside["meta_info"]["output_token_logprobs"] == inside["meta_info"]["output_token_logprobs"]
    assert len(outside["meta_info"]["output_top_logprobs"][0]) == 2
    two = engine.generate(["Hello", "World"], sp, return_logprob=[True, False])
    assert "output_token_logprobs" in two[0]["meta_info"] and "output_token_logprobs" not in two[1]["meta_info"]
    with pytest.raises(RequestError, match="2 values of top_logprobs_num for 1 prompts"):
        engine.generate("Hello", sp, return_logprob=True, top_logprobs_num=[1, 2])
    assert engine.generate("Hello", sp, lora_path=None, image_data=None)["output_ids"] == outside["output_ids"]
    with pytest.raises(RequestError, match="lora_path='a' is not supported"):
        engine.generate("Hello", sp, lora_path="a")
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        engine.generate("Hello", sp, temprature=0)

    async def run():
        out = await engine.async_generate("Hello", sp)
        chunks = [c async for c in await engine.async_generate("Hello", sp, stream=True)]
        return out, chunks
    out, chunks = asyncio.run(run())
    assert out["output_ids"] == outside["output_ids"] and out["text"] == outside["text"]
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["finished"]
    info = engine.get_server_info()
    assert {"version", "internal_states", "startup_seconds"} <= set(info) and info["context_length"] == 256
    assert info["max_total_num_tokens"] > 0 and info["max_req_input_len"] == min(255, info["max_total_num_tokens"] - 1)
    # SGLang's rid (meta_info.id), one per prompt or one for the batch; its neutral extra sampling parameters;
    # max_new_tokens None = up to the context, as /generate reads it
    assert engine.generate("Hello", sp, rid="mine")["meta_info"]["id"] == "mine"
    ids = [o["meta_info"]["id"] for o in engine.generate(["Hello", "World"], dict(sp, n=2), rid="b")]
    assert ids == ["b-0-0", "b-0-1", "b-1-0", "b-1-1"]
    with pytest.raises(RequestError, match="repeats in the batch"):
        engine.generate(["Hello", "World"], sp, rid=["x", "x"])
    neutral = dict(sp, json_schema=None, regex=None, spaces_between_special_tokens=True)
    assert engine.generate("Hello", neutral)["output_ids"] == outside["output_ids"]
    with pytest.raises(RequestError, match="regex='a' is not supported"):
        engine.generate("Hello", dict(sp, regex="a"))
    long = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": None, "ignore_eos": True})
    assert long["meta_info"]["completion_tokens"] == 256 - 2


def test_small_pool_refuses_what_cannot_fit():
    import specjax
    from specjax.serve.request import RequestError
    eng = specjax.Engine(model_path=tiny_model_dir(), dtype="float32", context_length=256, max_total_tokens=64,
                         page_size=8, skip_server_warmup=True)
    try:
        with pytest.raises(RequestError, match="KV pool holds 8"):
            eng.generate(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 64})
    finally:
        eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):  # at once (flush_cache waited 30 s for the stopped loop)
        eng.flush_cache()


def test_tp_dp_mesh_gives_the_same_tokens(engine):
    """--tp-size 2 --dp-size 2 on four of the test's fake CPU devices: weights and KV heads split over tp, the
    running batch over dp; greedy tokens equal the single-device engine's."""
    import specjax
    from server_helpers import ENGINE_KW
    prompts = ["Hello world", "The capital of France is Paris. The capital of Italy is"]
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(prompts, sp)]
    eng = specjax.Engine(model_path=tiny_model_dir(), skip_server_warmup=True, tp_size=2, dp_size=2, **ENGINE_KW)
    try:
        assert [o["output_ids"] for o in eng.generate(prompts, sp)] == want
        assert eng.backend.scheduler.runner.mesh.shape == {"dp": 2, "tp": 2}
    finally:
        eng.shutdown()


def test_prefill_only_request(engine):
    """SGLang's max_new_tokens 0 through the Engine: the prompt's logprobs, no output, finish reason length."""
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == "" and out["meta_info"]["finish_reason"]["type"] == "length"
    lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in lps] == [5, 6, 7, 8] and lps[0][0] is None and all(x < 0 for x, _, _ in lps[1:])


def test_score_and_async_score(engine):
    """SGLang's ``Engine.score``: the labels' next-token probabilities after query + item, as a full causal
    forward without a cache gives them (items sharing the query's prefix, item_first), ``apply_softmax`` over the
    labels; ``async_score`` answers the same; bad arguments are clear errors."""
    import asyncio

    import jax.numpy as jnp

    from specjax.models import target
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(), dtype="float32")
    query, items, labels = list(range(3, 40)), [[50, 51], [52], [53, 54, 55]], [4, 9, 100, 4]

    def ref(ids):
        x = target.forward(params, cfg, jnp.asarray([ids]), jnp.arange(len(ids))[None]).logits[0, -1]
        return np.exp(np.asarray(x, np.float64)[labels] - np.log(np.exp(np.asarray(x, np.float64)).sum()))

    sched = engine.backend.scheduler
    cached = sched.stats()["cached_tokens"]
    got = engine.score(query=query, items=items, label_token_ids=labels)
    np.testing.assert_allclose(got, [ref(query + x) for x in items], rtol=1e-4, atol=1e-8)
    # the first item went alone; the others found the query's 4 full pages cached (``scoring.waves``)
    assert sched.call(lambda: sched.totals["cached_tokens"]) - cached >= 2 * 32
    first = engine.score(query=query, items=items, label_token_ids=labels, apply_softmax=True, item_first=True)
    want = [ref(x + query) for x in items]
    np.testing.assert_allclose(first, [w / w.sum() for w in want], rtol=1e-4)
    np.testing.assert_allclose(asyncio.run(engine.async_score(query=query, items=items, label_token_ids=labels)),
                               got, rtol=1e-6)
    with pytest.raises(RequestError, match="label token id"):
        engine.score(query=query, items=items, label_token_ids=[10 ** 7])
    with pytest.raises(RequestError, match="items"):
        engine.score(query="text", items=items, label_token_ids=labels)
    # SGLang's request-level logprob fields may sit in sampling_params, token_ids_logprob too
    out = engine.generate(input_ids=query, sampling_params={"max_new_tokens": 1, "token_ids_logprob": [5]},
                          return_logprob=True)
    assert [t for _, t, _ in out["meta_info"]["output_token_ids_logprobs"][0]] == [5]
    with pytest.raises(RequestError, match="return_logprob") as e:
        engine.generate(input_ids=query, sampling_params={"max_new_tokens": 1}, token_ids_logprob=[5])
    assert e.value.param == "token_ids_logprob"


def test_prompt_logprobs_scored_in_chunks_against_the_pool(engine):
    """Prompt logprobs are scored chunk by chunk (the engine's 32-token prefill chunks) against the K/V the
    prefill left in the pool, a reused radix prefix included: the same values as one full causal forward without
    a cache (1e-4), and no more compiled scoring programs than prefill buckets, whatever the prompt lengths."""
    import jax
    from specjax import prompt_logprobs
    from specjax.models import target
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(), dtype="float32")
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 300, size=150).tolist()
    programs = prompt_logprobs._score_chunk._cache_size()  # other tests of this process may have compiled some

    def reference(ids):
        out = target.forward(params, cfg, np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32)[None])
        return np.asarray(jax.nn.log_softmax(out.logits[0].astype(np.float32), axis=-1))

    ref = reference(prompt)
    for start, ids in ((0, prompt), (100, prompt[:120] + rng.integers(3, 300, size=30).tolist())):
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        meta = out["meta_info"]
        lps = meta["input_token_logprobs"]
        assert [t for _, t, _ in lps] == ids[start:] and lps[0][0] is None
        want = ref if ids is prompt else reference(ids)
        np.testing.assert_allclose([x for x, _, _ in lps[1:]], [want[i - 1, ids[i]] for i in range(start + 1, 150)],
                                   atol=1e-4)
        top = meta["input_top_logprobs"][1:]
        np.testing.assert_allclose([[x for x, _, _ in e] for e in top],
                                   -np.sort(-want[start:149], axis=-1)[:, :3], atol=1e-4)
    assert meta["cached_tokens"] >= 112  # the second prompt reused the first one's pages
    for n in (20, 45, 77, 133, 200):
        engine.generate(input_ids=rng.integers(3, 300, size=n).tolist(), sampling_params={"max_new_tokens": 0},
                        return_logprob=True, logprob_start_len=0)
    assert prompt_logprobs._score_chunk._cache_size() - programs <= len(engine.backend.scheduler.runner.prefill_buckets)


def test_a_seeded_request_waiting_for_its_prompt_scores_draws_its_own_stream(engine):
    """While a request's prompt is scored (several rounds at 32-token chunks) its slot sits out of the decode steps
    of the others; those steps must not advance its random key, or its seeded output would depend on them."""
    import threading
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 300, size=100).tolist()
    sp = {"max_new_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    alone = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    # the long request in slot 1 (the short one frees slot 0 at once), so the scored one takes slot 0, inside the
    # rows every decode step of the other computes; its stream's chunks time its steps
    chunks, started = [], threading.Event()

    def busy():
        for c in engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], stream=True, sampling_params=[
                {"max_new_tokens": 1, "temperature": 0},
                {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}]):
            chunks.append(time.perf_counter())
            if len(chunks) > 3:
                started.set()
    thread = threading.Thread(target=busy)
    thread.start()
    assert started.wait(60)
    t0 = time.perf_counter()
    got = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    t1 = time.perf_counter()
    thread.join()
    # the other request stepped all through this one's prefill and scoring rounds (8 at 32 tokens a round)
    assert sum(t0 < t < t1 for t in chunks) >= 12 or chunks[-1] > t1, "the other request did not run alongside"
    assert got["output_ids"] == alone


def test_stream_interval(oracle):
    """SGLang's --stream-interval: the first token at once, then chunks of at least that many tokens; the same
    output as streaming every token."""
    from server_helpers import ENGINE_KW

    import specjax
    prompt, sp = [5, 6, 7, 8, 9], {"max_new_tokens": 17, "temperature": 0, "ignore_eos": True}
    with specjax.Engine(model_path=tiny_model_dir(), skip_server_warmup=True, stream_interval=4,
                        incremental_streaming_output=True, **ENGINE_KW) as engine:
        chunks = [c["output_ids"] for c in engine.generate(input_ids=prompt, sampling_params=sp, stream=True)]
    assert [len(c) for c in chunks] == [1, 4, 4, 4, 4] and sum(chunks, []) == oracle([prompt], 17)[0]


def test_log_requests(caplog):
    """SGLang's --log-requests: a line per finished request, its metadata, parameters and text by level."""
    import logging

    from server_helpers import ENGINE_KW

    import specjax
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    for level, has, lacks in ((0, "completion_tokens=3", "sampling_params"), (2, "output=", "prompt_ids")):
        with specjax.Engine(model_path=tiny_model_dir(), skip_server_warmup=True, log_requests=True,
                            log_requests_level=level, **ENGINE_KW) as engine:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="specjax.serve"):
                engine.generate("Hello there", sp, rid="logged")
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finish:")]
        assert len(lines) == 1 and "id='logged'" in lines[0] and has in lines[0] and lacks not in lines[0]


def test_revision_and_download_dir_reach_the_hub(monkeypatch):
    """SGLang's --revision and --download-dir: a hub id is fetched at that revision into that folder (the hub
    stands in with a local folder here), model and tokenizer alike."""
    import huggingface_hub
    from server_helpers import ENGINE_KW

    import specjax
    calls = []

    def fake_snapshot(repo, **kw):
        calls.append((repo, kw["revision"], kw["cache_dir"]))
        return tiny_model_dir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with specjax.Engine(model_path="someone/tiny", tokenizer_path="someone/tok", revision="v2", download_dir="/d",
                        skip_server_warmup=True, **ENGINE_KW) as engine:
        assert len(engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2
    assert ("someone/tiny", "v2", "/d") in calls and ("someone/tok", "v2", "/d") in calls


def test_dummy_load_format(tmp_path):
    """SGLang's --load-format dummy: random weights of the folder's config.json (no safetensors needed), the same
    ones for the same --random-seed; without it a folder without weights is refused by name."""
    import shutil

    from server_helpers import ENGINE_KW

    import specjax
    folder = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir(), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = []
    for _ in range(2):
        with specjax.Engine(model_path=str(folder), load_format="dummy", random_seed=3, skip_server_warmup=True,
                            **ENGINE_KW) as engine:
            outs.append(engine.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"])
    assert len(outs[0]) == 6 and outs[0] == outs[1]
    with pytest.raises(Exception, match="safetensors"):
        specjax.Engine(model_path=str(folder), skip_server_warmup=True, **ENGINE_KW)
