"""SGLang's --skip-tokenizer-init, --allow-auto-truncate and --device: a server without a tokenizer (a model folder
with none) serves token ids exactly as one with it does and refuses text clearly; over-long prompts and output
limits are cut to fit instead of refused; the JAX platform is chosen, or the choice refused, clearly."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from server_helpers import ENGINE_KW, offline_engine, tiny_model_dir
from starlette.testclient import TestClient

from specjax.platforms import use_device
from specjax.serve.api import create_app
from specjax.serve.request import RequestError

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return offline_engine(tiny_model_dir())


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """An Engine over a copy of the tiny model with no tokenizer files, --skip-tokenizer-init and
    --allow-auto-truncate."""
    import specjax
    folder = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if os.path.exists(os.path.join(tiny_model_dir(), name)):
            shutil.copy(os.path.join(tiny_model_dir(), name), folder)
    eng = specjax.Engine(model_path=str(folder), skip_tokenizer_init=True, allow_auto_truncate=True,
                         skip_server_warmup=True, **ENGINE_KW)
    yield eng
    eng.shutdown()


def test_token_ids_in_and_out_without_a_tokenizer(engine, bare):
    prompts = np.random.default_rng(0).integers(3, 300, size=(3, 20)).tolist()
    sp = {"max_new_tokens": 10, **GREEDY}
    got = bare.generate(input_ids=prompts, sampling_params=sp)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in engine.generate(input_ids=prompts,
                                                                                       sampling_params=sp)]
    assert all(g["text"] == "" for g in got)
    assert bare.backend.scheduler.eos_ids == engine.backend.scheduler.eos_ids  # from config.json alone
    with pytest.raises(RequestError, match="skip-tokenizer-init"):
        bare.generate("Hello", {"max_new_tokens": 2})
    with pytest.raises(RequestError, match="skip-tokenizer-init"):
        bare.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2, "stop": ["\n"]})
    with TestClient(create_app(bare.backend)) as client:
        r = client.post("/generate", json={"input_ids": prompts[0], "sampling_params": sp})
        assert r.status_code == 200 and r.json()["output_ids"] == got[0]["output_ids"]
        for path, body in (("/generate", {"text": "Hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/completions", {"prompt": prompts[0]}), ("/tokenize", {"prompt": "Hi"}),
                           ("/detokenize", {"tokens": [5]})):
            r = client.post(path, json=body)
            assert r.status_code == 400 and "skip-tokenizer-init" in r.text, (path, r.text)


def test_auto_truncate_cuts_the_prompt_and_the_output_limit(engine, bare):
    """Context 256: a 300-token prompt keeps its first 255 tokens and emits 1; an explicit max_new_tokens past the
    context is lowered to fit. Without the flag both are 400s."""
    ids = np.random.default_rng(1).integers(3, 300, size=300).tolist()
    assert bare.get_server_info()["max_req_input_len"] == 255
    out = bare.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})
    want = engine.generate(input_ids=ids[:255], sampling_params={"max_new_tokens": 1, **GREEDY})
    assert out["output_ids"] == want["output_ids"] and out["meta_info"]["prompt_tokens"] == 255
    out = bare.generate(input_ids=ids[:200], sampling_params={"max_new_tokens": 100, **GREEDY})
    want = engine.generate(input_ids=ids[:200], sampling_params={"max_new_tokens": 56, **GREEDY})
    assert out["output_ids"] == want["output_ids"] and len(out["output_ids"]) == 56
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8})
    with pytest.raises(RequestError, match="lower max_new_tokens"):
        engine.generate(input_ids=ids[:200], sampling_params={"max_new_tokens": 100})


def test_device_choice():
    """In this process JAX already runs on the CPU: that device is kept, another refused; in a fresh process
    --device cpu selects the CPU even where libtpu is installed, and an absent platform is a clear error."""
    use_device("cpu")
    with pytest.raises(ValueError, match="already runs JAX on 'cpu'"):
        use_device("tpu")
    cuda = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    code = ("import jax; from specjax.platforms import use_device\n"
            + ("" if cuda else "try:\n    use_device('cuda')\nexcept ValueError as e:\n    print('refused:', e)\n")
            + "use_device('cpu'); print('backend:', jax.default_backend())")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "backend: cpu" in out, out
    assert cuda or "refused: device 'cuda': JAX has no cuda backend here" in out, out
