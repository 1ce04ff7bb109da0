"""The safetensors loader: exact values, sharded and half-precision checkpoints, loud refusals; the tokenizer loader."""

import copy
import fnmatch
import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import train_fixtures as tf
from hf_tiny_models import build
from specjax.hub import default_smollm2_path
from specjax.models import target
from specjax.safetensors_io import load_file, save_file
from specjax.weights import (WeightsError, _generic_tokenizer, load_model, load_tokenizer, params_to_hf,
                             resolve_model_path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Qwen2 checkpoint (q/k/v biases, untied head) and its HF state dict as numpy."""
    folder = tmp_path_factory.mktemp("qwen2")
    hf = build("qwen2", folder)
    return str(folder), {k: v.numpy() for k, v in hf.state_dict().items()}, hf


def _edit(src, dst, fn):
    """Copy checkpoint folder ``src`` to ``dst`` with its tensors passed through ``fn(dict) -> dict``."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file(fn(load_file(path)), path)
    return str(dst)


def test_loads_exact_values(ckpt):
    folder, state, _ = ckpt
    cfg, params = load_model(folder, dtype="float32")
    assert cfg.family == "qwen2" and cfg.dtype == "float32"
    back = params_to_hf(params, cfg)
    assert set(back) == set(state)
    for k, v in state.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_missing_tensor(ckpt, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"
    bad = _edit(ckpt[0], tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(WeightsError, match=f"lacks tensor '{key}'"):
        load_model(bad, dtype="float32")


def test_misshaped_tensor(ckpt, tmp_path):
    key = "model.layers.0.self_attn.k_proj.bias"
    bad = _edit(ckpt[0], tmp_path / "m", lambda t: {**t, key: np.zeros(7, np.float32)})
    with pytest.raises(WeightsError, match=rf"'{key}' has shape \(7,\), expected \(32,\)"):
        load_model(bad, dtype="float32")


def test_unexpected_extra_tensor(ckpt, tmp_path):
    key = "model.layers.0.self_attn.o_proj.bias"
    bad = _edit(ckpt[0], tmp_path / "m", lambda t: {**t, key: np.zeros(64, np.float32)})
    with pytest.raises(WeightsError, match=rf"does not use: \['{key}'\]"):
        load_model(bad, dtype="float32")


def test_sharded_checkpoint(ckpt, tmp_path):
    folder, state, hf = ckpt
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    files = os.listdir(tmp_path)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    cfg, params = load_model(str(tmp_path), dtype="float32")
    back = params_to_hf(params, cfg)
    for k, v in state.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


@pytest.mark.parametrize("torch_dtype,name,np_dtype", [(torch.bfloat16, "bfloat16", ml_dtypes.bfloat16),
                                                       (torch.float16, "float16", np.float16)])
def test_half_precision_checkpoint(ckpt, tmp_path, torch_dtype, name, np_dtype):
    _, state, hf = ckpt
    copy.deepcopy(hf).to(torch_dtype).save_pretrained(str(tmp_path))
    cfg, params = load_model(str(tmp_path))  # dtype from config.json
    assert cfg.dtype == name
    assert params.embed.dtype == np_dtype and params.layers.wq.dtype == np_dtype
    key = "model.layers.1.self_attn.q_proj.weight"
    want = state[key].astype(np_dtype)
    np.testing.assert_array_equal(params_to_hf(params, cfg)[key], want)
    # Upcasting on load is exact.
    cfg32, params32 = load_model(str(tmp_path), dtype="float32")
    np.testing.assert_array_equal(params_to_hf(params32, cfg32)[key], want.astype(np.float32))


def test_missing_path_without_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    for path in (str(tmp_path / "no-such-model"), "no-such-org/no-such-model"):
        with pytest.raises(WeightsError, match="not a local folder.*Pass a local folder with config.json"):
            resolve_model_path(path)
        with pytest.raises(WeightsError, match="Pass a local folder"):
            load_model(path)
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(WeightsError, match="is a file; pass the folder"):
        load_model(str(a_file))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_layout_is_read_as_unstack_layers_makes_it(tmp_path, family, dtype):
    """``layout="decode"`` reads the layers one by one into what ``target.unstack_layers`` makes of the stacked
    params: the same tree (fused q/k/v, embedding bits) and the same bits."""
    build(family, tmp_path)
    _, stacked = load_model(str(tmp_path), dtype=dtype)
    _, direct = load_model(str(tmp_path), dtype=dtype, layout="decode")
    want = target.unstack_layers(stacked)
    assert jax.tree.structure(direct) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_layout_and_a_missing_tensor_in_the_decode_layout(ckpt, tmp_path):
    with pytest.raises(ValueError, match="layout must be 'stacked' or 'decode', got 'unrolled'"):
        load_model(ckpt[0], layout="unrolled")
    key = "model.layers.1.mlp.up_proj.weight"
    bad = _edit(ckpt[0], tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(WeightsError, match=f"lacks tensor '{key}'"):
        load_model(bad, dtype="float32", layout="decode")


def test_hub_download_skips_mistral_consolidated_weights(monkeypatch, tmp_path):
    """A hub id downloads config, tokenizer and HF safetensors, not Mistral's second copy of the weights
    (consolidated.safetensors, as large as the shards)."""
    seen = {}

    def fake_download(repo_id, allow_patterns=None, ignore_patterns=None, **_):
        seen.update(repo=repo_id, allow=allow_patterns, ignore=ignore_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_path("mistralai/Mistral-7B-Instruct-v0.3") == str(tmp_path)
    files = ["config.json", "model-00001-of-00003.safetensors", "consolidated.safetensors", "tokenizer.json"]
    kept = [f for f in files if any(fnmatch.fnmatch(f, p) for p in seen["allow"])
            and not any(fnmatch.fnmatch(f, p) for p in seen["ignore"])]
    assert kept == ["config.json", "model-00001-of-00003.safetensors", "tokenizer.json"]


def _tokenizer_behaviour(tok) -> tuple:
    texts = ["Hello world, how are you?", "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\nnew lines ünïcode"]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is JAX?"}]
    ids = [tok(t)["input_ids"] for t in texts]
    return (type(tok).__name__, len(tok), tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token,
            tuple(tok.all_special_ids), ids, [tok(t, add_special_tokens=False)["input_ids"] for t in texts],
            [tok.decode(i, skip_special_tokens=True) for i in ids], [tok.decode(i) for i in ids],
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
            tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=False))


def test_generic_tokenizer_loads_as_autotokenizer_would(tmp_path):
    """A Llama-type folder whose tokenizer is the generic tokenizer.json one (SmolLM2 as fetched, the tests' tiny
    models) loads without AutoTokenizer (whose model-config import pulls in torch: seconds of every CLI start) and
    behaves exactly as AutoTokenizer's; any other folder (Qwen2, whose registered class AutoTokenizer prefers; remote
    code; no tokenizer.json) still goes through AutoTokenizer."""
    tiny = tf.make_tiny_model(str(tmp_path / "tiny"))
    folders = [tiny] + [p for p in [default_smollm2_path()] if os.path.isfile(os.path.join(p, "tokenizer.json"))]
    for folder in folders:
        assert _generic_tokenizer(folder), folder
        assert _tokenizer_behaviour(load_tokenizer(folder)) == _tokenizer_behaviour(AutoTokenizer.from_pretrained(
            folder)), folder
    code = (f"import sys; from specjax.weights import load_tokenizer; tok = load_tokenizer({tiny!r}); "
            "assert tok('hi')['input_ids'] and 'torch' not in sys.modules, sorted(sys.modules)[:50]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))

    def variant(name, edit_tok=None, edit_model=None, drop=None):
        d = tmp_path / name
        shutil.copytree(tiny, d)
        for fname, edit in (("tokenizer_config.json", edit_tok), ("config.json", edit_model)):
            if edit:
                cfg = json.loads((d / fname).read_text())
                edit(cfg)
                (d / fname).write_text(json.dumps(cfg))
        if drop:
            (d / drop).unlink()
        return str(d)
    assert not _generic_tokenizer(variant("qwen2", edit_model=lambda c: c.update(model_type="qwen2")))
    assert not _generic_tokenizer(variant("remote", edit_tok=lambda c: c.update(auto_map={"AutoTokenizer": "x.Y"})))
    assert not _generic_tokenizer(variant("named", edit_tok=lambda c: c.update(tokenizer_class="Qwen2Tokenizer")))
    assert not _generic_tokenizer(variant("nojson", drop="tokenizer.json"))
    assert not _generic_tokenizer(str(tmp_path / "missing"))
