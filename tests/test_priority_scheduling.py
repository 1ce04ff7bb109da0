"""SGLang's priority scheduling (``--enable-priority-scheduling``): waiting requests are admitted by priority (larger
values first, or smaller with ``--schedule-low-priority-values-first``; one without a priority last), then in
arrival order; a request that finds no room retracts running ones whose priority is lower by more than the threshold,
which then finish with the tokens they would have given unpreempted (specjax.generate, the independent plain
decoder); without the flag a priority is ignored (or refused with ``--abort-on-priority-when-disabled``), and the
flag with a policy other than fcfs / lof is refused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from server_helpers import ENGINE_KW, tiny_model_dir
from starlette.testclient import TestClient

import specjax
from specjax.serve.api import create_app
from specjax.serve.args import ArgsError, ServerArgs
from specjax.serve.request import RequestError

SP = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
ONE_SLOT = dict(ENGINE_KW, max_running_requests=1, enable_priority_scheduling=True, skip_server_warmup=True)


@pytest.fixture(scope="module")
def oracle():
    from specjax.generate import generate
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(0), dtype="float32")
    return lambda prompts, n: generate(params, cfg, prompts, max_new_tokens=n, stop_token_ids=(), page_size=8)


def _prompts(k):
    rng = np.random.default_rng(11)
    return [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(4, 30, size=k)]


def _run(engine, prompt, sp, priority, done, outs, key):
    """A request in a thread; ``done`` gets ``key`` when it finishes, ``outs[key]`` its output ids."""
    def go():
        outs[key] = engine.generate(input_ids=prompt, sampling_params=sp, priority=priority)["output_ids"]
        done.append(key)
    t = threading.Thread(target=go)
    t.start()
    return t


def _queued(engine, n):
    deadline = time.monotonic() + 60
    while engine.get_server_info()["internal_states"][0]["num_waiting_reqs"] < n:
        assert time.monotonic() < deadline, "requests did not queue"
        time.sleep(0.005)


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_requests_are_admitted_by_priority(oracle, low_first):
    prompts = _prompts(5)
    want = oracle(prompts, SP["max_new_tokens"])
    with specjax.Engine(model_path=tiny_model_dir(0), schedule_low_priority_values_first=low_first,
                        **ONE_SLOT) as engine:
        engine.pause_generation("in_place")  # nothing is admitted while the queue fills
        done, outs = [], {}
        threads = []
        for i, p in enumerate((None, 0, 5, 3, 5)):
            threads.append(_run(engine, prompts[i], SP, p, done, outs, i))
            _queued(engine, i + 1)  # arrival order is submission order
        engine.continue_generation()
        for t in threads:
            t.join(120)
    assert done == ([1, 3, 2, 4, 0] if low_first else [2, 4, 3, 1, 0])  # equal priorities: arrival order
    assert [outs[i] for i in range(5)] == want


def test_a_higher_priority_request_retracts_a_running_one(oracle):
    prompts = _prompts(3)
    long = dict(SP, max_new_tokens=80)
    want_long, want = oracle(prompts[:1], 80)[0], oracle(prompts[1:], SP["max_new_tokens"])
    with specjax.Engine(model_path=tiny_model_dir(0), **ONE_SLOT) as engine:
        stream = engine.generate(input_ids=prompts[0], sampling_params=long, stream=True, priority=0)
        next(stream)
        done, outs = [], {}
        near = _run(engine, prompts[1], SP, 10, done, outs, "near")  # 10 - 0 is not above the threshold (10)
        _queued(engine, 1)
        high = _run(engine, prompts[2], SP, 11, done, outs, "high")
        high.join(120)
        assert done == ["high"]  # it ran while the long one was retracted, and "near" still waits for it
        sched = engine.backend.scheduler
        live = sched.call(lambda: [r for r in list(sched.waiting) + list(sched.slots) if r is not None])
        first = next(r for r in live if r.prompt_ids == prompts[0])
        assert not first.finished and first.resumed > 0  # retracted mid-way, prefilled again over its output
        chunks = list(stream)
        near.join(120)
    assert chunks[-1]["output_ids"] == want_long and outs["high"] == want[1] and outs["near"] == want[0]
    assert done == ["high", "near"]


def test_priority_without_the_flag_and_the_flag_with_fcfs_or_lof():
    with pytest.raises(ArgsError, match="fcfs"):
        ServerArgs.from_kwargs(model_path="x", enable_priority_scheduling=True, schedule_policy="lpm").validate()
    with specjax.Engine(model_path=tiny_model_dir(0), skip_server_warmup=True, **ENGINE_KW) as engine:
        assert len(engine.generate(input_ids=[5, 6, 7], sampling_params=SP, priority=3)["output_ids"]) == 24
    with specjax.Engine(model_path=tiny_model_dir(0), skip_server_warmup=True, abort_on_priority_when_disabled=True,
                        **ENGINE_KW) as engine:
        with pytest.raises(RequestError, match="enable-priority-scheduling") as e:
            engine.generate(input_ids=[5, 6, 7], sampling_params=SP, priority=3)
        assert e.value.param == "priority"
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/generate", json={"input_ids": [5, 6, 7], "priority": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    with specjax.Engine(model_path=tiny_model_dir(0), **ONE_SLOT) as engine:
        with pytest.raises(RequestError, match="integer"):
            engine.generate(input_ids=[5, 6, 7], sampling_params=SP, priority=1.5)
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": 7})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_full_queue_refuses_the_newcomer_or_a_lower_priority_one(oracle):
    """``--max-queued-requests``: with two waiting, a third is refused (HTTP 503, SGLang's message); with priority
    scheduling a higher-priority newcomer displaces the least preferred waiting request instead."""
    prompts = _prompts(4)
    want = oracle(prompts, SP["max_new_tokens"])
    with specjax.Engine(model_path=tiny_model_dir(0), max_queued_requests=2, **ONE_SLOT) as engine:
        engine.pause_generation("in_place")
        done, outs = [], {}
        threads = []
        for i, p in enumerate((5, 1)):
            threads.append(_run(engine, prompts[i], SP, p, done, outs, i))
            _queued(engine, i + 1)
        late = engine.generate(input_ids=prompts[2], sampling_params=SP, priority=1, stream=True)
        last = list(late)[-1]["meta_info"]["finish_reason"]  # not above the lowest waiting: refused
        assert last == {"type": "abort", "message": "The request queue is full.", "status_code": 503}
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/generate", json={"input_ids": prompts[2], "sampling_params": SP})
            assert r.status_code == 503 and r.json()["error"]["message"] == "The request queue is full.", r.text
        threads.append(_run(engine, prompts[3], SP, 9, done, outs, 3))  # displaces the waiting priority-1 one
        deadline = time.monotonic() + 60
        while 1 not in outs:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert outs[1] == [] and done == [1]
        engine.continue_generation()
        for t in threads:
            t.join(120)
    assert done == [1, 3, 0] and outs[3] == want[3] and outs[0] == want[0]
