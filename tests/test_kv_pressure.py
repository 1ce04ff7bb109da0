"""KV pages handed out as requests grow (SGLang's admission by expected output, ``serve/budget.py``): a pool that holds
one request's whole budget at a time runs several at once, and when it runs dry the scheduler retracts requests
(back to the queue, prefilled again over prompt and output later), which then finish with the tokens they give
unpressured: the greedy tokens of specjax.generate (the independent plain decoder), plain and EAGLE3, and for a
seeded sampled request the tokens it gives alone."""

from __future__ import annotations

import time

import numpy as np
import pytest
from server_helpers import ENGINE_KW, random_eagle3_kw, tiny_model_dir

import specjax

N = 60
GREEDY = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
SMALL_POOL = dict(ENGINE_KW, max_total_tokens=144)  # 18 pages of 8 tokens; one request's budget takes 9-12


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 300, size=n).tolist() for n in (6, 23, 14, 9)]


def _engine(algorithm, tmp_path):
    kw = dict(SMALL_POOL)
    if algorithm == "EAGLE3":
        kw.update(random_eagle3_kw(tiny_model_dir(0), str(tmp_path / "head"), topk=1))
    return specjax.Engine(model_path=tiny_model_dir(0), skip_server_warmup=True, **kw)


def _state(engine):
    return engine.get_server_info()["internal_states"][0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with _engine(None, tmp_path_factory.mktemp("plain")) as engine:
        yield engine


def _greedy_together(engine):
    """The prompts' greedy outputs run at once, how many ran at once at most, and the retractions they caused."""
    sched = engine.backend.scheduler
    peak, launch, before = [], sched.runner.launch, _state(engine)["retracted"]
    sched.runner.launch = lambda state, active, **kw: (peak.append(int(np.sum(active))), launch(state, active, **kw))[1]
    try:
        out = engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
    finally:
        sched.runner.launch = launch
    deadline = time.monotonic() + 30
    while (st := _state(engine))["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the stats are the loop's at the end of an iteration: the last event may come first
    assert st["kv_pages_used"] == 0
    return [o["output_ids"] for o in out], max(peak), st["retracted"] - before


@pytest.fixture(scope="module")
def want():
    from specjax.generate import generate
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(0), dtype="float32")
    return generate(params, cfg, _prompts(), max_new_tokens=N, stop_token_ids=(), page_size=8)


def test_a_small_pool_runs_requests_together_and_retracts_to_the_same_tokens(plain, want):
    got, peak, retracted = _greedy_together(plain)
    assert got == want
    assert peak >= 2 and retracted >= 1  # together (not one at a time), and the pool ran dry


def test_the_same_under_eagle3(tmp_path, want):
    with _engine("EAGLE3", tmp_path) as engine:
        got, peak, retracted = _greedy_together(engine)
    assert got == want and peak >= 2 and retracted >= 1


def test_a_retracted_sampled_request_draws_what_it_draws_alone(plain):
    prompts = _prompts()
    sps = [{"max_new_tokens": N, "temperature": 0.9, "top_k": 40, "seed": 100 + i, "frequency_penalty": 0.5,
            "ignore_eos": True} for i in range(len(prompts))]
    before = _state(plain)["retracted"]
    alone = [plain.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in zip(prompts, sps)]
    assert _state(plain)["retracted"] == before
    sched = plain.backend.scheduler
    retract, made = sched._retract, []
    sched._retract = lambda req: (made.append(len(req.output_ids) if req.decoding else 0), retract(req))[1]
    try:
        together = plain.generate(input_ids=prompts, sampling_params=sps)
    finally:
        del sched._retract
    assert max(made, default=0) > 0  # a request retracted mid-output went on from its saved sampling row
    assert [o["output_ids"] for o in together] == alone
