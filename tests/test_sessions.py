"""SGLang's sessions: a request continuing an earlier one of its session is served exactly as a plain request over
the prompt SGLang builds (the earlier prompt and output, cut at ``offset`` or without the output, then the new ids),
reusing the cached prefix; ``replace`` drops a branch; misuse is a clear 400."""

from __future__ import annotations

import numpy as np
import pytest
from server_helpers import offline_engine, tiny_model_dir
from starlette.testclient import TestClient

from specjax.serve.api import create_app
from specjax.serve.request import Request, RequestError, SamplingParams
from specjax.serve.sessions import Session, SessionParams

SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return offline_engine(tiny_model_dir())


def plain(engine, ids):
    return engine.generate(input_ids=ids, sampling_params=SP)["output_ids"]


def check(out, engine, prompt):
    """``out`` is what a plain request over ``prompt`` gives, and was served over that prompt."""
    assert out["meta_info"]["prompt_tokens"] == len(prompt)
    assert out["output_ids"] == plain(engine, prompt)


def test_session_requests_continue_their_parents(engine):
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, 300, size=n).tolist() for n in (21, 9, 5))
    sid = engine.open_session(1000)
    assert engine.open_session(1000, session_id=sid) is None  # an open id is not opened twice
    first = engine.generate(input_ids=a, sampling_params=SP, rid="t1", session_params={"id": sid})
    assert first["output_ids"] == plain(engine, a)
    turn = a + first["output_ids"]
    second = engine.generate(input_ids=b, sampling_params=SP, rid="t2", session_params={"id": sid, "rid": "t1"})
    assert second["output_ids"] == plain(engine, turn + b)
    assert second["meta_info"]["prompt_tokens"] == len(turn + b) and second["meta_info"]["cached_tokens"] >= 16
    for extra, prompt in (({"offset": 3}, turn[:3] + c), ({"drop_previous_output": True}, a + c)):
        check(engine.generate(input_ids=c, sampling_params=SP, session_params={"id": sid, "rid": "t1", **extra}),
              engine, prompt)
    # a replace refused by a later check changes nothing in the session
    with pytest.raises(RequestError, match="lower max_new_tokens"):
        engine.generate(input_ids=c, sampling_params={**SP, "max_new_tokens": 10**4},
                        session_params={"id": sid, "rid": "t1", "replace": True})
    check(engine.generate(input_ids=c, sampling_params=SP, session_params={"id": sid, "rid": "t2"}), engine,
          turn + b + second["output_ids"] + c)
    # replace: t1's continuations (t2 among them) leave the session; t1 itself can be continued again
    check(engine.generate(input_ids=c, sampling_params=SP, rid="t3",
                          session_params={"id": sid, "rid": "t1", "replace": True}), engine, turn + c)
    with pytest.raises(RequestError, match="holds no request 't2'"):
        engine.generate(input_ids=c, sampling_params=SP, session_params={"id": sid, "rid": "t2"})
    # replace without a rid: the whole session goes; a new first request starts it again
    check(engine.generate(input_ids=b, sampling_params=SP, rid="t4", session_params={"id": sid, "replace": True}),
          engine, b)
    for gone in ("t1", "t3"):
        with pytest.raises(RequestError, match=f"holds no request '{gone}'"):
            engine.generate(input_ids=c, sampling_params=SP, session_params={"id": sid, "rid": gone})
    engine.close_session(sid)
    with pytest.raises(RequestError, match="no session"):
        engine.generate(input_ids=c, sampling_params=SP, session_params={"id": sid, "rid": "t1"})
    with pytest.raises(RequestError, match="no session"):
        engine.close_session(sid)


def test_a_running_request_is_continued_only_by_a_replace(engine):
    """Appending to a running request is refused; replacing it aborts it and continues what it had emitted."""
    sid = engine.open_session(10)
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params={**SP, "max_new_tokens": 250}, rid="long",
                             session_params={"id": sid}, stream=True)
    next(stream)
    with pytest.raises(RequestError, match="has not finished"):
        engine.generate(input_ids=[8], sampling_params=SP, session_params={"id": sid, "rid": "long"})
    out = engine.generate(input_ids=[8], sampling_params=SP, session_params={"id": sid, "rid": "long",
                                                                            "replace": True})
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 250
    assert 4 < out["meta_info"]["prompt_tokens"] <= 3 + len(last["output_ids"]) + 1
    engine.close_session(sid)


def test_sessions_over_http(engine):
    with TestClient(create_app(engine.backend)) as client:
        sid = client.post("/open_session", json={"capacity_of_str_len": 100}).json()
        assert isinstance(sid, str)
        r = client.post("/open_session", json={"capacity_of_str_len": 100, "session_id": sid})
        assert r.status_code == 400 and "same id" in r.text
        one = client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": SP, "rid": "h1",
                                             "session_params": {"id": sid}}).json()
        two = client.post("/generate", json={"input_ids": [9, 10], "sampling_params": SP,
                                             "session_params": {"id": sid, "rid": "h1"}}).json()
        check(two, engine, [5, 6, 7, 8] + one["output_ids"] + [9, 10])
        r = client.post("/generate", json={"input_ids": [9], "session_params": {"id": sid, "rid": 3}})
        assert r.status_code == 400 and "session_params.rid" in r.text
        assert client.post("/close_session", json={"session_id": sid}).status_code == 200
        r = client.post("/generate", json={"input_ids": [9], "session_params": {"id": sid, "rid": "h1"}})
        assert r.status_code == 400 and "no session" in r.text


def test_bos_trimmed_only_where_given():
    """An appended prompt loses its first id when it is the BOS the tokenizer puts before every text."""
    s = Session("s", 10)
    parent = Request(rid="p", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2), sink=None)
    parent.output_ids, parent.finish_reason = [4, 5], {"type": "length"}
    s.recorder(SessionParams.of({"id": "s"}), None, abort=None)(parent)
    sp = SessionParams.of({"id": "s", "rid": "p"})
    assert s.prompt(sp, [1, 9], bos=1)[0] == [1, 2, 3, 4, 5, 9]
    assert s.prompt(sp, [1, 9], bos=None)[0] == [1, 2, 3, 4, 5, 1, 9]
    with pytest.raises(RequestError, match="unknown field"):
        SessionParams.of({"id": "s", "ridd": "p"})


def test_a_reused_rid_names_the_latest_request():
    """Dropping a branch forgets only nodes still named by their rid: a later request that reused the rid stays."""
    s = Session("s", 10)

    def req(rid, prompt):
        r = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=1), sink=None)
        r.output_ids, r.finish_reason = [0], {"type": "length"}
        return r
    s.recorder(SessionParams.of({"id": "s"}), None, abort=None)(req("a", [1]))
    sp = SessionParams.of({"id": "s", "rid": "a"})
    s.recorder(sp, s.nodes["a"], abort=None)(req("x", [2]))
    s.recorder(SessionParams.of({"id": "s"}), None, abort=None)(req("x", [3]))  # a new root reusing the rid
    s.recorder(SessionParams.of({"id": "s", "rid": "a", "replace": True}), s.nodes["a"], abort=None)(req("y", [4]))
    assert s.nodes["x"].req.prompt_ids == [3] and set(s.nodes) == {"a", "x", "y"}
