"""The server with EAGLE3 / EAGLE speculative decoding (SpecRunner behind the same scheduler and HTTP front): greedy
output equals the plain server's token for token (prompts across page and chunk boundaries, prefix reuse, concurrent
requests, stops inside a multi-token step), penalised requests and their logprobs equal the plain server's, and
meta_info carries spec_verify_ct, spec_accept_length and the accepted / proposed draft counts.

The target is a "bigram" model whose next token is usually a fixed permutation of the current one, with heads built
in closed form to predict it (tests/spec_models.py), so several tokens are accepted per step; a random EAGLE3 head
covers the low-acceptance case. Servers run in-process (uvicorn in a thread) with the heads passed in memory."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from spec_models import bigram_models, tiny_config
from server_helpers import ENGINE_KW, free_port, idle_state, tiny_model_dir

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SPEC = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)


class InProcessServer:
    def __init__(self, model, draft=None, algorithm=None, **spec):
        import uvicorn

        from specjax.serve.api import create_app
        from specjax.serve.args import ServerArgs
        from specjax.serve.launch import build
        kw = dict(ENGINE_KW, max_running_requests=4)
        if algorithm:
            kw.update(SPEC, speculative_algorithm=algorithm, speculative_draft_model_path="(in memory)", **spec)
        args = ServerArgs(model_path=tiny_model_dir(), skip_server_warmup=True, log_level="warning", **kw).validate()
        self.backend = build(args, model=model, draft=draft)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.backend), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)

    def generate(self, **body):
        r = httpx.post(self.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.backend.shutdown()


@pytest.fixture(scope="module")
def models():
    import jax
    from specjax.models import eagle3
    cfg = tiny_config()  # vocab 64 (the tiny tokenizer decodes these ids; prompts are sent as input_ids)
    tp, perm, e3, e1 = bigram_models(cfg, seed=0)
    rcfg = eagle3.Eagle3Config.from_target(cfg, draft_vocab_size=48)
    rnd = eagle3.init_params(rcfg, jax.random.PRNGKey(5), scale=0.3)
    used = np.sort(np.random.default_rng(5).choice(cfg.vocab_size, 48, replace=False))
    return cfg, tp, perm, e3, e1, (rcfg, rnd, eagle3.VocabMap.from_used_ids(used, cfg.vocab_size))


@pytest.fixture(scope="module")
def plain(models):
    cfg, tp = models[0], models[1]
    s = InProcessServer((cfg, tp))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def eagle3_server(models):
    cfg, tp, _, e3, _, _ = models
    s = InProcessServer((cfg, tp), draft=e3, algorithm="EAGLE3")
    yield s
    s.stop()


def prompts(perm, n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for length in (1, 7, 9, 33, 70, 5)[:n]:
        p = [int(rng.integers(3, 64))]
        for _ in range(length - 1):  # mostly on the target's bigram path, with a few jumps
            p.append(int(perm[p[-1]]) if rng.random() < 0.8 else int(rng.integers(3, 64)))
        out.append(p)
    return out


def test_eagle3_greedy_equals_plain(plain, eagle3_server, models):
    perm = models[2]
    for p in prompts(perm):
        want = plain.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=24))
        got = eagle3_server.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=24))
        assert got["output_ids"] == want["output_ids"], p
        meta = got["meta_info"]
        assert meta["completion_tokens"] == 24
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
        # SGLang's newer fields: accepted / proposed draft tokens (the last step may give tokens past the budget)
        assert meta["spec_accept_token_num"] >= 24 - 1 - meta["spec_verify_ct"]
        assert 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_accept_token_num"] / meta["spec_draft_token_num"])
        assert "spec_verify_ct" not in want["meta_info"]
    state = httpx.get(eagle3_server.url + "/get_server_info").json()["internal_states"][0]
    assert state["avg_spec_accept_length"] > 1.3  # the closed-form head really is accepted


def test_eagle_head_greedy_equals_plain(plain, models):
    """EAGLE (EAGLE-1/2, last-hidden-state head) behind the same scheduler."""
    cfg, tp, perm, _, e1, _ = models
    s = InProcessServer((cfg, tp), draft=e1, algorithm="EAGLE")
    try:
        for p in prompts(perm, n=4, seed=3):
            want = plain.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20))
            got = s.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20))
            assert got["output_ids"] == want["output_ids"], p
        assert httpx.get(s.url + "/get_server_info").json()["internal_states"][0]["avg_spec_accept_length"] > 1.3
    finally:
        s.stop()


def test_relaxed_acceptance_reaches_the_server(plain, models):
    """``--speculative-accept-threshold-single 0`` (SGLang's relaxation: accept a drafted token whose target
    probability is at least 0): a sampled request through a random head's (3,1,4) chain is accepted whole at every
    step (4 tokens per step: 13 in 3 steps after the prefill's token), while a greedy request stays plain greedy."""
    cfg, tp, perm, *_, rnd = models
    s = InProcessServer((cfg, tp), draft=rnd, algorithm="EAGLE3", speculative_eagle_topk=1,
                        speculative_num_draft_tokens=4, speculative_accept_threshold_single=0.0)
    try:
        p = prompts(perm, n=2)[1]
        got = s.generate(input_ids=p, sampling_params=dict(temperature=0.8, ignore_eos=True, max_new_tokens=13))
        assert got["meta_info"]["spec_verify_ct"] == 3 and len(got["output_ids"]) == 13
        want = plain.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=13))
        assert s.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=13))["output_ids"] == \
            want["output_ids"]
    finally:
        s.stop()


def test_eagle3_prefix_reuse_concurrency_and_stops(plain, eagle3_server, models):
    perm = models[2]
    ps = prompts(perm, seed=1)
    want = [plain.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=n))["output_ids"]
            for p, n in zip(ps, (30, 5, 17, 40, 11, 23))]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*(c.post(eagle3_server.url + "/generate", json={
                "input_ids": p, "sampling_params": dict(GREEDY, max_new_tokens=len(w))}) for p, w in zip(ps, want)))
        return [r.json() for r in rs]

    for _ in range(2):  # the second round reuses the cached prefixes
        got = asyncio.run(run())
        assert [g["output_ids"] for g in got] == want
    assert any(g["meta_info"]["cached_tokens"] > 0 for g in got)
    # a stop token that arrives in the middle of a multi-token step ends the output right there
    base = want[3]
    stop = base[9]
    k = base.index(stop)
    out = eagle3_server.generate(input_ids=ps[3], sampling_params=dict(GREEDY, max_new_tokens=40,
                                                                       stop_token_ids=[stop]))
    assert out["output_ids"] == base[:k + 1] and out["meta_info"]["finish_reason"]["matched"] == stop
    # streaming delivers every token exactly once
    with httpx.stream("POST", eagle3_server.url + "/generate", json={
            "input_ids": ps[0], "stream": True, "sampling_params": dict(GREEDY, max_new_tokens=30)}) as r:
        import json
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["output_ids"] == want[0]
    for prev, ev in zip(events, events[1:]):  # cumulative: each event extends the last by new tokens, none repeated
        assert len(ev["output_ids"]) > len(prev["output_ids"]) and ev["output_ids"][:len(prev["output_ids"])] == \
            prev["output_ids"]
    idle = idle_state(eagle3_server.url)
    assert idle["kv_pages_used"] == 0 and idle["num_running_reqs"] == 0


def test_eagle3_logprobs_and_penalties_over_http_equal_plain(plain, eagle3_server, models):
    """Penalised greedy requests with native logprobs through the speculative server: the same tokens, output
    logprobs (from the verify forward), top logprobs and prompt logprobs as the plain server (1e-4)."""
    perm = models[2]
    sp = dict(GREEDY, max_new_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
              logit_bias={"7": 1.5}, min_new_tokens=6, stop_token_ids=[11])
    body = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    accept = []
    for p in prompts(perm, n=4, seed=2):
        want = plain.generate(input_ids=p, sampling_params=sp, **body)
        got = eagle3_server.generate(input_ids=p, sampling_params=sp, **body)
        assert got["output_ids"] == want["output_ids"], p
        assert want["output_ids"] != plain.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20))[
            "output_ids"]  # the penalties changed the output
        g, w = got["meta_info"], want["meta_info"]
        assert g["input_token_logprobs"][0][0] is None and len(g["input_token_logprobs"]) == len(p)
        for field in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t, _ in g[field]] == [t for _, t, _ in w[field]]
            np.testing.assert_allclose([x for x, _, _ in g[field] if x is not None],
                                       [x for x, _, _ in w[field] if x is not None], atol=1e-4)
        for gt, wt in zip(g["output_top_logprobs"], w["output_top_logprobs"]):
            np.testing.assert_allclose([x for x, _, _ in gt], [x for x, _, _ in wt], atol=1e-4)
        accept.append(g["spec_accept_length"])
    assert np.mean(accept) > 1.2, accept  # drafted paths were accepted under the penalties
    # a prefill-only request (max_new_tokens 0) through the speculative server: the prompt's logprobs, no token
    got = eagle3_server.generate(input_ids=p, sampling_params=dict(sp, max_new_tokens=0, min_new_tokens=0), **body)
    assert got["output_ids"] == [] and got["meta_info"]["finish_reason"]["type"] == "length"
    np.testing.assert_allclose([x for x, _, _ in got["meta_info"]["input_token_logprobs"][1:]],
                               [x for x, _, _ in w["input_token_logprobs"][1:]], atol=1e-4)
    assert eagle3_server.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]  # the slot was freed


def test_cli_server_with_a_random_eagle3_head_folder(tmp_path):
    """The whole command-line path: an EAGLE3 head exported to disk (LlamaForCausalLMEagle3 format), loaded by
    ``python -m specjax.serve --speculative-algorithm EAGLE3 --speculative-draft-model-path``; a random head is
    rarely accepted, and the output must still equal the plain server's."""
    import jax
    from specjax.config import ModelConfig
    from specjax.convert.head import export_head
    from specjax.models import eagle3
    from server_helpers import Server, shared_server
    model_dir = tiny_model_dir()
    cfg = ModelConfig.from_pretrained(model_dir, dtype="float32")
    hcfg = eagle3.Eagle3Config.from_target(cfg, draft_vocab_size=200, dtype="float32")
    head = eagle3.init_params(hcfg, jax.random.PRNGKey(3), scale=0.3)
    used = np.sort(np.random.default_rng(3).choice(cfg.vocab_size, 200, replace=False))
    export_head(head, hcfg, eagle3.VocabMap.from_used_ids(used, cfg.vocab_size), str(tmp_path / "head"), cfg)
    plain = shared_server()
    spec = Server(model_dir, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                  str(tmp_path / "head"), "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                  "--speculative-num-draft-tokens", "4", "--skip-server-warmup")
    try:
        for text in ("The capital of France is", "def add(a, b):"):
            body = {"text": text, "sampling_params": dict(GREEDY, max_new_tokens=16)}
            want = httpx.post(plain.url + "/generate", json=body, timeout=120).json()
            got = httpx.post(spec.url + "/generate", json=body, timeout=300).json()
            assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
            assert got["meta_info"]["spec_verify_ct"] >= 1 and got["meta_info"]["spec_accept_length"] >= 1.0
        info = httpx.get(spec.url + "/get_server_info").json()
        assert info["speculative_algorithm"] == "EAGLE3" and info["speculative_num_draft_tokens"] == 4
    finally:
        spec.stop()
