"""The training CLI on configs/tiny.yaml: killed mid-way (SIGKILL) or stopped (SIGTERM) and resumed, the loss
trajectory equals an uninterrupted run's, step for step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train_fixtures as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_run")
    model = tf.make_tiny_model(str(root / "model"))
    data = tf.write_jsonl(str(root / "data.jsonl"), tf.make_conversations(120, seed=5))
    return root, model, data


def _cmd(assets, run: str, *extra):
    root, model, data = assets
    return [sys.executable, "-m", "specjax.train", "--config", "configs/tiny.yaml", "--model.path", model,
            "--data.paths", f"[{data}]", "--data.max_length", "128", "--data.buckets", "[128]",
            "--training.ttt_length", "2", "--training.max_steps", str(STEPS), "--logging.eval_every", "0",
            "--logging.progress", "false", "--logging.every", "1", "--checkpoint.every", "3",
            "--checkpoint.dir", str(root / run), *extra]


def _env(assets, devices=4):
    root = assets[0]
    return tf.subprocess_env(devices, SPECJAX_CACHE=str(root / "cache"),
                             JAX_COMPILATION_CACHE_DIR=str(root / "jax_cache"),
                             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _losses(path):
    """step -> loss; a step logged twice (re-run after a kill) keeps its last value."""
    out = {}
    try:  # (the trainer's start-up probe of the path creates and removes it: not there, or gone since a check)
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _run(cmd, env):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _start_and_wait(cmd, env, metrics, until_step):
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if max(_losses(metrics), default=0) >= until_step:
            return p
        time.sleep(0.02)
    out = p.communicate(timeout=60)[0] if p.poll() is not None else ""
    p.kill()
    pytest.fail(f"run did not reach step {until_step} (rc {p.returncode}): {out[-3000:]}")


def test_kill_and_sigterm_resume_match_uninterrupted(assets):
    root = assets[0]
    env = _env(assets)
    _run(_cmd(assets, "straight"), env)
    want = _losses(root / "straight" / "metrics.jsonl")
    assert sorted(want) == list(range(1, STEPS + 1))

    # SIGKILL mid-way: no chance to save; resume from the last committed checkpoint
    metrics = root / "killed" / "metrics.jsonl"
    p = _start_and_wait(_cmd(assets, "killed"), env, metrics, until_step=8)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    killed_at = max(_losses(metrics))
    assert killed_at < STEPS, "the run finished before it could be killed"
    # SIGTERM during the resumed run: it saves a checkpoint at the current step and exits cleanly
    p = _start_and_wait(_cmd(assets, "killed"), env, metrics, until_step=killed_at + 3)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out[-3000:]
    assert "saving a checkpoint" in out and "(rerun the same command to go on)" in out
    stopped_at = max(_losses(metrics))
    from specjax.train.checkpoint import Checkpointer
    assert Checkpointer(str(root / "killed")).latest_step() == stopped_at
    r = _run(_cmd(assets, "killed"), env)
    assert f"resumed from {root / 'killed'} step {stopped_at}" in r.stdout
    assert "settings differ" not in r.stdout  # the same command: nothing to say
    got = _losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=1e-7), (s, got[s], want[s])

    # the final checkpoint loads for export
    from specjax.train.checkpoint import load_head_for_export
    head_cfg, params, vm, target = load_head_for_export(str(root / "killed"))
    assert head_cfg.draft_vocab_size == 64 and len(vm.d2t) == 64 and target == assets[1]


def _flip(path, n=48):
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), max(1, len(data) // n))[:n]:
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_file(folder):
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_damaged_checkpoints_fall_back_or_stop(assets):
    """Same-size damage in the newest step -> resume from the previous one, naming the file; every step damaged ->
    exit 1 with a clear error (also on the rerun), unless --checkpoint.resume false starts fresh."""
    root = assets[0]
    env = _env(assets, devices=1)
    run = root / "damaged"
    _run(_cmd(assets, "damaged", "--training.max_steps", "6", "--logging.every", "3"), env)
    victim = _largest_file(run / "6" / "params")
    _flip(victim)
    r = _run(_cmd(assets, "damaged", "--training.max_steps", "9", "--logging.every", "3"), env)
    assert f"file {victim.relative_to(run / '6')} is damaged" in r.stdout, r.stdout[-3000:]
    assert f"resumed from {run} step 3" in r.stdout
    assert "settings differ from the checkpoint's run: training.max_steps 9 (was 6)" in r.stdout, r.stdout[-3000:]

    from specjax.train.checkpoint import Checkpointer
    steps = Checkpointer(str(run)).valid_steps()
    for s in steps:
        _flip(run / str(s) / "meta" / "metadata")
    cmd = _cmd(assets, "damaged", "--training.max_steps", "12", "--logging.every", "3")
    for expect in ("could be restored", "holds no usable checkpoint, only damaged ones"):
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and expect in r.stdout and "--checkpoint.resume false" in r.stdout, \
            r.stdout[-3000:] + r.stderr[-3000:]
        assert "Traceback" not in r.stderr
    assert Checkpointer(str(run)).valid_steps() == []
    r = _run(cmd + ["--checkpoint.resume", "false"], env)
    assert "resumed" not in r.stdout and Checkpointer(str(run)).latest_step() == 12
    # now the folder holds that run's steps: a fresh start there would delete them as it saves (keep), so it stops
    r = subprocess.run(cmd + ["--checkpoint.resume", "false"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "of an earlier run and checkpoint.resume is false" in r.stdout, r.stdout[-3000:]
    assert Checkpointer(str(run)).latest_step() == 12


def test_nonfinite_loss_never_reaches_a_checkpoint(assets, tmp_path):
    """A target whose final norm holds NaN gives a NaN loss at every step: each update is skipped, and after
    training.max_nonfinite_steps in a row the run stops with exit 1 before saving anything."""
    import shutil

    import numpy as np
    from specjax.safetensors_io import SafetensorsFile, save_file
    model = tmp_path / "nan_model"
    shutil.copytree(assets[1], model)
    sf = SafetensorsFile(str(model / "model.safetensors"))
    tensors = {k: sf.tensor(k) for k in sf.keys()}
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.nan)
    save_file(tensors, str(model / "model.safetensors"))
    cmd = _cmd(assets, "nan_run", "--model.path", str(model), "--training.max_nonfinite_steps", "3",
               "--training.max_steps", "9", "--logging.every", "1")
    r = subprocess.run(cmd, cwd=ROOT, env=_env(assets, devices=1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 updates in a row had a non-finite loss or gradient" in r.stdout
    assert "the update was skipped" in r.stdout and "Traceback" not in r.stderr
    from specjax.train.checkpoint import Checkpointer
    assert Checkpointer(str(assets[0] / "nan_run")).valid_steps() == []


def test_saturated_head_stops_the_run(assets):
    """A learning rate far too high saturates the head in a few updates: its gradient becomes exactly zero and the
    loss stays finite, so nothing is skipped; after training.max_zero_grad_steps such updates in a row the run stops
    with exit 1, saying since when and which checkpoint holds the saturated head (it used to end "done")."""
    cmd = _cmd(assets, "dead_run", "--optimizer.lr", "1e3", "--optimizer.warmup_ratio", "0",
               "--training.max_zero_grad_steps", "3", "--training.max_steps", "30", "--logging.every", "1")
    r = subprocess.run(cmd, cwd=ROOT, env=_env(assets, devices=1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "updates since step" in r.stdout and "training.max_zero_grad_steps=3" in r.stdout, r.stdout[-3000:]
    assert "the head saturated and no longer learns" in r.stdout and "Traceback" not in r.stderr
    assert "done at step" not in r.stdout


def test_a_second_signal_exits_at_once():
    """The first SIGTERM asks the loop to save and stop at the next step; a second one ends the process through the
    default action (a save that cannot finish held a run that `timeout` or tpu_scripts/stop.sh had signalled, and a
    thread stuck in C++ runs no Python handler), leaving the last complete checkpoint."""
    code = ("import os, signal, time\n"
            "from specjax.train.__main__ import watch_signals\n"
            "stop = watch_signals()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "assert stop['signal'] == signal.SIGTERM, stop\n"
            "print('first taken', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -15, r.stdout + r.stderr  # ended by the signal itself, as a stuck process would be
    assert "first taken" in r.stdout and "the same signal again exits at once" in r.stdout


def test_gs_folder_without_gcsfs_is_one_line(assets, tmp_path):
    """A gs:// checkpoint folder without gcsfs stops before the target and data load, naming the package (it was an
    ImportError traceback at the first save, after both had loaded); export-head says the same. The child processes
    see neither gcsfs nor TensorFlow whether or not this machine has them (a sitecustomize marks both absent)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['gcsfs'] = None\n"
                                                "sys.modules['tensorflow'] = None\n")
    env = _env(assets, devices=1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    cmd = _cmd(assets, "unused")
    cmd[cmd.index("--checkpoint.dir") + 1] = "gs://some-bucket/run"
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "gs:// folders need the gcsfs package" in r.stdout and "Traceback" not in r.stderr
    assert "data:" not in r.stdout  # nothing loaded first
    r = subprocess.run([sys.executable, "-m", "specjax.convert", "export-head", "gs://some-bucket/run", "out"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "gs:// folders need the gcsfs package" in r.stderr, r.stderr[-2000:]
