"""Draft vocab map: counts at loss-masked positions, top-Vd with ties by id, fill rule, d2t/t2d, files, CLI."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import train_fixtures as tf
from specjax.head_weights import export_head, load_eagle3_head
from specjax.train import vocab as V
from specjax.train.__main__ import Stop, fresh_head, load_target


def test_counts_only_masked():
    tokens = np.array([1, 2, 2, 3, 3, 3, 9])
    mask = np.array([1, 1, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(V.count_tokens(tokens, mask, 10), [0, 1, 1, 2, 0, 0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="outside"):
        V.count_tokens(np.array([10]), np.array([1]), 10)


def test_top_k_sorted_with_ties_by_id():
    counts = np.array([0, 5, 1, 5, 0, 7, 1, 0, 2, 0])
    # order by count: 5(7), 1(5), 3(5), 8(2), 2(1), 6(1); ties keep the smaller id
    np.testing.assert_array_equal(V.select_draft_ids(counts, 4), [1, 3, 5, 8])
    np.testing.assert_array_equal(V.select_draft_ids(counts, 5), [1, 2, 3, 5, 8])


def test_fill_with_smallest_unused():
    counts = np.array([0, 0, 3, 0, 1, 0, 0, 9])
    np.testing.assert_array_equal(V.select_draft_ids(counts, 5), [0, 1, 2, 4, 7])
    np.testing.assert_array_equal(V.select_draft_ids(np.zeros(6), 3), [0, 1, 2])
    with pytest.raises(ValueError):
        V.select_draft_ids(counts, 9)


def test_d2t_t2d():
    counts = np.array([0, 4, 0, 0, 2, 0, 1, 3])
    vm = V.build_vocab_map(counts, 3)
    used = np.array([1, 4, 7])
    np.testing.assert_array_equal(np.asarray(vm.d2t), used - np.arange(3))
    np.testing.assert_array_equal(np.asarray(vm.t2d), np.isin(np.arange(8), used))
    np.testing.assert_array_equal(np.asarray(vm.draft_to_target(np.arange(3))), used)


@pytest.mark.parametrize("ext", ["npz", "safetensors"])
def test_save_load(tmp_path, ext):
    vm = V.build_vocab_map(np.arange(20) % 7, 6)
    path = str(tmp_path / f"vocab.{ext}")
    V.save_vocab_map(path, vm, counts=np.arange(20))
    back = V.load_vocab_map(path)
    np.testing.assert_array_equal(np.asarray(back.d2t), np.asarray(vm.d2t))
    np.testing.assert_array_equal(np.asarray(back.t2d), np.asarray(vm.t2d))
    with pytest.raises(ValueError, match="inconsistent"):
        V.vocab_map_from_numpy(np.zeros(3, np.int64), np.ones(20, bool))


def test_cli(tmp_path):
    from transformers import LlamaConfig
    model = tmp_path / "model"
    tok = tf.make_tokenizer(str(model))
    LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2).save_pretrained(str(model))
    data = tf.write_jsonl(str(tmp_path / "d.jsonl"), tf.make_conversations(30))
    out = str(tmp_path / "v.npz")
    env = dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "specjax.train.vocab", "--config", "configs/tiny.yaml",
                        "--model.path", str(model), "--data.paths", f"[{data}]", "--data.eval_fraction", "0",
                        "--head.draft_vocab_size", "40", "--out", out], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    vm = V.load_vocab_map(out)
    assert len(vm.d2t) == 40 and int(np.asarray(vm.t2d).sum()) == 40
    # the same as counting by hand
    from specjax.train import data as D
    from specjax.train.config import DataConfig
    enc = D.ChatEncoder(tok)
    td = D.tokenize_records(D.iter_records(DataConfig(paths=(data,))), enc, max_length=256)
    want = V.select_draft_ids(V.count_tokens(td.tokens, td.loss_mask, len(tok)), 40)
    np.testing.assert_array_equal(np.nonzero(np.asarray(vm.t2d))[0], want)


def test_widen_vocab_map_keeps_every_id_then_adds_the_most_frequent():
    counts = np.array([0, 9, 1, 5, 0, 7, 1, 0, 2, 0])
    vm = V.VocabMap.from_used_ids(np.array([0, 3]), 10)  # 0 never occurs: kept all the same
    np.testing.assert_array_equal(np.asarray(V.widen_vocab_map(vm, counts, 5).d2t) + np.arange(5), [0, 1, 3, 5, 8])
    # fewer other ids occur than asked: the smallest unused ones fill
    grown = V.widen_vocab_map(vm, counts, 9)
    np.testing.assert_array_equal(np.nonzero(np.asarray(grown.t2d))[0], np.arange(9))
    for size in (2, 1, 11):
        with pytest.raises(ValueError, match="can only grow"):
            V.widen_vocab_map(vm, counts, size)


def test_vocab_counts_are_read_back_from_npz_only(tmp_path):
    counts = np.arange(20) % 7
    vm = V.build_vocab_map(counts, 6)
    V.save_vocab_map(str(tmp_path / "v.npz"), vm, counts=counts)
    np.testing.assert_array_equal(V.load_vocab_counts(str(tmp_path / "v.npz")), counts)
    V.save_vocab_map(str(tmp_path / "bare.npz"), vm)
    V.save_vocab_map(str(tmp_path / "v.safetensors"), vm, counts=counts)
    for name in ("bare.npz", "v.safetensors"):
        with pytest.raises(ValueError, match="holds no token counts"):
            V.load_vocab_counts(str(tmp_path / name))


def test_widen_lm_head_keeps_rows_and_maps_the_target():
    """Old rows stay as they were at their ids' new places; when the head's rows ARE a linear image of the target's,
    the added rows are that image exactly."""
    from specjax.models import eagle3
    rng = np.random.default_rng(0)
    target_rows = rng.standard_normal((40, 6)).astype(np.float32)  # [V, Ht]
    m = rng.standard_normal((6, 5)).astype(np.float32)  # the map into the head's space (H = 5)
    old, new = np.array([2, 5, 7, 11, 13, 17, 19, 23, 29, 31]), np.arange(0, 40, 1)[::2]
    new = np.union1d(old, new)
    lm_head = (target_rows[old] @ m).T  # [H, Vd]
    out = np.asarray(eagle3.widen_lm_head(lm_head, old, new, target_rows))
    assert out.shape == (5, len(new))
    np.testing.assert_array_equal(out[:, np.searchsorted(new, old)], lm_head)
    np.testing.assert_allclose(out, (target_rows[new] @ m).T, atol=1e-4)


@pytest.mark.parametrize("widen", [None, "data", "counts", "hf"])
def test_finetune_keeps_head_map(tmp_path, widen):
    """--head.init_from: the new run trains the old head's params under the old head's vocab map, whatever the
    data would count; with --head.widen_vocab the map grows to head.draft_vocab_size, every old id kept. "hf": the
    old head given as an HF EAGLE3 folder (a published or SpecForge head); the completed run writes its final head
    as one too (checkpoint.export), equal to the checkpoint's in bf16."""
    import jax
    from specjax.config import ModelConfig
    from specjax.models import eagle3
    from specjax.train.checkpoint import Checkpointer, head_config_to_dict, load_head_for_export
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tf.write_jsonl(str(tmp_path / "d.jsonl"), tf.make_conversations(20))
    tcfg = ModelConfig.from_pretrained(model)
    head = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=48, dtype="float32")
    used = np.arange(tcfg.vocab_size - 48, tcfg.vocab_size)  # ids the data never uses
    vm = V.VocabMap.from_used_ids(used, tcfg.vocab_size)
    ck = Checkpointer(str(tmp_path / "old"))
    ck.save(7, params=eagle3.init_params(head, jax.random.PRNGKey(3)), train={"step": np.int32(7)}, vocab=vm,
            meta={"head_config": head_config_to_dict(head), "target_model_path": model})
    ck.close()
    counted = str(tmp_path / "counts.npz")  # counts that rank ids 0..31 (beside the old ones) first
    V.save_vocab_map(counted, vm, counts=np.r_[np.full(32, 5), np.zeros(tcfg.vocab_size - 32, np.int64)])
    old = str(tmp_path / "old")
    if widen == "hf":
        h_cfg, h_params, h_vm, _ = load_head_for_export(old)
        old = str(tmp_path / "old_hf")
        export_head(h_params, h_cfg, h_vm, old, tcfg, dtype="float32")
    env = tf.subprocess_env(2, SPECJAX_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "specjax.train", "--config", "configs/tiny.yaml", "--model.path", model,
                        "--data.paths", f"[{data}]", "--data.buckets", "[256]", "--training.max_steps", "1",
                        "--training.ttt_length", "1", "--logging.eval_every", "0", "--logging.progress", "false",
                        "--head.init_from", old, "--checkpoint.dir", str(tmp_path / "new")]
                       + (["--head.widen_vocab", "true", "--head.draft_vocab_size", "80"]
                          if widen in ("data", "counts") else [])
                       + (["--head.vocab_map", counted] if widen == "counts" else []),
                       capture_output=True, text=True, env=env, timeout=240,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    size = 80 if widen in ("data", "counts") else 48
    assert f"draft vocab {size} (head" in r.stdout
    said = {"data": "the training tokens", "counts": "the tokens counted in " + counted}.get(widen, "")
    grown = re.search(r"grown from 48 ids \(covering [\d.]+% of " + re.escape(said) + r"\) to 80 \(100.00%\)",
                      r.stdout)
    assert (grown is not None) == (widen in ("data", "counts"))
    cfg, params, vm2, _ = load_head_for_export(str(tmp_path / "new"))
    assert f"HF head (SGLang / vLLM) in {tmp_path / 'new' / 'hf'}" in r.stdout
    hf_cfg, hf_params, hf_vm = load_eagle3_head(str(tmp_path / "new" / "hf"), tcfg, dtype="float32")
    assert hf_cfg.draft_vocab_size == size and (np.asarray(hf_vm.t2d) == np.asarray(vm2.t2d)).all()
    np.testing.assert_array_equal(np.asarray(hf_params.fc, np.float32),
                                  np.asarray(jax.numpy.asarray(params.fc).astype(jax.numpy.bfloat16), np.float32))
    assert cfg.draft_vocab_size == size and params.lm_head.shape[1] == size
    got = np.nonzero(np.asarray(vm2.t2d))[0]
    assert len(got) == size and np.isin(used, got).all()
    if widen == "counts":
        np.testing.assert_array_equal(got, np.r_[np.arange(32), used])


def test_train_with_no_usable_conversations_is_a_clear_error(tmp_path):
    """Data that yields nothing to train on (no answers) stops the trainer with the reason, not a traceback."""
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "a question, no answer"}]}) + "\n")
    env = tf.subprocess_env(2, SPECJAX_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "specjax.train", "--config", "configs/tiny.yaml", "--model.path", model,
                        "--data.paths", f"[{data}]", "--checkpoint.dir", str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=240,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error: no usable conversations" in r.stdout + r.stderr and "empty 1" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    """A data path that does not exist (the shipped recipe run before its regenerate step): the vocab CLI and the
    trainer say which path and what data.paths takes, with exit status 2, not a traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = tf.make_tiny_model(str(tmp_path / "model"))
    argv = ["--config", os.path.join(root, "configs", "tiny.yaml"), "--model.path", model,
            "--data.paths", f"[{tmp_path / 'regenerated.jsonl'}]"]
    assert V.main([*argv, "--out", str(tmp_path / "v.npz")]) == 2
    err = capsys.readouterr().err
    assert "error: data path" in err and "regenerated.jsonl does not exist" in err
    assert V.main([*argv, "--model.path", str(tmp_path / "no-model"), "--out", str(tmp_path / "v.npz")]) == 2
    assert "no-model" in capsys.readouterr().err  # a model path that is no model: one line, no traceback
    env = tf.subprocess_env(2, SPECJAX_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "specjax.train", *argv, "--checkpoint.dir", str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=240, cwd=root)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "regenerated.jsonl does not exist" in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ck").exists()  # a run that stops before its first step leaves no empty folder behind
    (tmp_path / "afile").write_text("")
    r = subprocess.run([sys.executable, "-m", "specjax.train", *argv, "--checkpoint.dir", str(tmp_path / "afile/ck")],
                       capture_output=True, text=True, env=env, timeout=240, cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{tmp_path / 'afile'} is a file, not a folder" in r.stdout


def test_unreadable_vocab_maps_are_clear_errors(tmp_path, capsys):
    """A vocab map file that is not one (the trainer's head.vocab_map) and an --out the format cannot follow are
    errors that name the file, from the library and the trainer; never numpy's pickle advice or a traceback."""
    bad = tmp_path / "garbage.npz"
    bad.write_text("not a zip\n")
    with pytest.raises(ValueError, match="garbage.npz cannot be read as a .npz or .safetensors file"):
        V.load_vocab_map(str(bad))
    with pytest.raises(ValueError, match="name it .npz or .safetensors"):
        V.save_vocab_map(str(tmp_path / "v.txt"), V.build_vocab_map(np.arange(10), 4))
    for head, want in ((dict(init_from=str(tmp_path / "no-ckpt"), vocab_map=None),
                        "head.init_from: .*no-ckpt does not exist .a specjax checkpoint folder or an HF EAGLE3 head"),
                       (dict(init_from=None, vocab_map=str(bad)), "head.vocab_map: vocab map")):
        with pytest.raises(Stop, match=want) as e:
            fresh_head(SimpleNamespace(head=SimpleNamespace(**head)), None, None, None)
        assert e.value.code == 2


def test_a_run_without_a_model_path_says_so():
    """An empty or model-less config: "model.path is not set", not a hub lookup of the empty string."""
    with pytest.raises(Stop, match="model.path is not set") as e:
        load_target(SimpleNamespace(model=SimpleNamespace(path="")), None, None)
    assert e.value.code == 2


@pytest.mark.parametrize("extra, want", [
    (["--head.aux_layer_ids", "[0, 1, 9]"], "head.aux_layer_ids [0, 1, 9]: the target has layers 0..3"),
    (["--mesh.tp", "4"], "needs more than the 2 cpu device(s) here"),
    (["--logging.jsonl", "{tmp}"], "logging.jsonl {tmp} is a folder"),
    (["--model.tokenizer", "{tmp}"], "error: no tokenizer in {tmp}"),
])
def test_setup_errors_are_one_line(tmp_path, extra, want):
    """What the trainer finds wrong once the target is known (layers, devices, a metrics path, a tokenizer) is one
    line and exit status 2, not a traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tf.write_jsonl(str(tmp_path / "d.jsonl"), tf.make_conversations(8))
    extra = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    r = subprocess.run(tf.train_command(model, data, str(tmp_path / "ck"), 1, *extra), capture_output=True,
                       text=True, env=tf.subprocess_env(2, SPECJAX_CACHE=str(tmp_path / "cache")), timeout=240,
                       cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert want.replace("{tmp}", str(tmp_path)) in r.stdout + r.stderr
