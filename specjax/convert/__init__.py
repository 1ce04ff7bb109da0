"""Conversions: GGUF -> HF folder, fetching the real SmolLM2 model, EAGLE3 head export/import."""
