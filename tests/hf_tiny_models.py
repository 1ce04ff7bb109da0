"""Tiny random Hugging Face models (built with transformers, saved with save_pretrained) for parity tests."""

from __future__ import annotations

import copy

import torch

torch.set_num_threads(1)

VOCAB = 128

# name -> (config class name, config kwargs). Every family switch specjax has is covered by at least one entry.
TINY = {
    # untied, default rope, 8 layers so that the EAGLE3 default aux ids are the real formula (1, 3, 4)
    "llama": ("LlamaConfig", dict(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)),
    # tied embeddings + Llama-3.1 rope scaling (original context 16 so that short test sequences hit every band)
    "llama3_tied": ("LlamaConfig", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False, rope_theta=1e6)),
    # explicit head_dim (32) != hidden / heads (16), q/k norm
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False)),
    # sliding window shorter than the test sequences
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                      sliding_window=8)),
}


def hf_config(name: str, **overrides):
    import transformers
    cls_name, kw = TINY[name]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=256,
                initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    base.update(overrides)
    return getattr(transformers, cls_name)(**base)


def build(name: str, folder, seed: int = 0, dtype=torch.float32, config: dict | None = None, **save_kw):
    """Random HF causal LM of family ``name`` (config fields overridden by ``config``) saved to ``folder`` in
    ``dtype``; returns the fp32 eval-mode torch model with eager attention."""
    import transformers
    torch.manual_seed(seed)
    cfg = hf_config(name, **(config or {}))
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if dtype != torch.float32:
        copy.deepcopy(model).to(dtype).save_pretrained(str(folder), **save_kw)
    else:
        model.save_pretrained(str(folder), **save_kw)
    return model
