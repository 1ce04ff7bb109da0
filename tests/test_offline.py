"""Offline mode: --offline.build caches the target's features; training from the cache gives the online losses."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import train_fixtures as tf

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
