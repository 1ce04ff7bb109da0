"""Dispatch ``python -m specjax.bench KIND ...`` to ``specjax.bench.<KIND>.main(argv)``."""

import importlib
import sys

KINDS = {
    "decode": "plain greedy decode tokens/s, specjax vs HF transformers, batch 1 and 8",
    "train": "EAGLE3 train step: tokens/s, step time, MFU for a config",
    "spec": "plain vs speculative decoding on the same prompts: tokens/s, speedup, tau, per-phase times",
    "serve": "load generator against a running server: throughput, TTFT, inter-token latency",
    "heldout": "a run's held-out split: the trainer's predicted accept length vs tau measured by serving it",
    "tune": "search the speculative tree shape per batch size; write speculative_tune.json next to the head",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in KINDS:
        print("usage: python -m specjax.bench {%s} [--help]\n" % ",".join(KINDS))
        for k, v in KINDS.items():
            print(f"  {k:8s} {v}")
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    mod = importlib.import_module(f"specjax.bench.{argv[0]}")
    return mod.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
