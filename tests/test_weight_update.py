"""SGLang's ``update_weights_from_disk`` (Engine method and HTTP route): after an update the engine's greedy outputs
are the new weights' (specjax.generate on them, the independent plain decoder), plain, EAGLE3 and EAGLE (whose
vocabulary head is the target's); a request running when the update is asked for finishes on the old weights, one
arriving meanwhile starts on the new; a model of another shape, a missing folder or an unsupported option is refused
and the old weights keep serving."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from server_helpers import ENGINE_KW, tiny_model_dir
from starlette.testclient import TestClient

import specjax
from specjax.serve import launch
from specjax.serve.api import create_app

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def oracle():
    """Greedy tokens of specjax.generate over the weights in a folder."""
    from specjax.generate import generate
    from specjax.weights import load_model

    def run(folder, prompts, n=10):
        cfg, params = load_model(folder, dtype="float32")
        return generate(params, cfg, prompts, max_new_tokens=n, stop_token_ids=(), page_size=8)
    return run


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 40)]


def _greedy(engine, prompts, sp=GREEDY):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]


def _engine_kw(algorithm, folder, tmp_path, monkeypatch):
    """Engine options for plain decoding, an EAGLE3 head folder, or an EAGLE head with FR-Spec hot ids."""
    kw = dict(ENGINE_KW)
    if algorithm is None:
        return kw
    from spec_models import random_models
    from specjax.convert.head import export_head
    from specjax.weights import load_model
    cfg, _ = load_model(folder, dtype="float32")
    _, (hcfg, hparams, vmap), eagle_head = random_models(cfg, seed=3, draft_vocab=200)
    if algorithm == "EAGLE3":
        export_head(hparams, hcfg, vmap, str(tmp_path / "head"), cfg)
    else:  # its vocabulary head is the target's lm_head, its hot rows: rebuilt from the new weights
        monkeypatch.setattr(launch, "load_draft", lambda *a, **k: eagle_head)
    return dict(kw, speculative_algorithm=algorithm, speculative_draft_model_path=str(tmp_path / "head"),
                speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)


@pytest.mark.parametrize("algorithm", [None, "EAGLE3", "EAGLE"])
def test_update_weights_from_disk(oracle, tmp_path, monkeypatch, algorithm):
    a, b = tiny_model_dir(0), tiny_model_dir(1)
    (tmp_path / "head").mkdir()
    kw = _engine_kw(algorithm, a, tmp_path, monkeypatch)
    prompts = _prompts()
    want_a, want_b = oracle(a, prompts), oracle(b, prompts)
    assert want_a != want_b
    with specjax.Engine(model_path=a, skip_server_warmup=True, **kw) as engine:
        assert _greedy(engine, prompts) == want_a
        assert engine.update_weights_from_disk(b) == (True, "Succeeded to update model weights.", 0)
        assert _greedy(engine, prompts) == want_b  # the cached prefixes of A's K/V were dropped with its weights
        info = engine.get_server_info()
        assert info["model_path"] == info["served_model_name"] == b and info["tokenizer_path"] == a
        if algorithm == "EAGLE":  # greedy outputs would not show a stale vocabulary head: look at it
            _vocab_head_is_the_targets(engine, b, a)
        _running_request_finishes_first(engine, monkeypatch, oracle, a, b, prompts)

        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/update_weights_from_disk", json={"model_path": b, "weight_version": "step-7"})
            assert r.status_code == 200 and r.json() == {
                "success": True, "num_paused_requests": 0,
                "message": "Succeeded to update model weights. Weight version updated to step-7."}
            assert client.get("/get_model_info").json()["weight_version"] == "step-7"
            for body, why in [({"model_path": str(tmp_path / "missing")}, "failed to update the weights"),
                              ({"model_path": b, "keep_pause": True}, "keep_pause is not supported"),
                              ({"model_path": b, "load_format": "gguf"}, "load_format 'gguf' is not supported")]:
                r = client.post("/update_weights_from_disk", json=body)
                assert r.status_code == 400 and r.json()["success"] is False and why in r.json()["message"], r.text
        assert _greedy(engine, prompts) == want_b


def _vocab_head_is_the_targets(engine, new, old):
    from specjax.speculative.draft import eagle_lm_head
    from specjax.weights import load_model
    draft = engine.backend.scheduler.runner.draft
    head = lambda folder: np.asarray(eagle_lm_head(load_model(folder, dtype="float32", layout="decode")[1],
                                                   draft.ids))  # FR-Spec hot ids: 200 of the 320
    assert np.array_equal(np.asarray(draft.lm_head), head(new)) and not np.array_equal(head(new), head(old))


def _running_request_finishes_first(engine, monkeypatch, oracle, a, b, prompts):
    """A request running when an update (b -> a) is asked for finishes on b's weights; one that arrives while the
    update waits for it starts on a's."""
    from specjax.weights import load_model
    loaded = load_model(a, dtype="float32", layout="decode")
    monkeypatch.setattr(launch, "load_model", lambda *args, **kw: loaded)  # the pause starts at once
    sched = engine.backend.scheduler
    long = {**GREEDY, "max_new_tokens": 120}
    stream = engine.generate(input_ids=prompts[1], sampling_params=long, stream=True)
    next(stream)
    result, late = {}, {}
    updater = threading.Thread(target=lambda: result.update(r=engine.update_weights_from_disk(a)))
    updater.start()
    deadline = time.monotonic() + 60
    while not sched.admission_paused and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sched.admission_paused and engine.get_server_info()["internal_states"][0]["num_running_reqs"] == 1
    arrival = threading.Thread(target=lambda: late.update(o=_greedy(engine, prompts[:1])))
    arrival.start()
    while not sched.call(lambda: len(sched.waiting)) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sched.call(lambda: (len(sched.waiting), sched.admission_paused)) == (1, True)  # queued in the pause
    outputs = [c["output_ids"] for c in stream]
    updater.join(120)
    arrival.join(120)
    assert result["r"][0] and outputs[-1] == oracle(b, [prompts[1]], 120)[0]
    assert late["o"] == oracle(a, prompts[:1])
    monkeypatch.undo()


def test_a_model_of_another_shape_is_refused(tmp_path):
    from hf_tiny_models import build
    build("llama", tmp_path / "other", config={"hidden_size": 96})
    with specjax.Engine(model_path=tiny_model_dir(0), skip_server_warmup=True, **ENGINE_KW) as engine:
        before = _greedy(engine, _prompts()[:1])
        ok, message, _ = engine.update_weights_from_disk(str(tmp_path / "other"))
        assert not ok and "is not the served model's shape" in message and "hidden_size" in message
        assert _greedy(engine, _prompts()[:1]) == before


def test_update_weights_from_tensor(oracle, tmp_path):
    """SGLang's ``Engine.update_weights_from_tensor``: HF-named tensors (numpy, torch, jax; any subset) replace what
    they name in the served weights, their layout (fused q/k/v, CPU panels) rebuilt; the greedy outputs are then
    those of a checkpoint holding the same tensors; an unknown name, a wrong shape or an unsupported format is
    refused whole, the old weights serving on."""
    import shutil

    import jax.numpy as jnp
    import torch
    from safetensors.numpy import save_file

    from specjax.weights import load_model, params_to_hf
    a, b = tiny_model_dir(0), tiny_model_dir(1)
    prompts = _prompts()
    hf_a, hf_b = (params_to_hf(load_model(f, dtype="float32")[1], load_model(f, dtype="float32")[0]) for f in (a, b))
    some = {k: hf_b[k] for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                 "model.norm.weight", "model.embed_tokens.weight")}
    k_proj = torch.from_numpy(some["model.layers.0.self_attn.k_proj.weight"]).to(torch.bfloat16)  # as RL sends it
    some["model.layers.0.self_attn.k_proj.weight"] = k_proj.float().numpy()
    mixed = tmp_path / "mixed"  # a's checkpoint with b's tensors where ``some`` names them
    shutil.copytree(a, mixed)
    save_file({**hf_a, **some}, str(mixed / "model.safetensors"))
    want_mixed, want_b = oracle(str(mixed), prompts), oracle(b, prompts)
    with specjax.Engine(model_path=a, skip_server_warmup=True, **ENGINE_KW) as engine:
        before = _greedy(engine, prompts)
        for named, why in [([("model.layers.0.mlp.gate.weight", some["model.norm.weight"])], "does not name"),
                           ([("model.norm.weight", np.zeros(3, np.float32))], "shape"),
                           ([("model.norm.weight", 1.0)], "array")]:
            ok, message = engine.update_weights_from_tensor(named)
            assert not ok and why in message, message
        assert engine.update_weights_from_tensor([], load_format="flattened_bucket")[0] is False
        assert _greedy(engine, prompts) == before
        named = [(k, k_proj if "k_proj" in k else jnp.asarray(v) if "up_proj" in k else v) for k, v in some.items()]
        assert engine.update_weights_from_tensor(named) == (True, "Succeeded to update model weights.")
        assert _greedy(engine, prompts) == want_mixed != before
        for name, want in [("model.layers.0.self_attn.k_proj.weight", some["model.layers.0.self_attn.k_proj.weight"]),
                           ("lm_head.weight", hf_a["lm_head.weight"]), ("norm.weight", some["model.norm.weight"]),
                           ("model.layers.1.self_attn.o_proj.weight", hf_a["model.layers.1.self_attn.o_proj.weight"])]:
            np.testing.assert_array_equal(engine.get_weights_by_name(name, truncate_size=3), want[:3])  # SGLang's
        with TestClient(create_app(engine.backend)) as client:
            r = client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5})
            assert r.status_code == 200 and r.json() == pytest.approx(some["model.norm.weight"][:5].tolist())
            r = client.post("/get_weights_by_name", json={"name": "model.layers.9.mlp.up_proj.weight"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
        assert engine.update_weights_from_tensor(list(hf_b.items()))[0]
        assert _greedy(engine, prompts) == want_b


def test_update_weights_from_tensor_keeps_the_shardings(oracle):
    """Under tensor parallelism (2 fake CPU devices) the replaced tensors take the shardings of the ones they
    replace, and the outputs are the new weights'."""
    from specjax.weights import load_model, params_to_hf
    a, b = tiny_model_dir(0), tiny_model_dir(1)
    cfg, params_b = load_model(b, dtype="float32")
    prompts = _prompts()
    with specjax.Engine(model_path=a, skip_server_warmup=True, tp_size=2, **ENGINE_KW) as engine:
        old = engine.backend.scheduler.runner.target_params.layers[0].wq.sharding
        assert engine.update_weights_from_tensor(params_to_hf(params_b, cfg).items())[0]
        assert engine.backend.scheduler.runner.target_params.layers[0].wq.sharding == old
        np.testing.assert_array_equal(engine.get_weights_by_name("model.layers.1.self_attn.q_proj.weight", 4),
                                      params_to_hf(params_b, cfg)["model.layers.1.self_attn.q_proj.weight"][:4])
        assert _greedy(engine, prompts) == oracle(b, prompts)
