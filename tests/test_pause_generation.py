"""SGLang's ``pause_generation`` / ``continue_generation`` (Engine methods and HTTP routes): ``in_place`` stops every
request where it is, ``retract`` frees its slot and K/V and prefills it again; both continue it to the same greedy
tokens as an uninterrupted run (specjax.generate, the independent plain decoder), plain and EAGLE3, and a retracted
seeded, penalised sampled request to the same tokens as one never paused; ``abort`` aborts what runs and waits;
requests arriving while paused wait; the cache can be flushed in a retracting pause; a weight update while paused
swaps at once (in place: the request goes on with the new weights; retracted: it is prefilled again with them); an
unknown mode is refused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from server_helpers import ENGINE_KW, random_eagle3_kw, tiny_model_dir
from starlette.testclient import TestClient

import specjax
from specjax.serve.api import create_app
from specjax.serve.request import RequestError
from specjax.serve.scoring import ItemNotScored

LONG = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def oracle():
    from specjax.generate import generate
    from specjax.weights import load_model

    def run(folder, prompts, n):
        cfg, params = load_model(folder, dtype="float32")
        return generate(params, cfg, prompts, max_new_tokens=n, stop_token_ids=(), page_size=8)
    return run


def _prompts():
    rng = np.random.default_rng(9)
    return [rng.integers(3, 300, size=n).tolist() for n in (6, 23)]


def _state(engine):
    s = engine.get_server_info()["internal_states"][0]
    return s["generation_paused"], s["num_running_reqs"], s["num_waiting_reqs"]


def _wait_for(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _in_background(engine, prompts, sp):
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(o=[o["output_ids"] for o in engine.generate(
        input_ids=prompts, sampling_params=sp)]))
    t.start()
    return t, out


def _engine(algorithm, tmp_path):
    kw = dict(ENGINE_KW)
    if algorithm == "EAGLE3":
        kw.update(random_eagle3_kw(tiny_model_dir(0), str(tmp_path / "head")))
    return specjax.Engine(model_path=tiny_model_dir(0), skip_server_warmup=True, **kw)


@pytest.mark.parametrize("algorithm", [None, "EAGLE3"])
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_continues_to_the_same_tokens(oracle, tmp_path, algorithm, mode):
    prompts = _prompts()
    want = oracle(tiny_model_dir(0), prompts, LONG["max_new_tokens"])
    with _engine(algorithm, tmp_path) as engine:
        sched = engine.backend.scheduler
        stream = engine.generate(input_ids=prompts[1], sampling_params=LONG, stream=True)
        next(stream)
        made = sched.call(lambda: len(sched.slots[0].output_ids))
        engine.pause_generation(mode)
        req = next(r for r in sched.call(lambda: list(sched.slots) + list(sched.waiting)) if r is not None)
        made = len(req.output_ids)
        assert 0 < made < LONG["max_new_tokens"]
        if mode == "retract":  # its slot and pages are free; it waits with its output so far
            assert _state(engine) == (True, 0, 1) and req.slot is None and req.resumed == made
            assert engine.get_server_info()["internal_states"][0]["kv_pages_used"] == 0
            _retracted_requests_continue(engine, prompts, want, stream, made)
            return
        assert _state(engine) == (True, 1, 0)
        late, out = _in_background(engine, prompts[:1], LONG)
        _wait_for(lambda: _state(engine)[2] == 1, "the late request to queue")
        time.sleep(0.3)  # nothing moves while paused
        assert sched.call(lambda: len(sched.slots[0].output_ids)) == made and _state(engine) == (True, 1, 1)
        engine.continue_generation()
        chunks = list(stream)
        late.join(120)
        assert chunks[-1]["output_ids"] == want[1] and out["o"] == want[:1]
        assert _state(engine)[0] is False


def test_abort_pause_and_requests_arriving_while_paused(oracle, tmp_path):
    prompts = _prompts()
    want = oracle(tiny_model_dir(0), prompts, LONG["max_new_tokens"])
    with _engine(None, tmp_path) as engine:
        stream = engine.generate(input_ids=prompts[1], sampling_params=LONG, stream=True)
        next(stream)
        engine.pause_generation()  # SGLang's default mode: abort
        last = list(stream)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(last["output_ids"]) < LONG["max_new_tokens"] and _state(engine) == (True, 0, 0)
        late, out = _in_background(engine, prompts[:1], LONG)
        _wait_for(lambda: _state(engine)[2] == 1, "the late request to queue")
        engine.pause_generation("in_place")  # pausing again changes nothing
        engine.continue_generation()
        late.join(120)
        assert out["o"] == want[:1]
        engine.continue_generation()  # continuing when not paused is a no-op
        assert engine.generate(input_ids=prompts[1], sampling_params=LONG)["output_ids"] == want[1]
        with pytest.raises(RequestError, match="pause mode") as e:
            engine.pause_generation("later")
        assert e.value.param == "mode"
        assert _state(engine)[0] is False
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 200 and r.json() == {"message": "Generation paused successfully.", "status": "ok"}
            assert _state(engine)[0] is True
            r = client.post("/continue_generation", json={})
            assert r.status_code == 200 and r.json()["status"] == "ok" and _state(engine)[0] is False
            r = client.post("/pause_generation", json={"mode": "retract-all"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
        # a scoring call whose requests an abort-mode pause ends gets a clear error, not a missing-key crash
        engine.pause_generation("in_place")
        failed: dict = {}

        def score():
            try:
                engine.score(query=prompts[1], items=[[7], [8]], label_token_ids=[3])
            except ItemNotScored as e:
                failed["e"] = e
        t = threading.Thread(target=score)
        t.start()
        _wait_for(lambda: _state(engine)[2] == 1, "the first scoring item to queue")
        engine.pause_generation("abort")
        t.join(120)
        engine.continue_generation()
        assert "was not scored: aborted by pause_generation" in str(failed["e"])


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_weight_update_while_paused_swaps_at_once(oracle, tmp_path, mode):
    """RL's loop: pause, update the weights, continue. The update does not wait for the paused request (in place
    it would wait forever); the request finishes, its tokens before the pause the old weights'; retracted, the
    rest are the new weights' over its prompt and output so far; later requests are the new weights'."""
    a, b = tiny_model_dir(0), tiny_model_dir(1)
    prompts = _prompts()
    n = LONG["max_new_tokens"]
    want_a, want_b = oracle(a, prompts, n), oracle(b, prompts, n)
    with _engine(None, tmp_path) as engine:
        sched = engine.backend.scheduler
        stream = engine.generate(input_ids=prompts[1], sampling_params=LONG, stream=True)
        next(stream)
        engine.pause_generation(mode)
        made = next(list(r.output_ids) for r in sched.call(lambda: list(sched.slots) + list(sched.waiting))
                    if r is not None)
        assert made == want_a[1][:len(made)]
        t0 = time.monotonic()
        assert engine.update_weights_from_disk(b)[0] and time.monotonic() - t0 < 60
        assert _state(engine)[0] is True
        engine.continue_generation()
        last = list(stream)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length" and last["output_ids"][:len(made)] == made
        if mode == "retract":
            assert last["output_ids"][len(made):] == oracle(b, [prompts[1] + made], n - len(made))[0]
        assert engine.generate(input_ids=prompts[0], sampling_params=LONG)["output_ids"] == want_b[0]


def _retracted_requests_continue(engine, prompts, want, stream, made):
    """A retracted request (``made`` tokens out) and one arriving in the pause both finish as never paused; the
    prefix cache may be flushed in a retracting pause (the request is then prefilled from scratch)."""
    sched = engine.backend.scheduler
    late, out = _in_background(engine, prompts[:1], LONG)
    _wait_for(lambda: _state(engine)[2] == 2, "the late request to queue")
    assert engine.flush_cache() and sched.call(lambda: sched.radix.cached_pages()) == 0
    engine.continue_generation()
    chunks = list(stream)
    late.join(120)
    assert chunks[-1]["output_ids"] == want[1] and out["o"] == want[:1]
    assert chunks[-1]["meta_info"]["completion_tokens"] == LONG["max_new_tokens"] > made


def test_retracted_sampled_request_draws_the_same_stream(tmp_path):
    """A seeded, penalised sampled request retracted twice mid-way gives the tokens (and logprobs) it gives
    unpaused: its random stream and penalty counts go on from its saved sampling row."""
    prompts = _prompts()
    sp = {"max_new_tokens": 48, "temperature": 0.9, "top_k": 50, "seed": 1234, "frequency_penalty": 0.7,
          "repetition_penalty": 1.3, "ignore_eos": True}
    with _engine(None, tmp_path) as engine:
        want = engine.generate(input_ids=prompts[1], sampling_params=sp, return_logprob=True)
        stream = engine.generate(input_ids=prompts[1], sampling_params=sp, return_logprob=True, stream=True)
        for _ in range(2):
            next(stream)
            engine.pause_generation("retract")
            assert _state(engine) == (True, 0, 1)
            engine.continue_generation()
        last = list(stream)[-1]
        assert last["output_ids"] == want["output_ids"]
        got, ref = (np.asarray([lp for lp, _, _ in m["meta_info"]["output_token_logprobs"]]) for m in (last, want))
        np.testing.assert_allclose(got, ref, atol=1e-4)
