"""SGLang's release / resume of memory occupation: the weights' and the KV pool's device arrays are really freed,
requests wait meanwhile, and after the resume the server answers as before with the same weights; misuse is a
clear error."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from server_helpers import offline_engine, tiny_model_dir
from starlette.testclient import TestClient

from specjax.serve.api import create_app
from specjax.serve.request import RequestError

SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return offline_engine(tiny_model_dir())


@pytest.fixture(autouse=True)
def resumed(engine):
    """The shared engine is left with its memory back whatever a test did (else later tests would wait)."""
    yield
    if engine.backend.scheduler.memory_released:
        engine.resume_memory_occupation()


def test_release_then_resume_serves_as_before(engine):
    sched = engine.backend.scheduler
    want = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SP)["output_ids"]
    weights = engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 4)
    engine.release_memory_occupation()
    assert engine.get_server_info()["internal_states"][0]["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    params = [x for x in jax.tree.leaves(sched.runner.params) if isinstance(x, jax.Array)]
    assert params and all(x.is_deleted() for x in params) and sched.state is None
    with pytest.raises(RequestError, match="already released"):
        engine.release_memory_occupation(["weights"])
    ok, message = engine.update_weights_from_tensor([])
    assert not ok and "released" in message
    out = {}
    waiting = threading.Thread(target=lambda: out.update(engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SP)))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive()  # a request waits while memory is released
    engine.resume_memory_occupation()
    waiting.join(60)
    assert out["output_ids"] == want
    assert engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 4) == weights
    with pytest.raises(RequestError, match="not released"):
        engine.resume_memory_occupation(["kv_cache"])


def test_release_over_http(engine):
    with TestClient(create_app(engine.backend)) as client:
        r = client.post("/release_memory_occupation", json={"tags": ["gpu_memory"]})
        assert r.status_code == 400 and "unknown memory tag" in r.text
        stream = engine.generate(input_ids=[5, 6, 7], sampling_params={**SP, "max_new_tokens": 250}, stream=True)
        next(stream)
        engine.pause_generation("in_place")  # the request holds its slot for certain
        try:
            r = client.post("/release_memory_occupation", json={})
            assert r.status_code == 400 and "idle" in r.text
        finally:
            engine.continue_generation()
            stream.close()
        engine.generate(input_ids=[1], sampling_params=SP)  # the aborted stream has left its slot
        assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert client.post("/resume_memory_occupation", json={}).status_code == 200  # none: what is released
        assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        got = client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": SP}).json()
        assert got["output_ids"] == engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SP)["output_ids"]


def test_bf16_table_bits_stay_a_view_after_resume():
    """On a CPU a bf16 embedding table's uint16 bits share its memory; after a resume they share the restored
    table's again (a copy would double the table's memory)."""
    from specjax.serve.runners.plain import PlainRunner
    from specjax.weights import load_model
    cfg, params = load_model(tiny_model_dir(), dtype="bfloat16", layout="decode")
    runner = PlainRunner(cfg, params, max_batch=1, pages_per_seq=4, page_size=8, num_pages=8)
    assert runner.params.embed_bits is not None  # a bf16 table on one CPU device (the tests' platform)
    table = np.asarray(runner.params.embed).copy()
    runner.release_weights()
    runner.resume_weights()
    p = runner.params
    assert p.embed_bits.unsafe_buffer_pointer() == p.embed.unsafe_buffer_pointer()
    assert np.array_equal(np.asarray(p.embed), table)
