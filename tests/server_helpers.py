"""Shared by the server tests: a tiny random Llama with a tiny byte-level BPE tokenizer (ChatML template), and a
server subprocess on a free 127.0.0.1 port. Holds no tests itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass of the target model.",
    "The capital of France is Paris. The capital of Italy is Rome. Hello world, hello there!",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe \u65e5\u672c\u8a9e \U0001F600 emoji and unicode text.",
]
_MODELS: dict[str, str] = {}


def tiny_model_dir(seed: int = 0) -> str:
    """Folder with config.json, model.safetensors, tokenizer.json, tokenizer_config.json (built once per process)."""
    key = f"llama-{seed}"
    if key in _MODELS:
        return _MODELS[key]
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import atexit
    import shutil
    folder = tempfile.mkdtemp(prefix="specjax_tiny_llama_")
    atexit.register(shutil.rmtree, folder, True)  # registered first, so it runs after the servers stop
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    vocab = len(fast)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    _MODELS[key] = folder
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Small shapes: 2 prefill buckets (16, 32) and 4 batch buckets (1, 2, 4, 8) to compile.
ENGINE_KW = dict(dtype="float32", context_length=256, max_total_tokens=8192, page_size=8, chunked_prefill_size=32,
                 max_running_requests=8)
SERVER_FLAGS = [x for k, v in ENGINE_KW.items() for x in (f"--{k.replace('_', '-')}", str(v))] + ["--log-level",
                                                                                                 "warning"]
# Compiled programs persist across the server subprocesses (CPU compiles are slow), in one fresh folder per test
# session. The pytest process itself does not use the persistent cache: with it on for the whole session, XLA:CPU
# segfaulted serializing / reading a speculative_generate executable of a later test (jax 0.10.2).
JAX_CACHE = os.environ.setdefault("SPECJAX_TEST_JAX_CACHE", tempfile.mkdtemp(prefix="specjax_test_jax_cache_"))


_ENGINES: dict = {}


def offline_engine(model_dir: str):
    """One in-process specjax.Engine per model for the whole test session (same options as the test servers)."""
    if model_dir not in _ENGINES:
        import atexit

        import specjax
        eng = specjax.Engine(model_path=model_dir, skip_server_warmup=True, **ENGINE_KW)
        atexit.register(eng.shutdown)
        _ENGINES[model_dir] = eng
    return _ENGINES[model_dir]


class Server:
    """``python -m specjax.serve`` in a subprocess; ``url`` once /health answers."""

    def __init__(self, model_dir: str, *extra: str, timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="specjax_server_", suffix=".log")
        cmd = [sys.executable, "-m", "specjax.serve", "--model-path", model_dir, "--port", str(self.port),
               *SERVER_FLAGS, *extra]
        env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", JAX_COMPILATION_CACHE_DIR=JAX_CACHE,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self._log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


_SHARED: dict = {}
SHARED_NAME = "tiny-llama"


def shared_server() -> Server:
    """One plain server (served as SHARED_NAME, metrics on) shared by the test modules of this process."""
    if "plain" not in _SHARED:
        import atexit
        _SHARED["plain"] = Server(tiny_model_dir(), "--served-model-name", SHARED_NAME, "--enable-metrics")
        atexit.register(_SHARED["plain"].stop)
    return _SHARED["plain"]


def sse_events(lines) -> list:
    """Parse an SSE body (iterable of lines) into JSON objects; asserts it ends with [DONE]."""
    out, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "event after [DONE]"
        out.append(json.loads(data))
    assert done, "stream did not end with data: [DONE]"
    return out


def idle_state(url: str, timeout: float = 20.0, headers: dict | None = None) -> dict:
    """The server's scheduler state once no request runs or waits. /get_server_info is the state at the end of the
    scheduler's last iteration, so right after a stream's last event it can still show the request running."""
    deadline = time.time() + timeout
    while True:
        state = httpx.get(url + "/get_server_info", headers=headers).json()["internal_states"][0]
        if (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0) or time.time() > deadline:
            return state
        time.sleep(0.05)


# Fixtures of the modules that talk to the shared server (test_server_native.py, test_server_openai.py): one startup.
@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server(model_dir):
    return shared_server()


def random_eagle3_kw(folder: str, out: str, topk: int = 2) -> dict:
    """Engine options that serve a random EAGLE3 head for the tiny model ``folder``, exported to ``out``: 3 draft
    steps, ``topk``, 4 draft tokens."""
    from spec_models import random_models

    from specjax.convert.head import export_head
    from specjax.weights import load_model
    cfg, _ = load_model(folder, dtype="float32")
    _, (hcfg, hparams, vmap), _ = random_models(cfg, seed=3, draft_vocab=200)
    export_head(hparams, hcfg, vmap, out, cfg)
    return dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=out, speculative_num_steps=3,
                speculative_eagle_topk=topk, speculative_num_draft_tokens=4)
