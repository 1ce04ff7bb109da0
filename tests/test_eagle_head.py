"""EAGLE-1/2 head (``LlamaForCausalLMEagle``): parity with a PyTorch reference built from transformers' own Llama
decoder layer (input_layernorm skipped, fc with bias on concat(embedding, feature)), the HF-folder loader (safetensors
or pytorch_model.bin, ``model.`` prefix, tolerated embed_tokens), safe FR-Spec token maps, and ``load_draft``."""

import json
import os
import pickle
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from spec_models import np_init, tiny_config

from specjax import head_weights, layers
from specjax.convert.head import main as convert_main
from specjax.models import eagle, eagle3, target
from specjax.safetensors_io import save_file
from specjax.speculative import draft as draft_lib

H, F, N, K, V, T = 64, 128, 4, 2, 64, 7


def hf_config():
    return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": F, "num_attention_heads": N, "num_key_value_heads": K, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": V,
            "torch_dtype": "float32", "hidden_act": "silu"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A torch EAGLE head, its output on random inputs, and its HF folder."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    hc = LlamaConfig(**{k: v for k, v in hf_config().items() if k not in ("architectures", "torch_dtype")})
    hc._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(hc, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    with torch.no_grad():
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        for p in layer.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.1)
    fc = torch.nn.Linear(2 * H, H, bias=True)
    rot = LlamaRotaryEmbedding(hc)
    emb, feat = torch.randn(2, T, H), torch.randn(2, T, H)
    pos = torch.arange(T)[None].repeat(2, 1) + torch.tensor([[0], [5]])
    with torch.no_grad():
        x = fc(torch.cat([emb, feat], -1))
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rot(x, pos))
    sd = {"fc.weight": fc.weight, "fc.bias": fc.bias, **{f"layers.0.{k}": v for k, v in layer.state_dict().items()}}
    sd = {k: v.detach().numpy().copy() for k, v in sd.items()}
    folder = tmp_path_factory.mktemp("eagle_head")
    with open(folder / "config.json", "w") as f:
        json.dump(hf_config(), f)
    save_file(dict(sd, **{"embed_tokens.weight": np.zeros((V, H), np.float32)}), str(folder / "model.safetensors"))
    return dict(emb=emb.numpy(), feat=feat.numpy(), pos=pos.numpy(), out=out.numpy(), sd=sd, folder=str(folder))


def test_forward_matches_torch_reference(reference):
    cfg, params = head_weights.load_eagle_head(reference["folder"], dtype="float32")
    assert cfg.num_layers == 1 and params.layers[0].input_norm is None
    mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(2, 0)
    h, k, v = eagle.forward(params, cfg, jnp.asarray(reference["emb"]), jnp.asarray(reference["feat"]),
                            jnp.asarray(reference["pos"], jnp.int32), layers.CacheAttend(mask))
    np.testing.assert_allclose(np.asarray(h), reference["out"], atol=1e-4, rtol=1e-4)
    assert k.shape == (1, 2, T, K, H // N)
    # The generic draft adapter computes the same thing.
    tcfg = tiny_config(vocab=V, hidden=H)
    d = draft_lib.make_draft("EAGLE", cfg, params, np_init(target.param_shapes(tcfg), 0, 0.1))
    h2, _, _ = draft_lib.forward(d, jnp.asarray(reference["emb"]), jnp.asarray(reference["feat"]),
                                 jnp.asarray(reference["pos"], jnp.int32),
                                 lambda i, q, kk, vv: layers.attention(q, kk, vv, mask, sm_scale=(H // N) ** -0.5))
    np.testing.assert_allclose(np.asarray(h2), reference["out"], atol=1e-4, rtol=1e-4)


def test_round_trip_and_loader_variants(reference, tmp_path):
    cfg, params = head_weights.load_eagle_head(reference["folder"], dtype="float32")
    back = head_weights.params_to_hf(params, cfg)
    assert set(back) == set(reference["sd"])
    for k, a in back.items():
        np.testing.assert_array_equal(a, reference["sd"][k])
    # pytorch_model.bin (read with weights_only=True) and a "model." prefix.
    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    torch.save({f"model.{k}": torch.from_numpy(v) for k, v in reference["sd"].items()}, tmp_path / "pytorch_model.bin")
    _, p2 = head_weights.load_eagle_head(str(tmp_path), dtype="float32")
    np.testing.assert_array_equal(np.asarray(p2.fc), np.asarray(params.fc))
    # An unknown tensor, a missing one, and a wrong shape are refused by name.
    bad = dict(reference["sd"], **{"layers.0.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(eagle.EagleHeadError, match="extra"):
        head_weights.params_from_hf(bad, cfg)
    with pytest.raises(eagle.EagleHeadError, match="fc.bias"):
        head_weights.params_from_hf({k: v for k, v in reference["sd"].items() if k != "fc.bias"}, cfg)
    with pytest.raises(eagle.EagleHeadError, match="shape"):
        head_weights.params_from_hf(dict(reference["sd"], **{"fc.bias": np.zeros(3, np.float32)}), cfg)
    with pytest.raises(eagle.EagleHeadError, match="EAGLE3"):
        eagle.config_from_hf(dict(hf_config(), architectures=["LlamaForCausalLMEagle3"]))


class NotATensor:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_token_map_formats_and_safe_loading(tmp_path):
    ids = [5, 1, 9, 3]
    (tmp_path / "m.json").write_text(json.dumps(ids))
    np.save(tmp_path / "m.npy", np.asarray(ids, np.int64))
    torch.save(torch.tensor(ids), tmp_path / "m.pt")
    torch.save(ids, tmp_path / "list.pt")
    for name in ("m.json", "m.npy", "m.pt", "list.pt"):
        np.testing.assert_array_equal(head_weights.load_token_map(str(tmp_path / name), vocab_size=16), ids)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(NotATensor(), f, protocol=2)
    with pytest.raises(eagle.EagleHeadError, match="refused"):
        head_weights.load_token_map(str(tmp_path / "evil.pt"))
    with pytest.raises(eagle.EagleHeadError, match="outside"):
        head_weights.load_token_map(str(tmp_path / "m.json"), vocab_size=8)
    (tmp_path / "dup.json").write_text(json.dumps([1, 1]))
    with pytest.raises(eagle.EagleHeadError, match="repeats"):
        head_weights.load_token_map(str(tmp_path / "dup.json"))


def test_load_draft_eagle_with_token_map(reference, tmp_path):
    tcfg = tiny_config(vocab=V, hidden=H)
    hot = [7, 3, 60, 12, 0]
    (tmp_path / "hot.json").write_text(json.dumps(hot))
    cfg, params, ids = head_weights.load_draft(reference["folder"], "EAGLE", tcfg,
                                               token_map=str(tmp_path / "hot.json"))
    np.testing.assert_array_equal(ids, hot)
    tp = np_init(target.param_shapes(tcfg), 0, 0.1)
    d = draft_lib.make_draft("EAGLE", cfg, params, tp, ids)
    assert d.lm_head.shape == (H, len(hot))
    np.testing.assert_array_equal(np.asarray(d.lm_head), np.asarray(tp.lm_head)[:, hot])


def test_eagle_head_of_another_target_or_config_refused(reference, tmp_path, capsys):
    """A head config without a required field is one line naming it (was a KeyError); a head of another vocab, or
    with an embedding table of another shape, is refused (the head reads the target's embedding and lm_head, so it
    used to load and serve at near-zero acceptance); import-head / export-head say what to do with an EAGLE head."""
    tcfg = tiny_config(vocab=V, hidden=H)

    def variant(name, config=None, tensors=None):
        folder = tmp_path / name
        shutil.copytree(reference["folder"], folder)
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config))
        if tensors is not None:
            save_file(tensors, str(folder / "model.safetensors"))
        return str(folder)

    no_field = variant("no_vocab", config={k: v for k, v in hf_config().items() if k != "vocab_size"})
    with pytest.raises(eagle.EagleHeadError, match="lacks the field 'vocab_size'"):
        head_weights.load_draft(no_field, "EAGLE", tcfg)
    other_vocab = variant("v2", config=dict(hf_config(), vocab_size=2 * V),
                          tensors=dict(reference["sd"], **{"embed_tokens.weight": np.zeros((2 * V, H), np.float32)}))
    with pytest.raises(eagle.EagleHeadError, match="trained for another target"):
        head_weights.load_draft(other_vocab, "EAGLE", tcfg)
    small_table = variant("table", tensors=dict(reference["sd"], **{"embed_tokens.weight": np.zeros((3, H),
                                                                                                   np.float32)}))
    with pytest.raises(eagle.EagleHeadError, match="another target's head"):
        head_weights.load_draft(small_table, "EAGLE", tcfg)
    for argv in (["import-head", reference["folder"], str(tmp_path / "o1"), "--target", "unused"],
                 ["export-head", reference["folder"], str(tmp_path / "o2")]):
        assert convert_main(argv[0], argv[1:]) == 2
        assert "is an EAGLE-1/2 head" in capsys.readouterr().err


def test_load_draft_eagle3_uses_the_head_importer(tmp_path):
    from specjax.convert.head import export_head
    tcfg = tiny_config()
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=32, dtype="float32")
    params = np_init(eagle3.param_shapes(hcfg), 3, 0.1)
    vmap = eagle3.VocabMap.from_used_ids(np.arange(0, 64, 2), 64)
    export_head(params, hcfg, vmap, str(tmp_path / "head"), tcfg)
    cfg, p2, vm2 = head_weights.load_draft(str(tmp_path / "head"), "EAGLE3", tcfg)
    assert cfg.draft_vocab_size == 32
    np.testing.assert_array_equal(np.asarray(vm2.d2t), np.asarray(vmap.d2t))
    np.testing.assert_allclose(np.asarray(p2.fc), np.asarray(params.fc))
    d = draft_lib.make_draft("EAGLE3", cfg, p2, None, vm2)
    np.testing.assert_array_equal(np.asarray(d.ids), np.arange(0, 64, 2))
