"""llama.cpp as the CPU peer of the decode benchmarks (``bench decode --vs llama.cpp``), through llama-cpp-python's
bindings of llama.cpp's C API (optional: ``pip install llama-cpp-python``, which builds llama.cpp from source).

The runner decodes greedily exactly n tokens for every prompt at once: one ``llama_batch`` per step with a sequence
id per prompt (so batch 8 is llama.cpp's own batched decode), logits of each sequence's last token, argmax in numpy.
Its weights are a GGUF of the same model (``hub.fetch_smollm2_gguf``: the published Q4_1 file, or that file
dequantised to F32 / BF16, i.e. exactly the weights specjax loads), and it uses the same thread count.
"""

from __future__ import annotations

import numpy as np


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
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), lib.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {gguf_path}")
        cp = lib.llama_context_default_params()
        cp.n_seq_max = self.b
        cp.n_ctx = self.b * (self.plen + max_new_tokens + 16)
        cp.n_batch = cp.n_ubatch = max(512, self.b * self.plen)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.vocab = lib.llama_n_vocab(lib.llama_model_get_vocab(self.model))
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
