"""Draft heads shipped inside the package, and the default (target, head) pair.

``smollm2-135m-instruct-eagle3/``: an EAGLE3 head for SmolLM2-135M-Instruct trained by specjax on ShareGPT prompts
answered by SmolLM2 itself (``python -m specjax.train.regenerate``), exported in the HF ``LlamaForCausalLMEagle3``
format (bf16) with its tuned tree shapes (``speculative_tune.json``). How it was trained and what it reaches:
docs/benchmarks.md. It is the default of ``python -m specjax.serve``, ``python -m specjax.generate`` and
``specjax.Engine()`` when no model is given.
"""

from __future__ import annotations

import os

HEADS_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_HEAD = os.path.join(HEADS_DIR, "smollm2-135m-instruct-eagle3")
DEFAULT_ALGORITHM = "EAGLE3"


def default_head_available() -> bool:
    return os.path.isfile(os.path.join(DEFAULT_HEAD, "config.json"))
