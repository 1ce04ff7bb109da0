"""Run recipes (``*.yaml``) and model shapes (``models/*.json``, HF config.json files) shipped with specjax.

In the repository this is the top-level ``configs/`` folder; installed, it is the package ``specjax.configs``. A
bare name (``qwen2.5-7b.yaml``, ``qwen2.5-7b``) resolves here from any directory; anything that exists as a path
is used as that path.
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.join(DIR, "models")


def recipes() -> list[str]:
    """The shipped run configs, by file name."""
    return sorted(f for f in os.listdir(DIR) if f.endswith(".yaml"))


def model_shapes() -> list[str]:
    """The shipped model shapes (HF config.json files), by name without .json."""
    return sorted(f[:-5] for f in os.listdir(MODELS_DIR) if f.endswith(".json"))


def resolve(name: str) -> str:
    """A run config path: ``name`` itself when it exists, else the shipped recipe of that name (``.yaml`` optional,
    a leading ``configs/`` ignored). Unknown names come back unchanged (the caller reports them)."""
    if os.path.exists(name):
        return name
    base = name[len("configs/"):] if name.startswith("configs/") else name
    for cand in (base, base + ".yaml"):
        path = os.path.join(DIR, cand)
        if os.sep not in cand.strip(os.sep) and os.path.isfile(path):
            return path
    return name


def model_shape(name: str) -> str | None:
    """The shipped HF config.json of a model shape (``qwen2.5-7b``, ``llama-3.1-8b``, ``smollm2-135m``; a hub id such
    as ``meta-llama/Llama-3.1-8B-Instruct`` names the same shape), or None."""
    stem = os.path.basename(name.rstrip("/"))
    for suffix in (".yaml", ".json"):
        stem = stem[:-len(suffix)] if stem.endswith(suffix) else stem
    base = stem.lower()
    for suffix in ("-instruct", "-chat"):  # a hub id's base model has the same shape
        base = base[:-len(suffix)] if base.endswith(suffix) else base
    for cand in (stem, base):
        path = os.path.join(MODELS_DIR, cand + ".json")
        if os.path.isfile(path):
            return path
    return None


def help_text() -> str:
    return (f"shipped run configs (a bare name works from any directory): {', '.join(recipes())}; "
            f"model shapes: {', '.join(model_shapes())}")


def model_config_json(model_path: str, recipe: str | None = None) -> str | None:
    """The HF config.json that gives a run's model shape without its weights: ``model_path``'s own when it is a
    local folder (or json), else the shipped shape named like the recipe (``qwen2.5-7b.yaml`` ->
    ``models/qwen2.5-7b.json``) or like ``model_path`` itself; None if there is none."""
    path = os.path.expanduser(model_path or "")
    local = path if path.endswith(".json") else os.path.join(path, "config.json")
    if path and os.path.isfile(local):
        return local
    for name in (recipe, model_path):
        if name and model_shape(name):
            return model_shape(name)
    return None
