"""Training checkpoints: exact save/restore, keep-last-K, corrupt/partial latest -> previous good one, export load."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.models import eagle3
from specjax.models.eagle3 import Eagle3Config, VocabMap
from specjax.train.checkpoint import (COMMIT_FILE, Checkpointer, CheckpointError, head_config_from_dict,
                                     head_config_to_dict, load_head_for_export, validate_step_dir)

HEAD = Eagle3Config(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8, vocab_size=50,
                    draft_vocab_size=20, target_hidden_size=16, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=128, rope_scaling=(("factor", 8.0), ("rope_type", "llama3")),
                    aux_layer_ids=(0, 1, 2), eos_token_ids=(3,), dtype="float32")


def _state(seed):
    params = eagle3.init_params(HEAD, jax.random.PRNGKey(seed))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    train = {"opt_state": opt_state, "step": jnp.asarray(seed, jnp.int32), "rng": jax.random.PRNGKey(seed + 100)}
    vm = VocabMap.from_used_ids(np.arange(0, 40, 2), 50)
    return params, train, vm


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _save(ck, step, meta_extra=None):
    params, train, vm = _state(step)
    meta = {"head_config": head_config_to_dict(HEAD), "target_model_path": "/models/t", "data_state":
            {"epoch": 0, "position": step}, **(meta_extra or {})}
    ck.save(step, params=params, train=train, vocab=vm, meta=meta)
    return params, train, vm


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_head_config_roundtrip():
    assert head_config_from_dict(head_config_to_dict(HEAD)) == HEAD


def test_save_restore_exact_and_keep(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=2, async_save=True)
    for s in (1, 2, 3):
        params, train, vm = _save(ck, s)
        ck.poll()
    ck.wait()
    assert ck.valid_steps() == [2, 3]  # keep last 2
    step, out = ck.restore(params=_abstract(params), train=_abstract(train), vocab=_abstract(
        {"d2t": vm.d2t, "t2d": vm.t2d}))
    assert step == 3
    _equal(out["params"], params)
    _equal(out["train"], train)
    assert isinstance(out["params"], eagle3.Eagle3Params)
    assert type(out["train"]["opt_state"]) is type(train["opt_state"])
    np.testing.assert_array_equal(out["vocab"]["d2t"], vm.d2t)
    assert out["meta"]["data_state"] == {"epoch": 0, "position": 3}
    np.testing.assert_array_equal(out["vocab"]["t2d"], vm.t2d)
    ck.close()


@pytest.mark.parametrize("damage", ["truncate", "delete", "no_marker"])
def test_corrupt_latest_falls_back(tmp_path, damage):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep=3, async_save=False)
    p1, t1, _ = _save(ck, 1)
    _save(ck, 2)
    ck.close()
    step_dir = root / "2"
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != COMMIT_FILE
                   and "params" in str(p) and p.stat().st_size > 0)
    assert files
    victim = max(files, key=lambda p: p.stat().st_size)
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    elif damage == "delete":
        victim.unlink()
    else:
        (step_dir / COMMIT_FILE).unlink()
    assert validate_step_dir(__import__("etils").epath.Path(step_dir)) is not None

    ck = Checkpointer(str(root), keep=3, async_save=False)  # quarantines step 2
    assert ck.valid_steps() == [1]
    # a save that never got its marker is as if never made (a kill in the step after orbax finished): moved aside as
    # interrupted, which is not counted as damage (a run with no other step starts fresh rather than refusing)
    prefix = "interrupted-2-" if damage == "no_marker" else "corrupt-2-"
    assert not step_dir.exists() and any(n.startswith(prefix) for n in os.listdir(root))
    if damage == "no_marker":
        assert ck.damaged_steps_seen() == []
    step, out = ck.restore(params=_abstract(p1), train=_abstract(t1))
    assert step == 1
    _equal(out["params"], p1)
    _equal(out["train"], t1)
    _save(ck, 2)  # the step number can be saved again
    ck.close()
    assert Checkpointer(str(root), keep=3).valid_steps() == [1, 2]


def test_export_load_and_empty(tmp_path, capsys):
    with pytest.raises(CheckpointError):
        load_head_for_export(str(tmp_path / "nothing"))
    ck = Checkpointer(str(tmp_path / "ck"), keep=3)
    p, _, vm = _save(ck, 5)
    ck.close()
    cfg, params, vm2, target = load_head_for_export(str(tmp_path / "ck"))
    assert cfg == HEAD and target == "/models/t"
    _equal(params, p)
    np.testing.assert_array_equal(vm2.d2t, vm.d2t)
    np.testing.assert_array_equal(vm2.t2d, vm.t2d)
    cfg, params, _, _ = load_head_for_export(str(tmp_path / "ck" / "5"))  # a step folder works too
    _equal(params, p)
    (tmp_path / "ck" / "7").mkdir()  # a newer step that is not valid: the export says which step it took, and why
    load_head_for_export(str(tmp_path / "ck"))
    err = capsys.readouterr().err
    assert "loading step 5 of" in err and "newer step(s) skipped: 7: no commit marker" in err
    (tmp_path / "ck" / "5" / COMMIT_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .* \(step 5: no commit marker"):
        load_head_for_export(str(tmp_path / "ck"))


def test_relative_directory_is_resolved(tmp_path, monkeypatch):
    # Run configs name checkpoint dirs relative to the working directory (checkpoints/<run>); orbax needs absolute.
    monkeypatch.chdir(tmp_path)
    ck = Checkpointer("checkpoints/run", keep=2, async_save=False)
    params, train, vm = _save(ck, 1)
    ck.wait()
    assert ck.valid_steps() == [1]
    ck.close()
    assert (tmp_path / "checkpoints" / "run" / "1").is_dir()


def _flip_bytes(path, n=48, seed=0):
    """Damage a file in place without changing its size (bit rot, a bad copy)."""
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(data), size=min(n, len(data)), replace=False):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest(step_dir, item):
    files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.stat().st_size > 0]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("item", ["params", "train", "meta"])
def test_same_size_damage_is_detected_and_falls_back(tmp_path, item, capsys):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep=3, async_save=False)
    p1, t1, _ = _save(ck, 1)
    _save(ck, 2)
    ck.close()
    victim = _largest(root / "2", item)
    size = victim.stat().st_size
    _flip_bytes(victim)
    assert victim.stat().st_size == size
    rel = str(victim.relative_to(root / "2"))
    assert validate_step_dir(__import__("etils").epath.Path(root / "2")) is None  # sizes alone cannot see it
    assert rel in validate_step_dir(__import__("etils").epath.Path(root / "2"), content=True)

    ro = load_head_for_export(str(root))  # read-only: falls back to step 1, changes nothing on disk
    _equal(ro[1], p1)
    assert (root / "2").exists()

    ck = Checkpointer(str(root), keep=3, async_save=False)
    assert ck.valid_steps() == [1, 2]
    step, out = ck.restore(params=_abstract(p1), train=_abstract(t1))
    assert step == 1 and out["meta"]["data_state"]["position"] == 1
    _equal(out["params"], p1)
    _equal(out["train"], t1)
    msg = capsys.readouterr().out
    assert f"step 2 cannot be restored (file {rel} is damaged" in msg, msg
    assert not (root / "2").exists() and ck.damaged_steps_seen()[0].startswith("corrupt-2-")
    ck.close()


def test_explicit_damaged_step_is_an_error_naming_the_file(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep=3, async_save=False)
    _save(ck, 1)
    ck.close()
    victim = _largest(root / "1", "params")
    _flip_bytes(victim)
    with pytest.raises(CheckpointError, match=str(victim.relative_to(root / "1")).replace(".", r"\.")):
        load_head_for_export(str(root / "1"))
    with pytest.raises(CheckpointError, match="could be restored"):
        load_head_for_export(str(root))


def test_every_step_damaged_raises(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep=3, async_save=False)
    p1, t1, _ = _save(ck, 1)
    _save(ck, 2)
    ck.close()
    for s in ("1", "2"):
        _flip_bytes(_largest(root / s, "meta"))
    ck = Checkpointer(str(root), keep=3, async_save=False)
    with pytest.raises(CheckpointError, match="no checkpoint .* could be restored"):
        ck.restore(params=_abstract(p1), train=_abstract(t1))
    assert ck.valid_steps() == [] and len(ck.damaged_steps_seen()) == 2
    ck.close()


def test_another_runs_checkpoint_is_not_taken_for_a_damaged_one(tmp_path):
    """Resuming a valid checkpoint of another target (another vocab): a clear mismatch, and the checkpoint stays
    valid and in place (it used to fail to restore, get unmarked and be moved aside as corrupt)."""
    from specjax.train.__main__ import check_resumable
    from specjax.train.checkpoint import CheckpointMismatch
    ck = Checkpointer(str(tmp_path / "ck"), keep=3, async_save=False)
    _save(ck, 1)
    ck.wait()
    other = HEAD.replace(vocab_size=64)
    with pytest.raises(CheckpointMismatch, match="vocab_size 50, this run's target .* has 64"):
        ck.restore(abstract=lambda meta: check_resumable(head_config_from_dict(meta["head_config"]), other,
                                                         meta["target_model_path"], "t", print))
    assert ck.valid_steps() == [1] and not any(p.name.startswith("corrupt-") for p in (tmp_path / "ck").iterdir())
    notes = []
    check_resumable(HEAD, HEAD.replace(draft_vocab_size=30), "/models/t", "/models/u", notes.append)
    assert "draft_vocab_size 20 (config: 30)" in notes[0] and "trained against /models/t" in notes[1]
    ck.close()


def test_a_folder_that_cannot_be_written_is_said_at_once(tmp_path, monkeypatch):
    """A checkpoint folder the run cannot write (a read-only mount, which root's permission bits do not show) is an
    OSError naming it when the Checkpointer opens, not a save that waits minutes for a folder orbax cannot make."""
    from etils import epath

    def refuse(self, *a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(epath.Path, "write_text", refuse)
    with pytest.raises(OSError, match=f"cannot write checkpoints to {tmp_path / 'ck'}: Read-only file system"):
        Checkpointer(str(tmp_path / "ck"), keep=3, async_save=False)


def test_final_export_reaches_a_gs_url(tmp_path, monkeypatch):
    """checkpoint.export with a gs:// checkpoint.dir (a TPU pod's usual one): the head is exported to a local
    temporary folder and copied under the URL, config.json written last (was skipped on gs:// dirs). The URL is
    mapped onto a local folder here (no Cloud Storage in tests), as etils would map it onto a bucket."""
    import types
    from etils import epath

    import train_fixtures as tf
    from specjax.config import ModelConfig
    from specjax.head_weights import load_eagle3_head
    from specjax.train import __main__ as train_main, checkpoint as ckpt_lib

    tcfg = ModelConfig.from_pretrained(tf.make_tiny_model(str(tmp_path / "model")))
    head = Eagle3Config.from_target(tcfg, draft_vocab_size=48, dtype="float32")
    params = eagle3.init_params(head, jax.random.PRNGKey(1))
    vm = VocabMap.from_used_ids(np.arange(48), tcfg.vocab_size)
    bucket, real_path = tmp_path / "bucket", epath.Path

    def fake_path(p, *rest):
        p = str(p)
        if p.startswith("gs://"):
            p = str(bucket / p[len("gs://"):])
        return real_path(p, *rest)

    monkeypatch.setattr(ckpt_lib.epath, "Path", fake_path)
    notes = []
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(checkpoint=types.SimpleNamespace(
        dir="gs://b/run/", export="hf")), state=types.SimpleNamespace(params=params), vocab_map=vm, head_cfg=head,
        target_cfg=tcfg, log=types.SimpleNamespace(info=notes.append))
    assert train_main.export_final_head(run) == "gs://b/run/hf"
    assert sorted(os.listdir(bucket / "b" / "run" / "hf")) == ["config.json", "model.safetensors"]
    got_cfg, got, got_vm = load_eagle3_head(str(bucket / "b" / "run" / "hf"), tcfg, dtype="float32")
    assert got_cfg.draft_vocab_size == 48 and (np.asarray(got_vm.t2d) == np.asarray(vm.t2d)).all()
    np.testing.assert_array_equal(np.asarray(got.fc), np.asarray(params.fc.astype(jnp.bfloat16).astype(np.float32)))
    monkeypatch.setattr(ckpt_lib, "upload_folder", lambda *a: (_ for _ in ()).throw(PermissionError("403")))
    assert train_main.export_final_head(run) is None  # a failed copy is a note; the run still ends well
    assert "not exported to gs://b/run/hf (PermissionError: 403)" in notes[-1]
    assert "export-head gs://b/run/" in notes[-1]
