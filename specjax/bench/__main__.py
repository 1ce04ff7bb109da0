"""Dispatch ``python -m specjax.bench KIND ...`` to ``specjax.bench.<KIND>.main(argv)``."""

import sys

from specjax.cli import dispatch

KINDS = {
    "decode": "plain greedy decode tokens/s, specjax vs HF transformers, batch 1 and 8",
    "train": "EAGLE3 train step: tokens/s, step time, MFU for a config",
    "spec": "plain vs speculative decoding on the same prompts: tokens/s, speedup, tau, per-phase times",
    "serve": "load generator against a running server: throughput, TTFT, inter-token latency",
    "heldout": "a run's held-out split: the trainer's predicted accept length vs tau measured by serving it",
    "gemm": "the weight products of a forward over M rows (decode, verify), in two weight layouts: ms, GB/s",
    "tune": "search the speculative tree shape per batch size; write speculative_tune.json next to the head",
}


def main(argv=None) -> int:
    return dispatch("python -m specjax.bench", {k: (f"specjax.bench.{k}", v) for k, v in KINDS.items()}, argv,
                    lambda mod, _kind, args: mod.main(args))


if __name__ == "__main__":
    sys.exit(main())
