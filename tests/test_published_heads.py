"""EAGLE3 heads as they are published, loaded unchanged (../shared/specs/eagle.md: "a head that they publish must
load in specjax unchanged"): vLLM speculators' layout (nested ``transformer_layer_config``, ``layers.0.*``,
``embed_tokens``, top-level aux ids in vLLM's convention, ``norm_before_residual``) against a PyTorch reference of
that layer built from transformers' Llama modules; the official EAGLE3 file (``pytorch_model.bin``); Model
Optimizer's (``d2t`` without ``t2d``); hub ids as the draft path; what the export writes for non-default layers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax import head_weights, layers
from specjax.config import ModelConfig
from specjax.models import eagle3
from specjax.safetensors_io import save_file

H, F, N, K, V, VD, T, L = 64, 96, 4, 2, 128, 48, 6, 8


def _target() -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F,
        num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32", hidden_act="silu"))


def _layer_config():
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": F, "num_attention_heads": N,
            "num_key_value_heads": K, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "vocab_size": V, "hidden_act": "silu", "head_dim": H // N}


def _speculators_config(norm_before_residual: bool, aux_ids=(2, 4, 5)):
    """As vLLM speculators writes it (Eagle3SpeculatorConfig): the layer under transformer_layer_config, aux ids at
    the top level in vLLM's convention (the layer whose input is captured)."""
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size": VD,
            "norm_before_residual": norm_before_residual, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(aux_ids), "torch_dtype": "float32",
            "transformer_layer_config": _layer_config(),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "t"}}}


def _torch_head(norm_before_residual: bool, seed: int = 0):
    """A torch EAGLE3 midlayer as vLLM / speculators run it (transformers' Llama attention with 2H inputs, its MLP
    and norms), its output for random inputs, and its tensors under speculators' key names."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)
    hc = LlamaConfig(**{k: v for k, v in _layer_config().items() if k != "model_type"})
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = LlamaAttention(hc, layer_idx=0)
    attn.q_proj, attn.k_proj = torch.nn.Linear(2 * H, N * H // N, bias=False), torch.nn.Linear(2 * H, K * H // N,
                                                                                              bias=False)
    attn.v_proj = torch.nn.Linear(2 * H, K * H // N, bias=False)
    mlp, norms = LlamaMLP(hc), {n: LlamaRMSNorm(H, eps=1e-5) for n in ("input", "hidden", "post", "final")}
    with torch.no_grad():
        for m in [attn, mlp, *norms.values()]:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape) * 0.1 if p.ndim == 2 else torch.rand(p.shape) + 0.5)
    emb, h = torch.randn(2, T, H), torch.randn(2, T, H) * 3
    pos = torch.arange(T)[None].repeat(2, 1) + torch.tensor([[0], [5]])
    with torch.no_grad():
        hn = norms["hidden"](h)
        x = torch.cat([norms["input"](emb), hn], -1)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        a, _ = attn(x, position_embeddings=LlamaRotaryEmbedding(hc)(x, pos), attention_mask=mask)
        h1 = (hn if norm_before_residual else h) + a
        out = h1 + mlp(norms["post"](h1))
    sd = {"fc.weight": torch.randn(H, 3 * H) * 0.1, "norm.weight": norms["final"].weight,
          "lm_head.weight": torch.randn(VD, H) * 0.1, "embed_tokens.weight": torch.zeros(V, H),
          "layers.0.input_layernorm.weight": norms["input"].weight,
          "layers.0.hidden_norm.weight": norms["hidden"].weight,
          "layers.0.post_attention_layernorm.weight": norms["post"].weight,
          **{f"layers.0.self_attn.{k}": v for k, v in attn.state_dict().items()},
          **{f"layers.0.mlp.{k}": v for k, v in mlp.state_dict().items()}}
    used = np.sort(np.random.default_rng(seed).choice(V, VD, replace=False))
    sd = {k: v.detach().numpy().copy() for k, v in sd.items()}
    sd["d2t"], sd["t2d"] = (used - np.arange(VD)).astype(np.int64), np.isin(np.arange(V), used)
    return dict(emb=emb.numpy(), h=h.numpy(), pos=pos.numpy(), out=out.numpy(), sd=sd)


def _write(folder, config: dict, tensors: dict, as_bin: bool = False) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                   str(folder / "pytorch_model.bin"))
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_speculators_head_matches_torch_reference(tmp_path, norm_before_residual):
    ref = _torch_head(norm_before_residual)
    folder = _write(tmp_path / "spec", _speculators_config(norm_before_residual), ref["sd"])
    cfg, params, vmap = head_weights.load_draft(folder, "EAGLE3", _target(), dtype="float32")
    assert cfg.norm_before_residual is norm_before_residual and cfg.draft_vocab_size == VD
    assert cfg.aux_layer_ids == (1, 3, 4)  # vLLM's [2, 4, 5]: the inputs of those layers, the outputs of 1, 3, 4
    np.testing.assert_array_equal(np.asarray(vmap.t2d), ref["sd"]["t2d"])
    mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(2, 0)
    out, _, _ = eagle3.forward(params, cfg, jnp.asarray(ref["emb"]), jnp.asarray(ref["h"]),
                               jnp.asarray(ref["pos"], jnp.int32), layers.CacheAttend(mask))
    np.testing.assert_allclose(np.asarray(out), ref["out"], atol=2e-4, rtol=2e-4)
    other = _torch_head(not norm_before_residual)["out"]  # the flag matters: the other variant is far off
    assert np.abs(other - ref["out"]).max() > 1e-2


def test_speculators_export_round_trip_keeps_the_variant(tmp_path):
    """A speculators head exported by specjax carries norm_before_residual (SGLang and vLLM read it) and its aux
    layers both ways (eagle_config for SGLang, the top-level field in vLLM's convention), and reads back the same."""
    ref = _torch_head(True)
    tcfg = _target()
    src = _write(tmp_path / "spec", _speculators_config(True, aux_ids=(3, 5, 7)), ref["sd"])
    cfg, params, vmap = head_weights.load_eagle3_head(src, tcfg, dtype="float32")
    assert cfg.aux_layer_ids == (2, 4, 6)
    hf = head_weights.export_head(params, cfg, vmap, str(tmp_path / "out"), tcfg, dtype="float32")
    assert hf["norm_before_residual"] is True and hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [3, 5, 7]
    cfg2, params2, _ = head_weights.load_eagle3_head(str(tmp_path / "out"), tcfg, dtype="float32")
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(params2.fc), np.asarray(params.fc))


def test_official_bin_and_model_optimizer_heads_load(tmp_path):
    """The official EAGLE3 heads ship pytorch_model.bin (fp16; yuhuili/EAGLE3-LLaMA3.1-Instruct-8B); Model
    Optimizer's exports hold d2t without t2d (SGLang and vLLM read d2t alone): both load as the safetensors head."""
    ref = _torch_head(False, seed=1)
    tcfg = _target()
    flat = dict(_layer_config(), architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD,
                torch_dtype="float16")
    mid = {k.replace("layers.0.", "midlayer."): v for k, v in ref["sd"].items() if k != "embed_tokens.weight"}
    want_cfg, want, want_vm = head_weights.load_eagle3_head(_write(tmp_path / "st", flat, mid), tcfg,
                                                           dtype="float32")
    fp16 = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in mid.items()}
    got_cfg, got, got_vm = head_weights.load_eagle3_head(_write(tmp_path / "bin", flat, fp16, as_bin=True), tcfg,
                                                        dtype="float32")
    assert got_cfg == want_cfg
    np.testing.assert_array_equal(np.asarray(got.fc), np.asarray(want.fc).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got_vm.t2d), np.asarray(want_vm.t2d))
    no_t2d = {k: v for k, v in mid.items() if k != "t2d"}
    _, _, mo_vm = head_weights.load_eagle3_head(_write(tmp_path / "mo", flat, no_t2d), tcfg, dtype="float32")
    np.testing.assert_array_equal(np.asarray(mo_vm.t2d), ref["sd"]["t2d"])
    np.testing.assert_array_equal(np.asarray(mo_vm.d2t), np.asarray(want_vm.d2t))
    no_t2d["d2t"] = no_t2d["d2t"] + V  # ids past the target's vocab
    with pytest.raises(head_weights.HeadFormatError, match="outside the target vocab"):
        head_weights.load_eagle3_head(_write(tmp_path / "bad", flat, no_t2d), tcfg, dtype="float32")


def test_unsupported_speculators_options_are_refused(tmp_path):
    ref = _torch_head(False)
    config = dict(_speculators_config(True), norm_before_fc=True)
    folder = _write(tmp_path / "nbf", config, dict(ref["sd"], **{"input_norm.weight": np.ones(3 * H, np.float32)}))
    with pytest.raises(head_weights.HeadFormatError, match="norm_before_fc=true .* not supported"):
        head_weights.load_draft(folder, "EAGLE3", _target())


def test_hub_id_draft_paths_are_downloaded(tmp_path, monkeypatch):
    """--speculative-draft-model-path takes a hub id, as SGLang's and vLLM's do: its config, safetensors and
    pytorch_model*.bin are fetched into the hub cache; a local path is never sent to the hub."""
    ref = _torch_head(True)
    folder = _write(tmp_path / "spec", _speculators_config(True), ref["sd"])
    asked = []
    monkeypatch.setattr(head_weights, "hub_snapshot", lambda repo, patterns: asked.append((repo, patterns)) or folder)
    cfg, _, _ = head_weights.load_draft("RedHatAI/Some-speculator.eagle3", "EAGLE3", _target(), dtype="float32")
    assert cfg.norm_before_residual and asked == [("RedHatAI/Some-speculator.eagle3",
                                                   ("*.json", "*.safetensors", "pytorch_model*.bin"))]
    with pytest.raises(head_weights.HeadFormatError, match="not an EAGLE3 head folder"):
        head_weights.load_draft(str(tmp_path / "nothing"), "EAGLE3", _target())
    assert len(asked) == 1

    def offline(repo, patterns):
        raise head_weights.WeightsError("LocalEntryNotFoundError: offline")
    monkeypatch.setattr(head_weights, "hub_snapshot", offline)
    with pytest.raises(head_weights.HeadFormatError, match="hub could not provide it .*offline.*local folder"):
        head_weights.load_draft("owner/missing-head", "EAGLE3", _target())
