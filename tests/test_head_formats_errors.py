"""``convert import-head`` / ``export-head`` on heads as they come: the dtype a head's weights are stored in is kept
whatever config.json's label says (``torch_dtype``, or ``dtype`` as transformers >= 4.56 writes it), so an fp16 or
fp32 head goes through import -> export bit for bit; a label specjax does not know, a damaged safetensors file, an
EAGLE-1 head and a checkpoint whose target moved are each one line naming what is wrong, never a traceback."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
from spec_models import np_init

from specjax import head_weights
from specjax.config import ModelConfig
from specjax.convert.__main__ import main
from specjax.models import eagle3
from specjax.safetensors_io import SafetensorsError, SafetensorsFile, save_file

V, H, VD, L = 64, 32, 24, 4
TARGET = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H,
              intermediate_size=64, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, torch_dtype="float32", hidden_act="silu")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    (folder / "config.json").write_text(json.dumps(TARGET))
    return str(folder), ModelConfig.from_pretrained(str(folder))


def _head(folder, tcfg, stored: str = "float32", label: dict | None = None, **config) -> str:
    """An HF EAGLE3 head folder, weights stored in ``stored``; ``label`` replaces config.json's torch_dtype and
    ``config`` sets other fields (None: removed)."""
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=VD, dtype="float32")
    params = np_init(eagle3.param_shapes(hcfg), 0, 0.3)
    vmap = eagle3.VocabMap.from_used_ids(np.arange(0, 2 * VD, 2), V)
    head_weights.export_head(params, hcfg, vmap, str(folder), tcfg, dtype=stored, log=lambda *_: None)
    hf = json.loads((folder / "config.json").read_text())
    if label is not None:
        del hf["torch_dtype"]
        hf.update(label)
    hf.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return str(folder)


def _tensors(folder) -> dict[str, bytes]:
    sf = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {k: (sf.header[k]["dtype"], sf.tensor(k).tobytes()) for k in sf.keys()}


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("stored, label", [
    ("float32", {"torch_dtype": "bfloat16"}),  # a label narrower than the weights: was cast to bf16
    ("float16", {"dtype": "float16"}),  # transformers >= 4.56's key: was not read (bfloat16)
    ("float32", {}),  # no label at all
])
def test_a_head_keeps_the_dtype_it_is_stored_in(tmp_path, target, capsys, stored, label):
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg, stored, label)
    cfg, params, _ = head_weights.load_eagle3_head(src, tcfg)
    assert cfg.dtype == stored and params.fc.dtype == np.dtype(stored)
    assert main(["import-head", src, str(tmp_path / "hf"), "--target", tdir, "--format", "hf"]) == 0
    assert f"stored in {stored}" in capsys.readouterr().out
    assert _tensors(tmp_path / "hf") == _tensors(src)
    assert json.loads((tmp_path / "hf/config.json").read_text())["torch_dtype"] == stored


@pytest.mark.parametrize("stored", ["float16", "float32"])
def test_import_then_export_is_exact_and_a_moved_target_is_named(tmp_path, target, capsys, stored):
    """import-head -> checkpoint -> export-head (no --dtype) writes the source's bytes; a checkpoint whose recorded
    target no longer exists says where that path came from and that --target replaces it."""
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg, stored, {"dtype": stored})
    moved = shutil.copytree(tdir, tmp_path / "t")
    assert main(["import-head", src, str(tmp_path / "ck"), "--target", str(moved)]) == 0
    shutil.rmtree(moved)
    assert main(["export-head", str(tmp_path / "ck"), str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert f"recorded its target model as {moved}, which does not exist" in err and "pass --target" in err
    assert main(["export-head", str(tmp_path / "ck"), str(tmp_path / "out"), "--target", tdir]) == 0
    assert _tensors(tmp_path / "out") == _tensors(src)
    assert json.loads((tmp_path / "out/config.json").read_text())["torch_dtype"] == stored


@pytest.mark.parametrize("label", ["bf16", "float8", "int8", "auto"])
def test_unknown_dtype_labels_are_refused(tmp_path, target, capsys, label):
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg, label={"torch_dtype": label})
    assert main(["import-head", src, str(tmp_path / "out"), "--target", tdir, "--format", "hf"]) == 2
    err = _error(capsys)
    assert f"config.json: unsupported dtype '{label}'" in err and "float32, bfloat16, float16" in err
    assert not (tmp_path / "out").exists()


def test_quantized_weights_are_refused(tmp_path, target, capsys):
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg)
    tensors = {k: np.array(v) for k, v in ((k, SafetensorsFile(f"{src}/model.safetensors").tensor(k))
                                          for k in SafetensorsFile(f"{src}/model.safetensors").keys())}
    tensors["fc.weight"] = tensors["fc.weight"].astype(np.int8)
    save_file(tensors, f"{src}/model.safetensors")
    assert main(["import-head", src, str(tmp_path / "out"), "--target", tdir, "--format", "hf"]) == 2
    assert "tensor 'fc.weight' is stored as int8" in _error(capsys)


def _rewrite_header(path: str, edit) -> None:
    """Replace the header of safetensors file ``path`` by ``edit(header)`` (a dict, or raw bytes)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    new = edit(header)
    blob = new if isinstance(new, bytes) else json.dumps(new).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _without(key):
    return lambda h: {**h, "fc.weight": {k: v for k, v in h["fc.weight"].items() if k != key}}


@pytest.mark.parametrize("edit, message", [
    (_without("dtype"), "tensor 'fc.weight' has no dtype in the header"),
    (_without("shape"), "tensor 'fc.weight' has no shape in the header"),
    (_without("data_offsets"), "tensor 'fc.weight' has no data_offsets in the header"),
    (lambda h: list(h.items()), "corrupt header: a JSON list, not an object"),
    (lambda h: b"\xff" + json.dumps(h).encode()[1:], "corrupt header: not UTF-8 text"),
    (lambda h: {**h, "fc.weight": {**h["fc.weight"], "dtype": "F16"}}, r"tensor 'fc.weight' holds \d+ bytes, but F16"),
    (lambda h: {**h, "fc.weight": {**h["fc.weight"], "shape": [3 * H, 2 * H]}}, "holds .* bytes, but F32 of shape"),
    (lambda h: {**h, "fc.weight": 7}, "tensor 'fc.weight' has a header entry 7"),
])
def test_damaged_safetensors_name_the_file_and_tensor(tmp_path, target, capsys, edit, message):
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg)
    path = f"{src}/model.safetensors"
    _rewrite_header(path, edit)
    with pytest.raises(SafetensorsError, match=f"^{path}: .*{message}"):
        SafetensorsFile(path)
    assert main(["import-head", src, str(tmp_path / "out"), "--target", tdir]) == 2
    assert _error(capsys).startswith(f"error: {path}: ")


@pytest.mark.parametrize("architectures", [None, ["LlamaForCausalLM"], ["Eagle3LlamaForCausalLM"]])
def test_export_head_reads_every_head_folder_import_head_reads(tmp_path, target, architectures):
    """A head with no architectures, or LlamaForCausalLM's (as config_from_hf takes), was "no valid checkpoint"."""
    tdir, tcfg = target
    src = _head(tmp_path / "src", tcfg, architectures=architectures)
    assert main(["export-head", src, str(tmp_path / "out"), "--target", tdir]) == 0
    assert _tensors(tmp_path / "out") == _tensors(src)


def test_eagle1_heads_and_files_are_named(tmp_path, target, capsys):
    tdir, _ = target
    e1 = tmp_path / "e1"
    e1.mkdir()
    (e1 / "config.json").write_text(json.dumps(dict(TARGET, num_hidden_layers=1)))  # an EAGLE-1 head, Llama's name
    save_file({"fc.weight": np.zeros((H, 2 * H), np.float32), "fc.bias": np.zeros((H,), np.float32),
               "layers.0.self_attn.q_proj.weight": np.zeros((H, H), np.float32)}, str(e1 / "model.safetensors"))
    for command in ("import-head", "export-head"):
        assert main([command, str(e1), str(tmp_path / "out"), "--target", tdir]) == 2
        err = _error(capsys)
        assert f"{e1} is an EAGLE-1/2 head (its tensors: fc with a bias" in err
        assert "--speculative-algorithm EAGLE --speculative-draft-model-path" in err
    assert main(["export-head", str(e1 / "config.json"), str(tmp_path / "out")]) == 2
    assert f"{e1 / 'config.json'} is a file: pass a training checkpoint folder" in _error(capsys)


def test_help_says_what_each_argument_takes(capsys):
    for command, wants in (("import-head", ["model.safetensors or pytorch_model.bin", "new or empty"]),
                           ("export-head", ["pytorch_model.bin", "required for an HF head folder",
                                            "new, empty, or holding only an earlier export", "the head's own"])):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(w in text for w in wants), (command, text)
