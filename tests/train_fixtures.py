"""Tiny, fully local training assets: a byte-level BPE tokenizer with a chat template, a tiny random Llama saved
in HF format, and synthetic chat data. Used by the train tests and by configs/tiny.yaml:

    python tests/train_fixtures.py /tmp/specjax-tiny      # -> /tmp/specjax-tiny/{model,data.jsonl}
"""

from __future__ import annotations

import json
import os
import random
import sys

from specjax.kernels import cpu_dense

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-style: the last assistant turn (after the last user message) gets a thinking block, history does not;
# enable_thinking=false puts an empty thinking block into the generation prompt.
THINKING = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% if loop.index0 > ns.last_user %}<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

WORDS = ("the a cat dog sat on mat red blue green one two three four five what is why how tell me about "
         "sky sea tree bird fish run jump eat sleep happy sad big small yes no please thanks hello world").split()


def sentence(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_tokenizer(out_dir: str, template: str = CHATML, vocab_size: int = 320):
    """Train a byte-level BPE on the word list and save it with ``template``; returns the fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([sentence(rng) for _ in range(2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = template
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def make_tiny_model(out_dir: str, vocab_size: int = 320, seed: int = 0, tied: bool = False) -> str:
    """A tiny random Llama in HF format (config.json, fp32 model.safetensors) plus the tiny tokenizer, written
    without torch (specjax's own random init and HF-name mapping) so that it is fast; ``tied``: the lm_head is the
    embedding (SmolLM2's layout)."""
    import jax
    import numpy as np
    from specjax.config import ModelConfig
    from specjax.models import target
    from specjax.safetensors_io import save_file
    from specjax.weights import params_to_hf

    tok = make_tokenizer(out_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": max(vocab_size, len(tok)),
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": tied, "hidden_act": "silu", "eos_token_id": eos, "torch_dtype": "float32"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    cfg = ModelConfig.from_hf_dict(hf)
    params = target.init_params(cfg, jax.random.PRNGKey(seed), scale=0.1)
    save_file({k: np.asarray(v, np.float32) for k, v in params_to_hf(params, cfg).items()},
              os.path.join(out_dir, "model.safetensors"))
    return out_dir


def make_tiny_model_transformers(out_dir: str, vocab_size: int = 320, seed: int = 0) -> str:
    """The same shape of model built and saved by transformers (torch)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(out_dir)
    vocab_size = max(vocab_size, len(tok))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), torch_dtype="float32")
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, max_turns)):
            turns.append({"from": "human", "value": sentence(rng)})
            turns.append({"from": "gpt", "value": sentence(rng, 4, 30)})
        rec = {"id": str(i), "conversations": turns}
        if rng.random() < 0.2:
            rec["conversations"] = [{"from": "system", "value": "be brief"}] + turns
        out.append(rec)
    return out


def write_jsonl(path: str, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def subprocess_env(devices: int, **extra: str) -> dict:
    """The environment of a CLI run in a child process on ``devices`` fake CPU devices: this process's XLA flags (with
    the suite's fast-compile flags, tests/conftest.py, unless the suite runs with XLA's defaults) at that device
    count, JAX on the CPU, the tokenizers single-threaded, and ``extra``. A ``SPECJAX_CACHE`` of the child's own
    shares this process's compiled CPU kernels (``share_kernels``)."""
    if extra.get("SPECJAX_CACHE"):
        share_kernels(extra["SPECJAX_CACHE"])
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return dict(os.environ, XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}", *flags]),
                JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", **extra)


def share_kernels(cache: str) -> None:
    """Point ``cache``/kernels at this process's folder of compiled CPU kernels (``kernels.cpu_dense``: one file per
    source, jaxlib and CPU, written under a temporary name and renamed), so that a child run with a cache of its own
    loads them instead of compiling them again (about 30 s of a 2-core machine per child)."""
    shared = cpu_dense.library_path().parent
    link = os.path.join(cache, shared.name)
    if os.path.lexists(link) or os.path.abspath(link) == os.path.abspath(shared):
        return
    os.makedirs(shared, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    os.symlink(shared, link, target_is_directory=True)


def train_command(model: str, data: str, ckpt_dir: str, steps: int, *extra: str) -> list[str]:
    """``python -m specjax.train`` on configs/tiny.yaml with a tiny model and data: 128-token rows, TTT length 2,
    ``steps`` steps with an eval at the last one and a metrics line every step, then ``extra`` overrides."""
    return [sys.executable, "-m", "specjax.train", "--config", "configs/tiny.yaml", "--model.path", model,
            "--data.paths", f"[{data}]", "--data.max_length", "128", "--data.buckets", "[128]",
            "--training.ttt_length", "2", "--training.max_steps", str(steps), "--logging.eval_every", str(steps),
            "--logging.progress", "false", "--logging.every", "1", "--checkpoint.dir", ckpt_dir, *extra]


def metrics(path, key: str = "loss") -> dict:
    """step -> record, for the lines of a run's metrics.jsonl that hold ``key``."""
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f) if key in r}


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/specjax-tiny"
    make_tiny_model(os.path.join(root, "model"))
    write_jsonl(os.path.join(root, "data.jsonl"), make_conversations(200))
    print(f"tiny model in {root}/model, data in {root}/data.jsonl")
