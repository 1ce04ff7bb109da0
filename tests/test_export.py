"""EAGLE3 head export (specjax/convert/head.py) and import (specjax/head_weights.py) against
docs/08-eagle-reference.md section 1."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import head_weights
from specjax.config import ModelConfig
from specjax.convert import head as H
from specjax.models import eagle, eagle3
from specjax.safetensors_io import SafetensorsFile, save_file

V, D, VD = 128, 64, 48


def _target_hf(**kw):
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=D,
              intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", hidden_act="silu")
    hf.update(kw)
    return hf


def _target(**kw) -> ModelConfig:
    return ModelConfig.from_hf_dict(_target_hf(**kw))


def _head(tcfg, seed=0, **kw):
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=VD, dtype="bfloat16", **kw)
    params = eagle3.init_params(hcfg, jax.random.PRNGKey(seed), scale=0.5)
    # norms away from 1 so that a swapped norm shows
    params.norm = params.norm * 1.5
    used = np.sort(np.random.default_rng(seed).choice(V, VD, replace=False))
    return hcfg, params, eagle3.VocabMap.from_used_ids(used, V)


def _same(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))


SPEC_KEYS = {  # key -> shape, for H = Ht = 64, 4 heads x 16, 2 kv heads, I = 96
    "fc.weight": (D, 3 * D), "midlayer.input_layernorm.weight": (D,), "midlayer.hidden_norm.weight": (D,),
    "midlayer.self_attn.q_proj.weight": (64, 2 * D), "midlayer.self_attn.k_proj.weight": (32, 2 * D),
    "midlayer.self_attn.v_proj.weight": (32, 2 * D), "midlayer.self_attn.o_proj.weight": (D, 64),
    "midlayer.post_attention_layernorm.weight": (D,), "midlayer.mlp.gate_proj.weight": (96, D),
    "midlayer.mlp.up_proj.weight": (96, D), "midlayer.mlp.down_proj.weight": (D, 96), "norm.weight": (D,),
    "lm_head.weight": (VD, D), "d2t": (VD,), "t2d": (V,),
}


def test_export_matches_spec(tmp_path):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg)
    assert hcfg.aux_layer_ids == (1, 3, 4)  # {1, L//2-1, L-4} for L = 8
    H.export_head(params, hcfg, vmap, str(tmp_path), tcfg)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    sf = SafetensorsFile(str(tmp_path / "model.safetensors"))
    assert {k: sf.shape(k) for k in sf.keys()} == SPEC_KEYS
    assert sf.header["d2t"]["dtype"] == "I64" and sf.header["t2d"]["dtype"] == "BOOL"
    assert {sf.header[k]["dtype"] for k in SPEC_KEYS if k not in ("d2t", "t2d")} == {"BF16"}
    d2t, t2d = sf.tensor("d2t"), sf.tensor("t2d")
    used = np.nonzero(np.asarray(vmap.t2d))[0]
    np.testing.assert_array_equal(np.arange(VD) + d2t, used)  # offsets: target = i + d2t[i]
    assert t2d.sum() == VD and t2d[used].all()
    # [out, in]: q_proj applied to concat(emb, hidden) is x @ W.T
    wq = np.asarray(params.layers[0].wq.astype(jnp.float32)).reshape(2 * D, -1)
    np.testing.assert_array_equal(sf.tensor("midlayer.self_attn.q_proj.weight").astype(np.float32), wq.T)
    np.testing.assert_array_equal(sf.tensor("fc.weight").astype(np.float32), np.asarray(params.fc, np.float32).T)

    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None, "max_position_embeddings": 256,
        "vocab_size": V, "draft_vocab_size": VD, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    # the real safetensors library (and torch) read it with the spec's dtypes
    from safetensors.torch import load_file
    import torch
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["fc.weight"].dtype == torch.bfloat16
    assert "embed_tokens.weight" not in t


def test_round_trip_is_exact(tmp_path):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg, seed=1)
    H.export_head(params, hcfg, vmap, str(tmp_path), tcfg)
    cfg2, params2, vmap2 = head_weights.load_eagle3_head(str(tmp_path), tcfg)
    assert cfg2 == hcfg
    _same(params2, params)
    _same(vmap2, vmap)


def test_non_default_aux_layers_and_extra_layers(tmp_path):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg, seed=2, aux_layer_ids=(2, 4, 6), num_layers=2)
    hf = H.export_head(params, hcfg, vmap, str(tmp_path), tcfg)
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "use_aux_hidden_state": True}
    assert hf["eagle_aux_hidden_state_layer_ids"] == [3, 5, 7]  # vLLM's reading (the layers whose input it takes)
    assert hf["num_hidden_layers"] == 2
    keys = set(SafetensorsFile(str(tmp_path / "model.safetensors")).keys())
    assert "layers.1.self_attn.q_proj.weight" in keys and "layers.1.hidden_norm.weight" not in keys
    assert SafetensorsFile(str(tmp_path / "model.safetensors")).shape("layers.1.self_attn.q_proj.weight") == (64, D)
    cfg2, params2, vmap2 = head_weights.load_eagle3_head(str(tmp_path), tcfg)
    assert cfg2 == hcfg and cfg2.aux_layer_ids == (2, 4, 6)
    _same(params2, params)


def test_import_prefix_embed_tokens_and_layers0(tmp_path):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg, seed=3)
    H.export_head(params, hcfg, vmap, str(tmp_path / "a"), tcfg, dtype="float32")
    tensors = {k: np.array(v) for k, v in ((k, SafetensorsFile(str(tmp_path / "a/model.safetensors")).tensor(k))
                                          for k in SafetensorsFile(str(tmp_path / "a/model.safetensors")).keys())}
    src = tmp_path / "b"
    src.mkdir()
    (src / "config.json").write_text((tmp_path / "a/config.json").read_text())
    renamed = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in tensors.items()}
    renamed["model.embed_tokens.weight"] = np.ones((V, D), np.float32)
    save_file(renamed, str(src / "model.safetensors"))
    cfg2, params2, vmap2 = head_weights.load_eagle3_head(str(src), tcfg)
    assert cfg2.dtype == "float32"
    _same(params2, jax.tree.map(lambda x: x.astype(jnp.float32), params))
    _same(vmap2, vmap)
    # an embedding of another shape means another target
    renamed["model.embed_tokens.weight"] = np.ones((V, D + 1), np.float32)
    save_file(renamed, str(src / "model.safetensors"))
    with pytest.raises(head_weights.HeadFormatError, match="embed_tokens"):
        head_weights.load_eagle3_head(str(src), tcfg)
    # unknown tensors are refused, not silently dropped
    renamed["model.embed_tokens.weight"] = np.ones((V, D), np.float32)
    renamed["model.layers.1.mlp.up_proj.weight"] = np.ones((96, D), np.float32)
    save_file(renamed, str(src / "model.safetensors"))
    with pytest.raises(head_weights.HeadFormatError, match="does not use"):
        head_weights.load_eagle3_head(str(src), tcfg)


def test_refuses_mismatched_target(tmp_path):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg, seed=4)
    H.export_head(params, hcfg, vmap, str(tmp_path), tcfg)
    with pytest.raises(head_weights.HeadFormatError, match="vocab"):
        head_weights.load_eagle3_head(str(tmp_path), _target(vocab_size=256))
    with pytest.raises(head_weights.HeadFormatError, match="hidden size"):
        head_weights.load_eagle3_head(str(tmp_path), _target(hidden_size=96))
    with pytest.raises(head_weights.HeadFormatError, match="vocab"):
        H.export_head(params, hcfg, vmap, str(tmp_path / "x"), _target(vocab_size=256))
    # a head narrower than its target (target_hidden_size != hidden_size) would fail at its first draft step: the
    # target's embedding is as wide as the target; refused when it exports or loads
    narrow_cfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=VD, hidden_size=32, intermediate_size=64,
                                                 num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(head_weights.HeadFormatError, match="hidden_size=32 differs from the target's"):
        head_weights.check_head_matches_target(narrow_cfg, tcfg)
    bad = eagle3.VocabMap(d2t=vmap.d2t, t2d=jnp.roll(vmap.t2d, 1))
    with pytest.raises(head_weights.HeadFormatError, match="disagree"):
        H.export_head(params, hcfg, bad, str(tmp_path / "y"), tcfg)
    (tmp_path / "config.json").write_text("{\n")  # a damaged config.json: named, not a bare JSON parser message
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        head_weights.load_eagle3_head(str(tmp_path), tcfg)


def test_cli_import_then_export(tmp_path, capsys):
    """import-head -> a training checkpoint (head.init_from) -> export-head gives back the same HF head."""
    tcfg_dir = tmp_path / "target"
    tcfg_dir.mkdir()
    (tcfg_dir / "config.json").write_text(json.dumps(_target_hf()))
    tcfg = ModelConfig.from_pretrained(str(tcfg_dir))
    hcfg, params, vmap = _head(tcfg, seed=5)
    H.export_head(params, hcfg, vmap, str(tmp_path / "hf"), tcfg)
    from specjax.convert.__main__ import main
    assert main(["import-head", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--target", str(tcfg_dir)]) == 0
    assert main(["import-head", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--target", str(tcfg_dir)]) == 2
    assert "is not empty" in capsys.readouterr().err  # a second import never meets orbax's bare message
    assert main(["export-head", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    cfg2, params2, vmap2 = head_weights.load_eagle3_head(str(tmp_path / "out"), tcfg)
    assert cfg2 == hcfg
    _same(params2, params)
    _same(vmap2, vmap)
    assert (tmp_path / "out/config.json").read_text() == (tmp_path / "hf/config.json").read_text()
    # a bad target is refused with a message, not a traceback
    (tcfg_dir / "config.json").write_text(json.dumps(_target_hf(vocab_size=256)))
    assert main(["export-head", str(tmp_path / "ckpt"), str(tmp_path / "out2")]) == 2


def test_cli_refuses_a_folder_with_files_of_its_own(tmp_path, capsys):
    """export-head and import-head --format hf wrote config.json and model.safetensors into any folder (a model
    folder kept its tokenizer beside them): refused, the folder untouched; one that holds exactly an earlier export
    is replaced (a re-export), but not once it holds anything else (a tune table measured for the old head)."""
    from specjax.convert.__main__ import main
    tdir = tmp_path / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(_target_hf()))
    tcfg = ModelConfig.from_pretrained(str(tdir))
    hcfg, params, vmap = _head(tcfg, seed=6)
    hf, model, out = str(tmp_path / "hf"), tmp_path / "model", tmp_path / "out"
    H.export_head(params, hcfg, vmap, hf, tcfg)
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_target_hf()))
    (model / "tokenizer.json").write_text("{}")
    for argv in (["export-head", hf, str(model)], ["import-head", hf, str(model), "--format", "hf"]):
        assert main([*argv, "--target", str(tdir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {model} is not empty: ") and len(err.splitlines()) == 1, err
        assert sorted(os.listdir(model)) == ["config.json", "tokenizer.json"]
        assert json.loads((model / "config.json").read_text()) == _target_hf()
    with pytest.raises(ValueError, match="is not empty"):  # the library function too
        H.export_head(params, hcfg, vmap, str(model), tcfg)
    for dtype in ("bfloat16", "float32"):
        assert main(["export-head", hf, str(out), "--target", str(tdir), "--dtype", dtype]) == 0
    assert "replacing the previous output in" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    (out / "speculative_tune.json").write_text("{}")
    assert main(["export-head", hf, str(out), "--target", str(tdir)]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["nan", "inf", "fp16_overflow"])
def test_refuses_non_finite_weights(tmp_path, how):
    tcfg = _target()
    hcfg, params, vmap = _head(tcfg)
    dtype = None
    if how == "nan":
        params.fc = params.fc.at[3, 5].set(jnp.nan)
    elif how == "inf":
        params.layers[0].w_down = params.layers[0].w_down.at[0, 0].set(jnp.inf)
    else:  # finite in bf16, beyond float16's range
        params.norm = params.norm.at[0].set(1e6)
        dtype = "float16"
    key = {"nan": "fc.weight", "inf": "midlayer.mlp.down_proj.weight", "fp16_overflow": "norm.weight"}[how]
    with pytest.raises(head_weights.HeadFormatError, match=f"non-finite weights .*{key.replace('.', '[.]')} [(]1 of"):
        H.export_head(params, hcfg, vmap, str(tmp_path / "out"), tcfg, dtype=dtype)
    assert not (tmp_path / "out" / "model.safetensors").exists()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("spelling", ["top-level", "rope_parameters", "legacy type"])
def test_head_configs_read_rope_as_target_configs_do(spelling):
    """A head's config.json may give its RoPE as transformers >= 4.56 writes it (``rope_parameters``) or with the
    legacy ``type`` key: EAGLE3 and EAGLE heads read each as a target's config does (a head with only
    ``rope_parameters`` loaded as theta 10000 without scaling; a legacy ``type`` failed at the first draft step)."""
    if spelling == "top-level":
        rope = {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}
    elif spelling == "rope_parameters":
        rope = {"rope_parameters": dict(LLAMA3_ROPE, rope_theta=500000.0)}
    else:
        rope = {"rope_theta": 500000.0, "rope_scaling": dict(
            {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}, type="llama3")}
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 96, "num_hidden_layers": 1, **rope}
    want = (500000.0, tuple(sorted(LLAMA3_ROPE.items())))
    e3 = eagle3.config_from_hf(dict(base, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=32), 8)
    e1 = eagle.config_from_hf(dict(base, architectures=["LlamaForCausalLMEagle"]))
    assert (e3.rope_theta, e3.rope_scaling) == want and (e1.rope_theta, e1.rope_scaling) == want
    target = ModelConfig.from_hf_dict(dict(base, architectures=["LlamaForCausalLM"], model_type="llama"))
    assert (target.rope_theta, target.rope_scaling) == want
    with pytest.raises(ValueError, match="rope_scaling type 'yarn-ish' is not supported"):
        eagle3.config_from_hf(dict(base, rope_scaling={"rope_type": "yarn-ish"}), 8)
