"""Two local processes x 8 CPU devices (jax.distributed over gloo) train exactly like one process x 16 devices:
each process feeds only its own rows of every global batch, and the losses agree step for step."""

import os
import socket
import subprocess

import pytest

import train_fixtures as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(cmds, cwds, env) -> list[tuple[int, str]]:
    procs = [subprocess.Popen(c, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c, d in zip(cmds, cwds)]
    outs = []
    for p in procs:
        try:
            outs.append((p.communicate(timeout=400)[0], p.returncode))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
    return [(code, out) for out, code in outs]


def test_two_processes_match_one(tmp_path):
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tf.write_jsonl(str(tmp_path / "data.jsonl"), tf.make_conversations(80, seed=9))

    def cmd(run, *extra):
        return tf.train_command(model, data, str(tmp_path / run), STEPS, "--logging.eval_batches", "1",
                                "--checkpoint.every", "100", "--mesh.dp", "4", "--mesh.tp", "4", *extra)

    def env(devices):
        return tf.subprocess_env(devices, SPECJAX_CACHE=str(tmp_path / "cache"), JAX_COMPILATION_CACHE_DIR="",
                                 JAX_ENABLE_COMPILATION_CACHE="false")

    one = subprocess.run(cmd("one"), cwd=ROOT, env=env(16), capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    port = _free_port()
    runs = _run_two([cmd("two", "--multihost.coordinator", f"127.0.0.1:{port}", "--multihost.num_processes", "2",
                         "--multihost.process_id", str(i)) for i in range(2)], [ROOT, ROOT], env(8))
    for code, out in runs:
        assert code == 0, out[-4000:]
    outs = [out for _, out in runs]
    assert "2 process(es)" in outs[0] and "on 16 cpu devices" in outs[0]
    # the final head, split over tp across the two hosts, gathered and written once (by process 0) as an HF folder
    assert f"HF head (SGLang / vLLM) in {tmp_path / 'two' / 'hf'}" in outs[0]
    assert sorted(os.listdir(tmp_path / "two" / "hf")) == ["config.json", "model.safetensors"]

    a, b = tf.metrics(tmp_path / "one" / "metrics.jsonl"), tf.metrics(tmp_path / "two" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert {a[s]["seq_len"] for s in a} == {b[s]["seq_len"] for s in b} == {128}  # the one 128-token bucket
    for s in a:
        for key in ("loss", "acc_0", "ploss_1", "grad_norm"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5, abs=1e-6), (s, key, a[s][key], b[s][key])
    ea = tf.metrics(tmp_path / "one" / "metrics.jsonl", "eval_loss")
    eb = tf.metrics(tmp_path / "two" / "metrics.jsonl", "eval_loss")
    assert list(ea) == list(eb) == [STEPS]
    assert eb[STEPS]["eval_loss"] == pytest.approx(ea[STEPS]["eval_loss"], rel=1e-5)
    from specjax.train.checkpoint import Checkpointer
    assert Checkpointer(str(tmp_path / "two")).latest_step() == STEPS


def test_processes_that_disagree_stop_at_once(tmp_path):
    """Every process says why and exits 2, before any step: started with different settings (another seed gave each
    host its own "replicated" head in silence), or with a checkpoint folder that is not one folder for all (a
    relative path from two working directories stands for two hosts' local disks: the first save hung for ever)."""
    model = tf.make_tiny_model(str(tmp_path / "model"))
    data = tf.write_jsonl(str(tmp_path / "data.jsonl"), tf.make_conversations(40, seed=9))
    env = tf.subprocess_env(2, SPECJAX_CACHE=str(tmp_path / "cache"), JAX_COMPILATION_CACHE_DIR="",
                            JAX_ENABLE_COMPILATION_CACHE="false")

    def cmd(ckpt, i, port, *extra):
        c = tf.train_command(model, data, ckpt, 1, "--mesh.dp", "4", "--mesh.tp", "1", "--multihost.coordinator",
                             f"127.0.0.1:{port}", "--multihost.num_processes", "2", "--multihost.process_id", str(i),
                             *extra)
        return [os.path.join(ROOT, a) if a == "configs/tiny.yaml" else a for a in c]

    port = _free_port()
    runs = _run_two([cmd(str(tmp_path / "ck"), 0, port), cmd(str(tmp_path / "ck"), 1, port, "--training.seed", "1")],
                    [ROOT, ROOT], env)
    for i, (code, out) in enumerate(runs):
        assert code == 2, out[-3000:]
        assert f"process {i}: error: the processes were started with different settings: training.seed" in out
        assert f"training.seed={i}" in out and "Traceback" not in out
    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for d in cwds:
        d.mkdir()
    port = _free_port()
    runs = _run_two([cmd("ck", i, port) for i in range(2)], cwds, env)
    for i, (code, out) in enumerate(runs):
        assert code == 2, out[-3000:]
        assert f"process {i}: error: checkpoint.dir" in out and "is not one folder that every process sees" in out
        assert "process(es) [1]" in out and "Traceback" not in out
        assert "data: kept" not in out  # said before the data and the target load
    assert not (cwds[0] / "ck").exists()  # no empty checkpoint folder left behind
