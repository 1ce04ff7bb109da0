"""The output folder of the convert commands (``cli.check_output_folder``, shared by ``convert gguf``,
``export-head`` and ``import-head``): new or empty, or exactly an earlier output of the same command, never a folder
whose own files would be left beside the new config.json and weights."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from specjax.cli import OutputFolderError, check_output_folder
from specjax.convert.__main__ import main
from specjax.gguf_io import HF_MODEL_FILES


def _folder(path, files: dict[str, str]) -> str:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return str(path)


def test_gguf_refuses_a_folder_with_files_of_its_own(tmp_path, capsys):
    """``convert gguf`` made the folder with exist_ok and wrote over it, the folder's own files left beside."""
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")  # never read: the folder is refused first
    out = _folder(tmp_path / "out", {"notes.txt": "mine"})
    assert main(["gguf", str(src), out]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} is not empty: convert into a new (or empty) folder") and len(
        err.splitlines()) == 1
    assert os.listdir(out) == ["notes.txt"]
    assert main(["gguf", str(src), str(src)]) == 1
    assert f"error: {src} is a file: convert into a new (or empty) folder" in capsys.readouterr().err


LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"]})
EARLIER = {name: "{}" for name in HF_MODEL_FILES} | {"config.json": LLAMA}


@pytest.mark.parametrize("files, replaced", [
    (None, False),  # no folder yet
    ({}, False),  # empty
    (EARLIER, True),  # exactly an earlier conversion: replaced
    (EARLIER | {"model.safetensors.tmp": ""}, True),  # and the leftover of a write cut short
    (EARLIER | {"README.md": "mine"}, None),  # anything else beside it
    ({"config.json": LLAMA, "tokenizer.json": "{}"}, None),  # part of a model folder
    (EARLIER | {"config.json": json.dumps({"architectures": ["LlamaForCausalLMEagle3"]})}, None),  # another kind
    ({k: v for k, v in EARLIER.items() if k != "config.json"}, None),  # a run cut short: remove it
])
def test_check_output_folder(tmp_path, files, replaced):
    path = str(tmp_path / "out") if files is None else _folder(tmp_path / "out", files)
    if replaced is None:
        with pytest.raises(OutputFolderError, match=f"{path} is not empty: convert into a new"):
            check_output_folder(path, "convert", HF_MODEL_FILES, "LlamaForCausalLM")
    else:
        assert check_output_folder(path, "convert", HF_MODEL_FILES, "LlamaForCausalLM") is replaced
    with pytest.raises(OutputFolderError, match="import into a new .or empty. folder$") if files else \
            contextlib.nullcontext():
        assert check_output_folder(path, "import") is False  # nothing to replace: only new or empty folders
