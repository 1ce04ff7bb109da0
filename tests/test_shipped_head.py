"""The EAGLE3 head shipped in the package (specjax/heads/): its files are what ``LlamaForCausalLMEagle3`` loaders
(SGLang, vLLM) expect, it carries a valid tuned tree table, and with the real SmolLM2 it is accepted for several
tokens per step while speculative greedy output stays identical to plain greedy output (the full 80 MT-bench
prompts run in ``python -m specjax.bench tune``; docs/benchmarks.md)."""

import json
import os

import numpy as np
import pytest
from real_model import smollm2_path

from specjax.heads import DEFAULT_HEAD
from specjax.safetensors_io import SafetensorsFile
from specjax.speculative import tune as tune_lib

# SmolLM2-135M-Instruct: hidden 576, 9 heads x 64, 3 kv heads, FFN 1536, vocab 49,152, 30 layers
H, NQ, NKV, HD, FF, V = 576, 9, 3, 64, 1536, 49152


def test_shipped_head_files_match_the_published_format():
    cfg = json.loads(open(os.path.join(DEFAULT_HEAD, "config.json")).read())
    vd = cfg["draft_vocab_size"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"],
            cfg["vocab_size"], cfg["num_hidden_layers"]) == (H, NQ, NKV, FF, V, 1)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert "eagle_config" not in cfg  # default aux layers {1, L//2-1, L-4} are not written
    path = os.path.join(DEFAULT_HEAD, "model.safetensors")
    assert os.path.getsize(path) <= 30e6
    sf = SafetensorsFile(path)
    want = {"fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
            "midlayer.self_attn.q_proj.weight": (NQ * HD, 2 * H), "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * H),
            "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * H), "midlayer.self_attn.o_proj.weight": (H, NQ * HD),
            "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (FF, H),
            "midlayer.mlp.up_proj.weight": (FF, H), "midlayer.mlp.down_proj.weight": (H, FF), "norm.weight": (H,),
            "lm_head.weight": (vd, H), "d2t": (vd,), "t2d": (V,)}
    assert {k: sf.shape(k) for k in sf.keys()} == want
    assert sf.header["d2t"]["dtype"] == "I64" and sf.header["t2d"]["dtype"] == "BOOL"
    assert {sf.header[k]["dtype"] for k in want if k not in ("d2t", "t2d")} == {"BF16"}
    d2t, t2d = sf.tensor("d2t"), sf.tensor("t2d")
    used = np.arange(vd) + d2t
    assert t2d.sum() == vd and t2d[used].all() and (np.diff(used) > 0).all()
    for k in want:
        if k not in ("d2t", "t2d"):
            assert np.isfinite(sf.tensor(k).astype(np.float32)).all(), k
    table = tune_lib.load_tune(DEFAULT_HEAD)
    assert table and 1 in table


@pytest.fixture(scope="module")
def smollm2_pair():
    path = smollm2_path()
    from specjax.generate import load_tokenizer
    from specjax.head_weights import load_draft
    from specjax.speculative.draft import make_draft
    from specjax.weights import load_model
    cfg, params = load_model(path, dtype="float32")
    dcfg, dparams, vocab = load_draft(DEFAULT_HEAD, "EAGLE3", cfg)
    return path, cfg, params, make_draft("EAGLE3", dcfg, dparams, params, vocab), load_tokenizer(path)


def test_fp32_draft_keeps_its_bf16_matrices_and_computes_the_fp32_products(smollm2_pair):
    """Under an fp32 target the head's bf16 matrices stay bf16 (half the bytes a draft step reads) and its norms
    and activations are fp32: every output is bit for bit the one of the head widened to fp32 (widening is exact)."""
    import jax
    import jax.numpy as jnp

    from specjax.kernels import cpu_dense
    from specjax.models import eagle3
    _, cfg, _, draft, _ = smollm2_pair
    p = draft.params
    lp = p.layers[0]
    assert {a.dtype for a in (p.fc, p.lm_head, lp.wq, lp.wk, lp.wv, lp.wo, lp.w_gate, lp.w_up, lp.w_down)} == {
        jnp.dtype(jnp.bfloat16)}
    assert {a.dtype for a in (p.norm, lp.input_norm, lp.hidden_norm, lp.post_norm)} == {jnp.dtype(jnp.float32)}
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    rng = np.random.default_rng(0)
    aux = jnp.asarray(rng.standard_normal((1, 4, 3 * H)), jnp.float32)
    emb = jnp.asarray(rng.standard_normal((1, 4, H)) * 0.05, jnp.float32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]

    @jax.jit
    def run(params):  # attention stood in for by q itself: every matrix of the head is used once
        feat = eagle3.project_aux(params, aux)
        h, k, v = eagle3.forward(params, draft.cfg, emb, feat, positions, lambda i, q, kk, vv: q)
        return feat, h, k, v, eagle3.draft_logits(params, draft.cfg, h)

    if cpu_dense.available():  # the mixed products run in the kernels, reading the bf16 matrices as they are
        assert run.lower(p).as_text().count("specjax_dense") >= 9
    for got, want in zip(run(p), run(wide)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prefill_draft_widens_the_bf16_matrices_once(smollm2_pair):
    """A prefill's many-row products take the head's matrices widened once (``draft.for_prefill``; XLA converted
    each on every call), with the same values; what a prefill does not read stays bf16 (the draft vocab head, and
    the last layer's q, o and MLP: a prefill writes that layer's K/V only), and a head with nothing narrower is
    returned as is."""
    import jax
    import jax.numpy as jnp

    from specjax.kernels import cpu_dense
    from specjax.speculative.draft import for_prefill
    _, _, _, draft, _ = smollm2_pair
    wide = for_prefill(draft)
    p, w = draft.params, wide.params
    assert w.lm_head is p.lm_head and w.norm is p.norm
    # on a CPU with the kernels the head's matrices are panels (``draft.pack_head``), widened as panels
    unpacked = lambda a: a.unpack() if isinstance(a, cpu_dense.PackedWeight) else a
    assert isinstance(p.lm_head, cpu_dense.PackedWeight) == cpu_dense.packable(unpacked(p.lm_head))
    assert len(p.layers) == 1
    for name in ("wk", "wv"):
        a, b = getattr(p.layers[0], name), getattr(w.layers[0], name)
        assert b.dtype == jnp.float32 and b.shape == a.shape, name
        np.testing.assert_array_equal(np.asarray(unpacked(b)), np.asarray(unpacked(a).astype(jnp.float32)))
    for name in ("wq", "wo", "w_gate", "w_up", "w_down"):
        assert getattr(w.layers[0], name) is getattr(p.layers[0], name), name
    assert w.fc.dtype == jnp.float32 and wide.ids is draft.ids and wide.cfg == draft.cfg
    assert for_prefill(wide) is wide
    all_fp32 = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, draft)
    assert for_prefill(all_fp32) is all_fp32


def test_shipped_head_is_lossless_and_accepted_on_mtbench(smollm2_pair):
    from specjax.bench.spec import load_prompts
    from specjax.generate import generate
    from specjax.speculative.spec_generate import speculative_generate
    from specjax.weights import stop_token_ids
    path, cfg, params, draft, tok = smollm2_pair
    try:
        prompts, _ = load_prompts("mtbench", tok, 3, cfg.vocab_size)
    except SystemExit as e:
        pytest.skip(str(e))
    steps, topk, ndraft = tune_lib.shape_for(tune_lib.load_tune(DEFAULT_HEAD), 1) or (5, 1, 6)
    stop = stop_token_ids(path, cfg, tok)
    plain = generate(params, cfg, prompts, max_new_tokens=48, stop_token_ids=stop)
    spec, stats = speculative_generate(params, cfg, draft, prompts, num_steps=steps, topk=topk,
                                       num_draft_tokens=ndraft, max_new_tokens=48, stop_token_ids=stop)
    assert spec == plain
    assert stats["tau"] > 1.3, stats["tau"]  # measured 1.44 at (5,4,8); an untrained head gets ~1.02-1.05


@pytest.mark.xla_defaults
def test_bf16_speculation_is_bf16_plain_greedy_bit_for_bit():
    """In bf16, where rounding turns any difference in a row's arithmetic into a different greedy token within a
    few dozen tokens, a chain verify reads its keys back from the pool (``target.forward(keys_in_pool=...)``) and
    every reduction runs in a fixed order (``layers.row_sum``): EAGLE3 at (3,1,4) and (5,4,8) emits plain bf16
    greedy's tokens."""
    from specjax.bench.spec import load_prompts, prompt_texts
    from specjax.generate import encode_prompts, generate, load_tokenizer
    from specjax.head_weights import load_draft
    from specjax.speculative.draft import make_draft
    from specjax.speculative.spec_generate import speculative_generate
    from specjax.weights import load_model, stop_token_ids
    path = smollm2_path()
    cfg, params = load_model(path, dtype="bfloat16")  # stacked, as the CLI loads them: each call unstacks them
    tok = load_tokenizer(path)
    try:
        prompts, _ = load_prompts("mtbench", tok, 3, cfg.vocab_size)
        texts, _, _ = prompt_texts("mtbench", 19)
    except SystemExit as e:
        pytest.skip(str(e))
    dcfg, dparams, vocab = load_draft(DEFAULT_HEAD, "EAGLE3", cfg)
    draft = make_draft("EAGLE3", dcfg, dparams, params, vocab)
    stop = stop_token_ids(path, cfg, tok)
    # MT-bench's third turn parted after 8 tokens when a verify row's attention summed the tree's keys apart; the
    # README's prompt after 40 when ``generate`` unstacked stacked params inside jit. The two run as one batch (a
    # row's bits do not depend on the rows beside it; one compile of each program).
    # The long prompt (843 tokens) gave another first token when ``generate`` prefilled it in one call and
    # ``speculative_generate`` in 512-token chunks (``batching.prefill_chunks`` now serves both).
    long = "Here are some questions.\n\n" + "\n\n".join(texts[6:19]) + "\n\nAnswer only the last one."
    short = [prompts[2]] + encode_prompts(tok, ["Explain how a binary search works."], chat=True)
    (long,) = encode_prompts(tok, [long], chat=True)
    assert len(long) > 512
    # A tree (5,4,8) too: its nodes read their ancestors from the forward's own K/V (their bits are pinned by
    # tests/test_decode_layout.py; before the kernel summed them where a decode step finds them, 4-7 of 16 bf16
    # MT-bench answers of 256 tokens parted from plain greedy, though not these two within 48 tokens).
    plain_short = generate(params, cfg, short, max_new_tokens=48, stop_token_ids=stop)
    for batch, new, shape in ((short, 48, (3, 1, 4)), (short, 48, (5, 4, 8)), ([long], 1, (3, 1, 4))):
        plain = plain_short if batch is short else generate(params, cfg, batch, max_new_tokens=new,
                                                            stop_token_ids=stop)
        spec, stats = speculative_generate(params, cfg, draft, batch, num_steps=shape[0], topk=shape[1],
                                           num_draft_tokens=shape[2], max_new_tokens=new, stop_token_ids=stop)
        assert spec == plain, shape
        assert new < 48 or stats["tau"] > 1.1, stats["tau"]
