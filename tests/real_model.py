"""The real SmolLM2-135M-Instruct of the specjax cache, for the tests that need it (they skip without it)."""

import os

import pytest

from specjax.hub import default_smollm2_path


def smollm2_path() -> str:
    """The converted SmolLM2 folder; skips the calling test when ``python -m specjax.convert fetch-smollm2`` has not
    been run."""
    path = default_smollm2_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.skip(f"SmolLM2 cache not found at {path}; run python -m specjax.convert fetch-smollm2")
    return path
