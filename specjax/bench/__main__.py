"""Dispatch ``python -m specjax.bench KIND ...`` to ``specjax.bench.<KIND>.main(argv)``."""

import sys

from specjax.cli import dispatch, error_text
from specjax.hub import FetchError

KINDS = {
    "decode": "plain greedy decode tokens/s, specjax vs HF transformers, batch 1 and 8",
    "train": "EAGLE3 train step: tokens/s, step time, MFU for a config",
    "spec": "plain vs speculative decoding on the same prompts: tokens/s, speedup, tau, per-phase times",
    "serve": "load generator against a running server: throughput, TTFT, inter-token latency",
    "heldout": "a run's held-out split: the trainer's predicted accept length vs tau measured by serving it",
    "gemm": "the weight products of a forward over M rows (decode, verify), in two weight layouts: ms, GB/s",
    "tune": "search the speculative tree shape per batch size; write speculative_tune.json next to the head",
}


def run(mod, kind: str, args: list[str]) -> int | None:
    """``mod.main(args)``; what the user must fix (a model folder that is not one, a bad head or tune file, a file
    that does not exist: specjax's errors are ValueErrors) is one line on stderr and exit status 2."""
    try:
        return mod.main(args)
    except (ValueError, OSError, FetchError) as e:
        print(f"python -m specjax.bench {kind}: error: {error_text(e)}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    return dispatch("python -m specjax.bench", {k: (f"specjax.bench.{k}", v) for k, v in KINDS.items()}, argv, run)


if __name__ == "__main__":
    sys.exit(main())
