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
    procs = [subprocess.Popen(cmd("two", "--multihost.coordinator", f"127.0.0.1:{port}",
                                  "--multihost.num_processes", "2", "--multihost.process_id", str(i)),
                              cwd=ROOT, env=env(8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert "2 process(es)" in outs[0] and "on 16 cpu devices" in outs[0]

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
