"""Offline mode: --offline.build caches the target's features; training from the cache gives the online losses."""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import train_fixtures as tf
from specjax.train import offline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def test_offline_matches_online(tmp_path):
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tf.write_jsonl(str(tmp_path / "data.jsonl"), tf.make_conversations(60, seed=2))
    env = tf.subprocess_env(4, SPECJAX_CACHE=str(tmp_path / "cache"))

    def run(ckpt, *extra):
        cmd = tf.train_command(model, data, str(tmp_path / ckpt), STEPS, "--mesh.tp", "2", *extra)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    run("online")
    cache = str(tmp_path / "features")
    r = run("unused", "--offline.dir", cache, "--offline.build", "true")
    assert "offline cache:" in r.stdout
    man = json.load(open(os.path.join(cache, "manifest.json")))
    assert man["complete"] and man["aux_dim"] == 3 * 64 and man["hidden_dim"] == 64
    assert os.path.getsize(os.path.join(cache, "aux.bin")) == man["tokens"] * 3 * 64 * 4
    run("offline", "--offline.dir", cache)
    on, off = tf.metrics(tmp_path / "online" / "metrics.jsonl"), tf.metrics(tmp_path / "offline" / "metrics.jsonl")
    assert sorted(on) == sorted(off) == list(range(1, STEPS + 1))
    for s in on:
        for k in ("loss", "acc_0", "ploss_1"):
            assert off[s][k] == pytest.approx(on[s][k], rel=1e-4, abs=1e-6), (s, k)
    # the eval at the last step (its own records) on the held-out split, from the cache as from the target
    ev_on, ev_off = (tf.metrics(tmp_path / d / "metrics.jsonl", "eval_loss") for d in ("online", "offline"))
    assert sorted(ev_on) == sorted(ev_off) == [STEPS]
    for k in ("eval_loss", "eval_acc_0"):
        assert ev_off[STEPS][k] == pytest.approx(ev_on[STEPS][k], rel=1e-4, abs=1e-6), k
    # a cache built from other data is refused
    other = tf.write_jsonl(str(tmp_path / "other.jsonl"), tf.make_conversations(10, seed=3))
    cmd = [sys.executable, "-m", "specjax.train", "--config", "configs/tiny.yaml", "--model.path", model,
           "--data.paths", f"[{other}]", "--offline.dir", cache, "--checkpoint.dir", str(tmp_path / "x"),
           "--logging.progress", "false"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "rebuild it" in (r.stdout + r.stderr)
    np.testing.assert_equal(man["tokens"] > 0, True)


def test_offline_tied_target_and_caches_of_another_target(tmp_path):
    """A tied target (SmolLM2's layout) trains from its cache with the online losses (it crashed at the first step:
    the offline step's embeddings lacked the tied table's panels field); a cache is refused in one line when it
    came from another model of the same tokenizer and width (it trained in silence on the wrong features), from a
    target of another dtype, or when a file is shorter than its manifest says; a build leaves no empty checkpoint
    folder."""
    model = tf.make_tiny_model(str(tmp_path / "model"), tied=True)
    other = tf.make_tiny_model(str(tmp_path / "other"), seed=5, tied=True)
    data = tf.write_jsonl(str(tmp_path / "data.jsonl"), tf.make_conversations(24, seed=2))
    env = tf.subprocess_env(1, SPECJAX_CACHE=str(tmp_path / "cache"))
    cache = str(tmp_path / "features")

    def run(ckpt, *extra, model_dir=model, ok=True):
        cmd = tf.train_command(model_dir, data, str(tmp_path / ckpt), 2, *extra)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert (r.returncode == 0) == ok, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout + r.stderr

    run("online")
    run("build", "--offline.dir", cache, "--offline.build", "true")
    assert not (tmp_path / "build").exists()
    run("offline", "--offline.dir", cache)
    on, off = tf.metrics(tmp_path / "online" / "metrics.jsonl"), tf.metrics(tmp_path / "offline" / "metrics.jsonl")
    for s in on:
        assert off[s]["loss"] == pytest.approx(on[s]["loss"], rel=1e-4, abs=1e-6), s
    out = run("x1", "--offline.dir", cache, model_dir=other, ok=False)
    assert "was built with another target's weights" in out and "Traceback" not in out
    out = run("x2", "--offline.dir", cache, "--model.dtype", "bfloat16", ok=False)
    assert "was built with a float32 target, this run's target is bfloat16" in out
    with open(os.path.join(cache, "hidden.bin"), "r+b") as f:
        f.truncate(100)
    out = run("x3", "--offline.dir", cache, ok=False)
    assert "hidden.bin holds 100 bytes" in out and "rebuild it" in out and "Traceback" not in out


def test_cache_space_reserved_before_the_build(tmp_path, monkeypatch):
    """A cache file's space is reserved up front: a full disk is one OSError naming the file and the size (writing
    into a sparse mapping on a full disk was a bare "Bus error"); a filesystem without fallocate still works."""
    dt = np.dtype(np.float32)
    rows = offline._reserve(str(tmp_path / "a.bin"), dt, (10, 4))
    assert rows.shape == (10, 4) and os.path.getsize(tmp_path / "a.bin") == 160

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"b.bin needs 0.00 GB and the disk has less free"):
        offline._reserve(str(tmp_path / "b.bin"), dt, (10, 4))
    assert not (tmp_path / "b.bin").exists()  # what it had reserved is freed again

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    assert offline._reserve(str(tmp_path / "c.bin"), dt, (3, 4)).shape == (3, 4)
    assert os.path.getsize(tmp_path / "c.bin") == 48
