"""Parity with Hugging Face transformers on tiny random models of every supported family (fp32): full-sequence
logits, cached prefill + decode, greedy generation and the EAGLE3 aux features."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny_models import TINY, VOCAB, build, hf_config

from specjax import kv_cache, layers, plain_step as decode
from specjax.config import ConfigError, ModelConfig, default_aux_layer_ids
from specjax.generate import generate
from specjax.models import target
from specjax.weights import load_model

SEQ = 20  # longer than mistral's sliding window (8) and llama3's original context (16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Builds each family's model on first use: name -> (name, HF torch model, specjax cfg, specjax params)."""
    cache = {}

    def get(name):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            hf = build(name, folder)
            cfg, params = load_model(str(folder), dtype="float32")
            cache[name] = (name, hf, cfg, params)
        return cache[name]
    return get


@pytest.fixture(params=list(TINY))
def model(request, models):
    return models(request.param)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(3, VOCAB, size=(2, SEQ)).astype(np.int32)


@jax.jit
def _positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


_forward = jax.jit(lambda params, cfg, tokens, aux: target.forward(params, cfg, tokens, _positions(tokens),
                                                                     aux_layers=aux),
                   static_argnums=(1, 3))
_prefill = jax.jit(decode.prefill, static_argnames=("cfg",), donate_argnames=("cache",))
_decode = jax.jit(decode.decode, static_argnames=("cfg",), donate_argnames=("cache",))


def _hf(hf, tokens):
    with torch.no_grad():
        out = hf(torch.as_tensor(np.asarray(tokens), dtype=torch.long), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def test_config_switches(model):
    name, _, cfg, params = model
    assert cfg.qkv_bias == (name == "qwen2") and (params.layers.bq is not None) == cfg.qkv_bias
    assert cfg.qk_norm == (name == "qwen3")
    assert (params.lm_head is None) == (name == "llama3_tied")
    if name == "qwen3":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    if name == "llama3_tied":
        assert cfg.rope_scaling_dict["rope_type"] == "llama3"
    if name == "mistral":
        assert cfg.sliding_window == 8


def test_logits_match_hf(model, tokens):
    _, hf, cfg, params = model
    want, _ = _hf(hf, tokens)
    got = np.asarray(_forward(params, cfg, jnp.asarray(tokens), ()).logits)  # same compile as the aux test
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_cached_prefill_and_decode_match_full_forward(model, tokens):
    """Right-padded prefill of prompts of different lengths, then one token at a time through the paged cache
    (page size 4, so the steps cross pages), must give the full forward's logits at every position."""
    _, _, cfg, params = model
    full = np.asarray(_forward(params, cfg, jnp.asarray(tokens), ()).logits)  # [B, SEQ, V]
    lens = np.array([7, 12])
    valid = np.arange(SEQ)[None, :12] < lens[:, None]
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, SEQ, page_size=4,
                                dtype=jnp.float32)
    cache, out = _prefill(params, cfg, cache, jnp.asarray(np.where(valid, tokens[:, :12], 0)), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(out.logits), full[[0, 1], lens - 1], atol=1e-4, rtol=0)
    pos = lens.copy()
    for _ in range(6):
        active = pos < SEQ
        cache, logits = _decode(params, cfg, cache, jnp.asarray(tokens[[0, 1], np.minimum(pos, SEQ - 1)]),
                                jnp.asarray(active))
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1], np.minimum(pos, SEQ - 1)], atol=1e-4, rtol=0)
        pos = pos + active
    assert np.asarray(cache.lengths).tolist() == pos.tolist()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_long_prompt_attended_in_causal_chunks_matches_hf(models, name):
    """A prompt longer than 2 * QUERY_CHUNK_MIN is attended by chunks of queries that skip the keys the causal mask
    hides (``layers.query_chunks``; mistral's window masks more). The full forward and a right-padded paged prefill
    (rows of two lengths) still give HF's logits."""
    _, hf, cfg, params = models(name)
    t = 2 * layers.QUERY_CHUNK_MIN + 44
    assert [e for _, _, e in layers.query_chunks(t, t, True)] == [128, 256, t]
    toks = np.random.default_rng(1).integers(3, VOCAB, size=(2, t)).astype(np.int32)
    want, _ = _hf(hf, toks)
    got = np.asarray(_forward(params, cfg, jnp.asarray(toks), ()).logits)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    lens = np.array([t - 37, t])
    valid = np.arange(t)[None, :] < lens[:, None]
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, t, dtype=jnp.float32)
    _, out = _prefill(params, cfg, cache, jnp.asarray(np.where(valid, toks, 0)), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(out.logits), want[[0, 1], lens - 1], atol=1e-4, rtol=0)


# The generation loop is family-agnostic (the per-family decode path is checked above); run it end to end on the
# models whose decode differs most: 8 layers, a sliding window shorter than the output, and head_dim != D / N.
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_greedy_generate_matches_hf(models, name):
    """A batch of prompts of different lengths (right-padded) vs HF generate per prompt, unpadded."""
    _, hf, cfg, params = models(name)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 9, 5)]

    def hf_generate(stop):
        with torch.no_grad():
            return [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=list(stop),
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]

    ref = hf_generate([2])
    assert generate(params, cfg, prompts, max_new_tokens=12, page_size=8) == ref
    # Make the second prompt stop early on its 4th token: rows of one batch then end at different steps.
    stop = (2, ref[1][3])
    ref = hf_generate(stop)
    assert len(ref[1]) <= 4 and ref[1][-1] in stop
    assert generate(params, cfg, prompts, max_new_tokens=12, page_size=8, stop_token_ids=stop) == ref


def test_generate_prefills_long_prompts_in_chunks_like_hf(models):
    """Prompts over PREFILL_CHUNK tokens are prefilled in chunks (``batching.prefill_chunks``, as speculative
    decoding does): a row ending in the first chunk and one ending in the second still give HF's greedy tokens."""
    from specjax.batching import PREFILL_CHUNK, prefill_chunks
    _, hf, cfg, params = models("llama")
    n = PREFILL_CHUNK + 88
    assert prefill_chunks(n) == (PREFILL_CHUNK, 2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, size=k).tolist() for k in (n, 300)]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, eos_token_id=[2],
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert generate(params, cfg, prompts, max_new_tokens=6) == ref


def _layer_outputs(hf, tokens):
    """Raw (un-normed) output of every decoder layer via forward hooks (HF's last hidden_states entry is normed)."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o).numpy()))
             for layer in hf.model.layers]
    try:
        _hf(hf, tokens)
    finally:
        for h in hooks:
            h.remove()
    return outs


def _aux_reference(hf, tokens, ids):
    _, hidden = _hf(hf, tokens)
    n = len(hf.model.layers)
    raw = _layer_outputs(hf, tokens)
    # HF hidden_states[i + 1] is the output of layer i, except the last entry, which has the final norm applied.
    refs = [hidden[i + 1] if i + 1 < n else raw[i] for i in ids]
    return np.concatenate(refs, axis=-1)


def test_aux_features_default_ids(model, tokens):
    _, hf, cfg, params = model
    ids = default_aux_layer_ids(cfg.num_layers)
    if cfg.num_layers == 8:
        assert ids == (1, 3, 4)
    got = np.asarray(_forward(params, cfg, jnp.asarray(tokens), ()).aux)
    assert got.shape == (2, SEQ, 3 * cfg.hidden_size)
    np.testing.assert_allclose(got, _aux_reference(hf, tokens, ids), atol=1e-4, rtol=0)


def test_aux_features_custom_ids(model, tokens):
    _, hf, cfg, params = model
    ids = (cfg.num_layers - 2, 0, cfg.num_layers - 1)  # any order, last layer included
    got = np.asarray(_forward(params, cfg, jnp.asarray(tokens), ids).aux)
    np.testing.assert_allclose(got, _aux_reference(hf, tokens, ids), atol=1e-4, rtol=0)


def test_unsupported_architecture(tmp_path):
    import transformers
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    gpt2.save_pretrained(str(tmp_path))  # config only: no "architectures", just model_type "gpt2"
    with pytest.raises(ConfigError, match=r"unsupported architecture 'gpt2'; specjax supports .*LlamaForCausalLM"):
        ModelConfig.from_pretrained(str(tmp_path))
    gpt2.architectures = ["GPT2LMHeadModel"]  # as in a real checkpoint
    gpt2.save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*GPT2LMHeadModel.*supports"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("rope", [dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
                                  dict(rope_type="dynamic", factor=2.0)])
def test_unsupported_rope_type(tmp_path, rope):
    hf_config("llama", rope_scaling=rope).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match=f"rope.*{rope['rope_type']}.*not supported"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_config_refusals_name_the_field():
    """Settings specjax would get wrong are refused at load in one line: a llama3 rope without its original context
    (was a KeyError at the first forward), attention_bias on Qwen3 (was blamed on "the wrong config.json" by the
    weights check), a dtype of "auto" (says to pass --dtype)."""
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                torch_dtype="float32")
    with pytest.raises(ConfigError, match="rope_scaling of type 'llama3' lacks original_max_position_embeddings"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling=dict(rope_type="llama3", factor=8.0)))
    with pytest.raises(ConfigError, match="lacks factor"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling=dict(type="linear")))
    qwen3 = dict(base, architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=True)
    with pytest.raises(ConfigError, match="attention_bias=true is not supported"):
        ModelConfig.from_hf_dict(qwen3)
    with pytest.raises(ConfigError, match="unsupported dtype 'auto'.*pass --dtype"):
        ModelConfig.from_hf_dict(dict(base, torch_dtype="auto"))
    assert ModelConfig.from_hf_dict(dict(base, torch_dtype="auto"), dtype="float32").dtype == "float32"
