"""SGLang's admin routes for profiling and weight labels: /start_profile and /stop_profile (a jax.profiler trace of
the server's forward steps, stopped by itself after num_steps or by /stop_profile, written where XProf and Perfetto
read it; misuse is a clear 400), /update_weight_version and /get_weight_version."""

from __future__ import annotations

import glob
import os

import pytest
from server_helpers import offline_engine, tiny_model_dir
from starlette.testclient import TestClient

from specjax.serve.api import create_app
from specjax.serve.request import RequestError

SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return offline_engine(tiny_model_dir())


def traces(folder):
    return (glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb")),
            glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz")))


def test_a_trace_of_num_steps_stops_by_itself(engine, tmp_path):
    profiler = engine.backend.scheduler.profiler
    engine.generate(input_ids=[5, 6, 7], sampling_params=SP)  # compiled before the trace (a traced compile is slow)
    engine.start_profile(output_dir=str(tmp_path), num_steps=3, activities=["CPU", "MEM"])
    with pytest.raises(RequestError, match="already in progress"):
        engine.start_profile(output_dir=str(tmp_path))
    engine.generate(input_ids=[5, 6, 7], sampling_params=SP)
    xplane, perfetto = traces(str(tmp_path))
    assert xplane and perfetto and profiler._running is None  # stopped after its 3 steps, not by a call
    assert glob.glob(os.path.join(str(tmp_path), "memory_profile-*.prof"))
    assert str(tmp_path) in profiler.stop()  # a stop racing the trace's own end reports that trace, once
    with pytest.raises(RequestError, match="not in progress"):
        engine.stop_profile()


def test_profile_over_http(engine, tmp_path):
    with TestClient(create_app(engine.backend)) as client:
        r = client.post("/start_profile", json={"output_dir": str(tmp_path), "start_step": 10**9})
        assert r.status_code == 200 and "armed" in r.text
        assert client.post("/stop_profile").text.startswith("Profiling disarmed")
        r = client.post("/start_profile", json={"activities": ["RPD"]})
        assert r.status_code == 400 and "'RPD'" in r.text
        r = client.post("/start_profile", json={"output_dir": "/proc/specjax-trace", "start_step": 10**9})
        assert r.status_code == 400 and "cannot write a trace" in r.text  # said now, not at the armed step
        r = client.post("/start_profile", json={"profile_by_stage": True})
        assert r.status_code == 400 and "profile_by_stage" in r.text
        assert client.post("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 200
        client.post("/generate", json={"input_ids": [5, 6], "sampling_params": SP})
        r = client.get("/stop_profile")
        assert r.status_code == 200 and str(tmp_path) in r.text and all(traces(str(tmp_path)))
        r = client.post("/stop_profile")
        assert r.status_code == 400 and "not in progress" in r.text


def test_weight_version_labels(engine):
    """SGLang's /update_weight_version relabels the weights /get_model_info and /get_weight_version report."""
    with TestClient(create_app(engine.backend)) as client:
        before = client.get("/get_weight_version").json()["weight_version"]
        try:
            r = client.post("/update_weight_version", json={"new_version": "step-7", "abort_all_requests": False})
            assert r.json() == {"success": True, "message": "Weight version updated to step-7",
                                "new_version": "step-7"}
            assert client.get("/get_model_info").json()["weight_version"] == "step-7"
            assert client.post("/update_weight_version", json={}).status_code == 400  # new_version is required
        finally:
            engine.backend.weight_version = before
