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
    ab_vocab = {"d2t": jax.ShapeDtypeStruct((20,), jnp.int32), "t2d": jax.ShapeDtypeStruct((50,), jnp.bool_)}
    step, out = ck.restore(params=_abstract(params), train=_abstract(train), vocab=_abstract(
        {"d2t": vm.d2t, "t2d": vm.t2d}))
    assert step == 3
    _equal(out["params"], params)
    _equal(out["train"], train)
    assert isinstance(out["params"], eagle3.Eagle3Params)
    assert type(out["train"]["opt_state"]) is type(train["opt_state"])
    np.testing.assert_array_equal(out["vocab"]["d2t"], vm.d2t)
    assert out["meta"]["data_state"] == {"epoch": 0, "position": 3}
    assert ab_vocab["t2d"].shape == out["vocab"]["t2d"].shape
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
    assert not step_dir.exists() and any(n.startswith("corrupt-2-") for n in os.listdir(root))
    step, out = ck.restore(params=_abstract(p1), train=_abstract(t1))
    assert step == 1
    _equal(out["params"], p1)
    _equal(out["train"], t1)
    _save(ck, 2)  # the step number can be saved again
    ck.close()
    assert Checkpointer(str(root), keep=3).valid_steps() == [1, 2]


def test_export_load_and_empty(tmp_path):
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


def test_relative_directory_is_resolved(tmp_path, monkeypatch):
    # Run configs name checkpoint dirs relative to the working directory (checkpoints/<run>); orbax needs absolute.
    monkeypatch.chdir(tmp_path)
    ck = Checkpointer("checkpoints/run", keep=2, async_save=False)
    params, train, vm = _save(ck, 1)
    ck.wait()
    assert ck.valid_steps() == [1]
    ck.close()
    assert (tmp_path / "checkpoints" / "run" / "1").is_dir()
