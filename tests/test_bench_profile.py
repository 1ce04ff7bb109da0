"""bench.profile: a device trace summarised per kernel (union of busy time, span, top kernels)."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from specjax.bench.profile import _union_us, summarize, trace_call


def _write(tmp_path, events):
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def _meta(pid, name, tid=None, kind="process_name"):
    e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def test_union_of_overlapping_intervals():
    assert _union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert _union_us([]) == 0


def test_summary_counts_stream_kernels_once_per_unit(tmp_path):
    events = [_meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
              _meta(2, "Stream #13(Compute)", tid=13, kind="thread_name"),
              _meta(2, "XLA Ops", tid=99, kind="thread_name")]
    # two tokens: each a 30 us gemv and a 10 us add, with 10 us idle between kernels; the XLA Ops line repeats them
    t = 0.0
    for _ in range(2):
        for name, dur in (("gemv_bf16", 30.0), ("add_fusion", 10.0)):
            events.append({"ph": "X", "pid": 2, "tid": 13, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 2, "tid": 99, "ts": t, "dur": dur, "name": "op." + name})
            t += dur + 10.0
    events.append({"ph": "X", "pid": 1, "tid": 5, "ts": 0.0, "dur": 500.0, "name": "host work"})
    s = summarize(_write(tmp_path, events), units=2)
    assert s["device"] == "/device:GPU:0" and s["events_per_unit"] == 2
    assert s["busy_ms_per_unit"] == pytest.approx(0.040)
    assert s["span_ms_per_unit"] == pytest.approx(0.055)  # 110 us from the first start to the last end, over 2
    assert s["busy_fraction"] == pytest.approx(80 / 110)
    assert [k["name"] for k in s["top"]] == ["gemv_bf16", "add_fusion"]
    assert s["top"][0]["share"] == pytest.approx(0.75) and s["top"][0]["calls_per_unit"] == 1


def test_tpu_trace_reads_its_xla_ops_line(tmp_path):
    events = [_meta(3, "/device:TPU:0"), _meta(3, "XLA Modules", tid=1, kind="thread_name"),
              _meta(3, "XLA Ops", tid=2, kind="thread_name")]
    events.append({"ph": "X", "pid": 3, "tid": 1, "ts": 0.0, "dur": 100.0, "name": "jit_step"})
    events += [{"ph": "X", "pid": 3, "tid": 2, "ts": t, "dur": 20.0, "name": "fusion.1"} for t in (0.0, 50.0)]
    s = summarize(_write(tmp_path, events), units=1)
    assert s["events"] == 2 and s["busy_ms_per_unit"] == pytest.approx(0.040)
    assert s["span_ms_per_unit"] == pytest.approx(0.070)


def test_device_without_events_is_said(tmp_path):
    path = _write(tmp_path, [_meta(4, "/device:CPU:0"), _meta(1, "/host:CPU")])
    with pytest.raises(ValueError, match=r"no device events in the trace at .* \(/device:CPU:0\); on a CPU"):
        summarize(path, units=1)


def test_cpu_trace_has_no_device(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    path = trace_call(lambda: f(x), str(tmp_path / "trace"))
    with pytest.raises(ValueError, match="no device"):
        summarize(path, units=1)
    with pytest.raises(ValueError, match="units"):
        summarize(path, units=0)
