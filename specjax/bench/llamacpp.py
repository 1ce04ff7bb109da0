"""llama.cpp as the CPU peer of the decode benchmarks (``bench decode --vs llama.cpp``), through llama-cpp-python's
bindings of llama.cpp's C API (optional: ``pip install llama-cpp-python``, which builds llama.cpp from source).

The runner decodes greedily exactly n tokens for every prompt at once: one ``llama_batch`` per step with a sequence
id per prompt (so batch 8 is llama.cpp's own batched decode), logits of each sequence's last token, argmax in numpy.
Its weights are a GGUF of the same model (``hub.fetch_smollm2_gguf``: the published Q4_1 file, or that file
dequantised to F32 / BF16, i.e. exactly the weights specjax loads), and it uses the same thread count.

``LlamaServer`` runs llama.cpp's ``llama-server`` for ``bench spec --vs-llama-server``: llama.cpp's plain and EAGLE3
decoding of the same prompts, on the same weights, with the head exported by specjax converted to GGUF.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import numpy as np

from specjax.host import cpu_flags


def _load():
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("error: --vs llama.cpp needs llama-cpp-python (`pip install llama-cpp-python`; it builds "
                         "llama.cpp from source, about 6 minutes on 2 cores)") from None
    if not hasattr(_load, "quiet"):  # llama.cpp logs every tensor it loads to stderr; keep the bench's output readable
        _load.quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_load.quiet, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


class LlamaCppRunner:
    """``runner(n)``: greedy decode of exactly n new tokens for every prompt (prompt prefill included), returning the
    tokens; equal-length prompts, as the other engines of ``bench decode`` get."""

    def __init__(self, gguf_path: str, prompts: list[list[int]], threads: int, max_new_tokens: int):
        lib = self.lib = _load()
        self.prompts, self.b, self.plen = prompts, len(prompts), len(prompts[0])
        mp = lib.llama_model_default_params()
        # On CPUs with AMX, llama.cpp repacks quantised weights (Q4_1 here) for its AMX int8 kernels, which crashed
        # the process (SIGSEGV) on a 32-token prompt batch on a 2-core Xeon VM with amx_int8; its plain CPU kernels
        # run instead there. F32 and BF16 weights never use those buffers, so their figures are unaffected.
        mp.use_extra_bufts = "amx_int8" not in cpu_flags()
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), mp)
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {gguf_path}")
        cp = lib.llama_context_default_params()
        cp.n_seq_max = self.b
        cp.n_ctx = self.b * (self.plen + max_new_tokens + 16)
        cp.n_batch = cp.n_ubatch = max(512, self.b * self.plen)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(self.b * self.plen, 0, 1)

    def _decode(self, items) -> list[int]:
        """items [(token, position, sequence, wants logits)] in one llama_decode; the argmax of each logits row."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, out
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(1 for *_, out in items if out)
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(rows, self.vocab)).argmax(-1).tolist()

    def __call__(self, n: int) -> list[list[int]]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        toks = self._decode([(t, p, s, p == self.plen - 1) for s, pr in enumerate(self.prompts)
                             for p, t in enumerate(pr)])
        outs = [[t] for t in toks]
        for step in range(1, n):
            toks = self._decode([(toks[s], self.plen + step - 1, s, True) for s in range(self.b)])
            for out, t in zip(outs, toks):
                out.append(t)
        return outs

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


class LlamaServer:
    """llama.cpp's own HTTP server (``llama-server``, built from llama.cpp's source) on a free local port, plain or
    with an EAGLE3 draft (``-md HEAD.gguf --spec-type draft-eagle3``): the way a llama.cpp user runs speculative
    decoding, since the Python bindings do not expose it. ``complete(ids, n)`` is one greedy request with the prompt
    as token ids; it returns the tokens and llama.cpp's timings (``draft_n``, ``draft_n_accepted`` with a draft)."""

    def __init__(self, binary: str, gguf: str, threads: int, draft_gguf: str | None = None, n_max: int = 3,
                 p_min: float = 0.0, ctx: int = 4096, timeout_s: float = 180.0):
        if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
            raise SystemExit(f"error: {binary} is not an executable llama-server (build it from llama.cpp's source: "
                             "cmake -B build -DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port)]
        if draft_gguf:
            cmd += ["-md", draft_gguf, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n_max),
                    "--spec-draft-p-min", str(p_min), "-td", str(threads), "-tbd", str(threads)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                self.log.seek(0)
                tail = "".join(self.log.readlines()[-15:])
                raise SystemExit(f"error: llama-server did not start ({' '.join(cmd)}); its log ends:\n{tail}")
            time.sleep(0.5)

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def _healthy(self) -> bool:
        try:
            return self._request("/health").get("status") == "ok"
        except (OSError, ValueError):
            return False

    def complete(self, ids: list[int], n: int) -> tuple[list[int], dict]:
        r = self._request("/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                          "cache_prompt": False, "return_tokens": True, "stream": False})
        return list(r["tokens"]), r.get("timings", {})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)
